"""Stage `controls`: V0's six controls, run on the actual pair and mapper before anything is evaluated.

Compatibility (`kv.contract`), cache serialization, cached decode (the exactness gate), corruption detection, RoPE
against the model and deterministic mapper serialization (PROTOCOL.md). A failed control fails the stage naming it,
so no evaluate stage runs; those stages read metrics/controls_verdict.json, each control's `passed` alone, while
metrics/controls.json holds the figures each control measured.
"""
from __future__ import annotations

import gc
import hashlib
import json
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.kv.contract import Contract
from pipeline.kv.decode import chunked_logprobs, full_logprobs, greedy_rollout
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import cache_to_layers, pre_rope_keys
from pipeline.kv.mapnames import MapName
from pipeline.kv.mapper import load_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.rope import RotarySpec, Rotation
from pipeline.measure.compare import read_prompts
from pipeline.schema.controls import ControlsParams, Float32Tolerance, ReducedTolerance, ToleranceParams
from pipeline.store import paths
from pipeline.store.artifacts import load_artifact, save_artifact, verify_file, write_json_atomic
from pipeline.store.cli import Refusal, entry, no_arguments, run_stage
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import load_section
from pipeline.store.ranks import stage_ranks

torch = lazy("torch")


class ControlFailed(Refusal, RuntimeError):
    pass


def compatibility(contract: Contract) -> dict:
    """The contract's verdict: passes when the mapped handoff, the study's subject, is defined."""
    return {"passed": contract.defined("mapped"), "tokenizers": contract.tokenizers,
            "defined_modes": " ".join(mode for mode in contract.modes if contract.defined(mode)),
            "source_geometry": contract.source.geometry, "target_geometry": contract.target.geometry,
            "modes": {mode: reason or "defined" for mode, reason in contract.modes.items()},
            "families": {family: reason or "defined" for family, reason in contract.families.items()}}


def serialization(layers, folder: Path) -> dict:
    """A target cache written as an artifact and read back: passes when every tensor is bit-identical, dtype too."""
    tensors = {f"{kind}.{i}": t for i, (k, v) in enumerate(layers) for kind, t in (("keys", k), ("values", v))}
    path = folder / "cache.safetensors"
    save_artifact(path, tensors, {"layers": len(layers)})
    loaded, _ = load_artifact(path)
    identical = all(torch.equal(tensors[name].cpu(), loaded[name].cpu()) and tensors[name].dtype == loaded[name].dtype
                    for name in tensors)
    return {"passed": bool(identical and set(loaded) == set(tensors)), "tensors": len(tensors),
            "bytes": path.stat().st_size}


def cached_decode(target, prompts, tolerance: Float32Tolerance | ReducedTolerance, horizon: int, folder: Path,
                  handoff_cls=Handoff) -> dict:
    """Exactness gate on (context, continuation) prompts: the oracle path with its prefix cache serialized and read
    back before injection vs the full forward.

    The noise floor is the model's own: the largest |delta log p| between the full forward and the same sequence in
    chunks through its cache, in its dtype (or the dtype's resolution at the largest |log p|, if larger). Rounding
    grows with depth (a real 30-layer model in bfloat16: a floor above 1); a wrong cache is off by much more. The
    allowed |delta log p| is `noise_multiple` times the floor. In float32 no decision may flip and every greedy
    rollout must match; in reduced precision a decision may flip only where the chunked computation flips it too or
    its top-two margin is below max(floor, `decision_margin`)."""
    reduced = isinstance(tolerance, ReducedTolerance)
    handoff = handoff_cls(target)
    max_delta, floor, largest, greedy_same = 0.0, 0.0, 0.0, 0
    flipped = []  # (margin, whether the chunked computation flips it too) of each flipped decision
    decisions = 0
    with torch.no_grad():
        for context, continuation in tqdm(prompts, desc=f"cached decode {target.dtype}", unit="prompt"):
            layers = handoff.prefix_layers(torch.tensor([list(context[:-1])]))
            save_artifact(folder / "prefix.safetensors",
                          {f"{i}.{j}": t for i, pair in enumerate(layers) for j, t in enumerate(pair)}, {})
            stored, _ = load_artifact(folder / "prefix.safetensors", device=handoff.device)
            layers = [(stored[f"{i}.0"], stored[f"{i}.1"]) for i in range(len(layers))]
            cached = handoff.step_logprobs(layers, torch.tensor([[context[-1], *continuation[:-1]]]))[0]  # (m, V)
            full = full_logprobs(target, context, continuation)  # (m, V)
            chunked = chunked_logprobs(target, context, continuation)  # (m, V)
            max_delta = max(max_delta, float((cached - full).abs().max()))
            floor = max(floor, float((chunked - full).abs().max()))
            largest = max(largest, float(full.abs().max()))
            # a decision: which of the top-2 tokens the model prefers at each position
            top2 = full.topk(2, dim=-1)  # values, indices: (m, 2)
            preferred = top2.indices[:, 0]  # (m,)
            for position in (cached.argmax(-1) != preferred).nonzero().flatten().tolist():
                margin = float(top2.values[position, 0] - top2.values[position, 1])
                flipped.append((margin, int(chunked[position].argmax()) != int(preferred[position])))
            decisions += len(full)
            rollout = greedy_rollout(handoff, [list(context)], horizon)[0].tolist()
            sequence = list(context)
            for _ in range(horizon):
                sequence.append(
                    int(target(input_ids=torch.tensor([sequence]).to(target.device)).logits[0, -1].argmax()))
            greedy_same += rollout == sequence[len(context):]
    floor = max(floor, torch.finfo(target.dtype).eps * largest)
    allowed = tolerance.noise_multiple * floor
    figures = {"dtype": str(target.dtype).replace("torch.", ""), "max_abs_delta_logprob": max_delta,
               "noise_floor": floor, "noise_multiple": tolerance.noise_multiple, "allowed_abs_delta": allowed}
    if reduced:  # kernels sum in other orders: a flip is rounding where the model's own chunking flips it too
        flip_margin = max(tolerance.decision_margin, floor)
        explained = [chunk_flips or margin < flip_margin for margin, chunk_flips in flipped]
        passed = max_delta <= allowed and all(explained)
        figures.update(decision_margin=tolerance.decision_margin, flip_margin=flip_margin,
                       flipped_under_margin=sum(margin < flip_margin for margin, _ in flipped),
                       flipped_in_chunked_too=sum(chunk_flips for _, chunk_flips in flipped),
                       flips_unexplained=explained.count(False))
    else:  # exact up to float rounding: no flip, no diverging rollout
        passed = max_delta <= allowed and not flipped and greedy_same == len(prompts)
    return {"passed": bool(passed), **figures, "prompts": len(prompts), "positions_compared": decisions,
            "decisions_flipped": len(flipped), "greedy_rollouts_identical": greedy_same}


def corruption(path: Path, flips: int, folder: Path) -> dict:
    """The map at `path` with one bit flipped, at each of its first 64 bytes (the header's length and metadata),
    near the header's end and at `flips` places spread over the whole file: passes when every copy is refused."""
    raw = path.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    positions = sorted(set(list(range(0, min(header_end, 64))) + [header_end - 2] +
                           [int(i * (len(raw) - 1) / max(1, flips - 1)) for i in range(flips)]))
    accepted = []
    for position in positions:
        broken = bytearray(raw)
        broken[position] ^= 0x01
        copy = folder / path.name
        copy.write_bytes(broken)
        try:
            load_mapper(copy)
            accepted.append(position)
        except Exception:  # noqa: BLE001 - any refusal counts; only a silent load is a failure
            pass
    return {"passed": not accepted, "flips_tested": len(positions), "flips_accepted": len(accepted),
            "file": str(path)}


def rope_against_model(model, prompts: list[list[int]], spec_: RotarySpec, tolerance: float) -> dict:
    """Per layer, strip(cached keys) against the model's keys before rotation, and apply(strip(keys)) against the
    cached keys, each error relative to the largest magnitude compared: a float32 ulp of a real model's keys (Qwen2's
    biased keys reach the hundreds) is above any absolute tolerance for unit-scale keys."""
    worst, round_trip, positions_checked = 0.0, 0.0, 0
    for token_ids in prompts:
        before, layers = pre_rope_keys(model, token_ids)
        rotation = Rotation(spec_, torch.arange(len(token_ids), device=model.device))
        for keys_before, (keys_rotated, _) in zip(before, layers):
            keys_content = rotation.strip(keys_rotated.float())  # (1, H, T, D) float32
            scale = float(keys_before.float().abs().max())
            worst = max(worst, float((keys_content - keys_before.float()).abs().max()) / scale)
            round_trip = max(round_trip, float((rotation.apply(keys_content) - keys_rotated.float()).abs().max())
                             / float(keys_rotated.float().abs().max()))
        positions_checked = max(positions_checked, len(token_ids))
    return {"passed": worst <= tolerance and round_trip <= tolerance, "max_relative_error": worst,
            "round_trip_relative_error": round_trip, "tolerance": tolerance, "prompts": len(prompts),
            "positions_checked": positions_checked}


def refit_in_subprocess(out: Path, name: str) -> None:
    """Fit's narrow refit of `name`; for a distilled map (`<start>+kl`), its start's, then distilled again."""
    start = str(MapName.parse(name).start)
    run_stage("pipeline.fit", "--out", str(out), "--only", start, fresh_process=True)
    if MapName.parse(name).distilled:
        run_stage("pipeline.distill", "--only", start, "--mappers", str(out), "--out", str(out), fresh_process=True)


def deterministic_refit(mapper: Path, name: str, folder: Path) -> dict:
    """The selected `name` refitted alone from the same caches in a fresh process (PROTOCOL.md: fitting twice, in
    two separate processes) must be byte-identical to the file written while fitting every candidate."""
    out = folder / "refit"
    refit_in_subprocess(out, name)
    # fit and distill both write into `out`: a distilled map's file is named as fit's are, by its name
    refit_digest = hashlib.sha256(paths.fitted_map(name, out).read_bytes()).hexdigest()
    selected = hashlib.sha256(mapper.read_bytes()).hexdigest()
    # no candidate name or digest here: a new mapper that passes must leave this file, which every evaluate
    # stage depends on, byte-identical, so the oracle's evaluation is not rerun for it
    return {"passed": refit_digest == selected, "processes": 2, "matches_selected_file": refit_digest == selected}


def run(params: ControlsParams, models: ModelsParams, device: str, tolerances: ToleranceParams) -> dict:
    prompts = read_prompts(paths.EVAL_PROMPTS)[: params.prompts]
    pair = Pair.load(models, device, max_tokens=max(len(c) + len(e) for c, e in prompts) + params.horizon)
    results = {"compatibility": compatibility(pair.contract)}
    if not results["compatibility"]["passed"]:  # refused from the configs: nothing is loaded or run
        return results
    with tempfile.TemporaryDirectory(prefix="controls-") as scratch:
        folder = Path(scratch)
        float32_pair = None
        # one target in memory at a time (a real-shape target in float32 is most of a small machine's memory)
        for dtype in dict.fromkeys([models.dtype] + (["float32", "bfloat16"] if device == "cpu" else [])):
            in_dtype = Pair.load(models, device, dtype)
            target = in_dtype.target
            if dtype == models.dtype:
                probe = torch.tensor([prompts[0][0]]).to(device)
                results["cache_serialization"] = serialization(
                    cache_to_layers(target.model(input_ids=probe, use_cache=True).cache), folder)
            results[f"cached_decode_{dtype}"] = cached_decode(
                target, prompts, tolerances.float32 if dtype == "float32" else tolerances.bfloat16, params.horizon,
                folder)
            float32_pair = in_dtype if dtype == "float32" else float32_pair
            del target, in_dtype
        results["corruption_detection"] = corruption(paths.SELECTED_MAPPER, params.corruption_flips, folder)
        # the rotary settings do not depend on the dtype; float32 keeps rounding far below any real error
        float32_pair = float32_pair or Pair.load(models, device, "float32")
        exact = {"target": float32_pair.target, "source": float32_pair.source}
        contexts = [list(context) for context, _ in prompts]
        per_model = {name: rope_against_model(model, contexts, RotarySpec.from_model(model),
                                              tolerances.float32.rope_relative) for name, model in exact.items()}
        results["rope_against_model"] = {
            "passed": all(v["passed"] for v in per_model.values()),
            "max_relative_error": max(v["max_relative_error"] for v in per_model.values()),
            "round_trip_relative_error": max(v["round_trip_relative_error"] for v in per_model.values()),
            "tolerance": tolerances.float32.rope_relative, "positions_checked": len(max(contexts, key=len)),
            **per_model}
        del exact, float32_pair  # the refits below run in other processes: leave them the memory
        gc.collect()
        selected = json.loads(paths.SELECT.read_text())["selected"]
        results["deterministic_mapper"] = deterministic_refit(paths.SELECTED_MAPPER, selected, folder)
    return results


def verdict(results: dict) -> dict[str, bool]:
    """Each control's pass alone: its figures may move in their last digits from run to run, and a stage that
    depended on them would never be restored from the run cache."""
    return {name: entry["passed"] for name, entry in results.items()}


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.controls", __doc__, argv)
    params = load_section(ControlsParams, "controls")
    models = load_section(ModelsParams, "models")
    machine = load_section(MachineParams, "machine")
    tolerances = load_section(ToleranceParams, "tolerances")
    verify_file(paths.SELECTED_MAPPER)  # a damaged selected mapper is refused by its checksum, before any control runs
    with stage_ranks(machine.torch_device, threads=machine.threads) as stage:
        results = run(params, models, stage.device, tolerances)
        stage.write_metrics(paths.CONTROLS, results, usage_to=paths.CONTROLS_USAGE)
        write_json_atomic(paths.CONTROLS_VERDICT, verdict(results))
    compatible = results["compatibility"]
    if not compatible["passed"]:  # the pair is refused from its configs: no other control ran
        raise ControlFailed(f"control compatibility failed: {compatible['modes']['mapped']}")
    failed = [name for name, entry in results.items() if not entry["passed"]]
    print(json.dumps(verdict(results), indent=2))
    if failed:
        raise ControlFailed(f"control(s) failed: {', '.join(failed)}; see metrics/controls.json. Nothing is evaluated.")


if __name__ == "__main__":
    entry(main)
