"""Stage `fit`: per-layer maps from the source's content-space cache to the target's, one file per candidate.

    python -m pipeline.fit

Reads `caches/source`, `caches/target` (from `extract`), `models/source` and `data/select.parquet` (only to
time the mappers against the source's prefill); writes `models/mappers/<candidate>.safetensors`,
`metrics/fit.json`, `metrics/fit_layers.csv` (R² per candidate, target layer, head and kind) and
`metrics/fit_probe.csv` (the single-layer probes that chose the source layers).

1. Probes. Some fit sequences (`fit.probe_holdout`, seeded) are held out; for every target layer l and source
   layer p a single-layer ridge is fitted on the rest and scored on them (R², mean of keys and values). The
   k source layers for l are the k best. One pass over the shards serves a group of target layers for all
   source layers, the group sized so the accumulators fit `fit.accumulator_gib`.
2. Ridge families. Per target layer, the moments of the `max(fit.ks)` chosen layers' inputs are accumulated
   on all fit sequences and, separately, on the select split; every k (its top-k layers), every lambda and
   the head-matched family are index selections of them: solved once per layer and scored in and out of
   sample from moments, with no further pass.
3. MLP family. Per target layer, rows of the chosen layers (`fit.mlp.ks`) are gathered and a one-hidden-layer
   map is trained with Adam, early-stopped on the probe's held-out fit sequences.
Each candidate's per-layer tensors are spilled to disk as soon as solved, and one candidate at a time is
assembled and written, so memory holds the accumulators of one group of layers plus one mapper.
"""
from __future__ import annotations

import argparse
import csv
import resource
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from pipeline import ridge
from pipeline.artifacts import atomic_path, write_json_atomic
from pipeline.cachefiles import KINDS, Shard, paired_split, read_manifest
from pipeline.mapper import Mapper, save_mapper
from pipeline.mlpfit import MlpSettings, train_mlp
from pipeline.models import load_model
from pipeline.params import load_section, spec

Pairs = list[tuple[Shard, Shard]]


@dataclass
class MlpParams:
    ks: list[int] = spec([1], min=1)  # chosen source layers read by the MLP (one candidate per k); [] for none
    hidden: int = spec(256, min=1)
    lr: float = spec(1e-3, positive=True)
    batch_rows: int = spec(256, min=1)
    max_epochs: int = spec(50, min=1)
    patience: int = spec(5, min=1)  # epochs without a better held-out loss before stopping


@dataclass
class FitParams:
    mlp: MlpParams
    ks: list[int] = spec([1, 4, 8], min=1)
    lambdas: list[float] = spec([0.01, 1.0, 100.0], min=0)
    families: list[Literal["linear", "head_matched"]] = spec(["linear", "head_matched"])
    probe_lambda: float = spec(0.01, min=0)
    probe_holdout: float = spec(0.2, positive=True, max=0.5)  # share of fit sequences held out of the probes
    accumulator_gib: float = spec(2.0, positive=True)  # float64 moments held at once; more passes if smaller
    seed: int = 0
    threads: int = spec(1, min=1)
    timing_repeats: int = spec(5, min=1)


def holdout_sequences(pairs: Pairs, fraction: float, seed: int) -> set[str]:
    """doc_ids of a seeded share of the split's sequences (at least one, never all)."""
    doc_ids = [doc for source, _ in pairs for doc in source.doc_ids]
    if len(doc_ids) < 2:
        raise ValueError(f"the fit split has {len(doc_ids)} sequence(s); holding out whole sequences needs 2 or more")
    count = min(len(doc_ids) - 1, max(1, round(fraction * len(doc_ids))))
    order = torch.randperm(len(doc_ids), generator=torch.Generator().manual_seed(seed))
    return {doc_ids[i] for i in order[:count].tolist()}


def held_rows(shard: Shard, held: set[str]) -> torch.Tensor:
    """(tokens,) bool: rows of the shard's sequences that are in `held`."""
    flags = torch.tensor([doc in held for doc in shard.doc_ids])
    return flags.repeat_interleave(torch.tensor(shard.lengths))


def _groups(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def probe_r2(pairs: Pairs, held: set[str], source_layers: int, target_layers: int, width_s: int, width_t: int,
             ridge_lambda: float, budget_bytes: float) -> dict[str, torch.Tensor]:
    """Held-out R² of single-layer ridge probes: per kind (target_layers, source_layers)."""
    # per pass: 2 kinds x (train, held) x source_layers x (X^T X + X^T Y over the group's target columns)
    fixed, per_target = 8 * 4 * source_layers * width_s * width_s, 8 * 4 * source_layers * width_s * width_t
    group = max(1, min(target_layers, int((budget_bytes - fixed) // per_target)))
    scores = {kind: torch.zeros(target_layers, source_layers, dtype=torch.float64) for kind in KINDS}
    for targets in tqdm(_groups(list(range(target_layers)), group), desc="probe passes"):
        out_width = len(targets) * width_t
        moments = {(kind, split, p): ridge.Moments.zeros(width_s, out_width)
                   for kind in KINDS for split in ("train", "held") for p in range(source_layers)}
        for source, target in pairs:
            mask = held_rows(source, held)
            for kind in KINDS:
                y = torch.cat(target.read(kind, targets), dim=1)  # (tokens, G * Ht*Dt)
                for p in range(source_layers):
                    (x,) = source.read(kind, [p])  # (tokens, Hs*Ds)
                    moments[kind, "train", p].update(x[~mask], y[~mask])
                    moments[kind, "held", p].update(x[mask], y[mask])
        for kind in KINDS:
            for p in range(source_layers):
                weight, bias = ridge.solve(moments[kind, "train", p], ridge_lambda)
                held_m = moments[kind, "held", p]
                r2 = ridge.pooled_r2(ridge.residual_ss(held_m, weight, bias), ridge.total_ss(held_m), len(targets))
                scores[kind][targets, p] = r2
        del moments
    return scores


def ranking(scores: dict[str, torch.Tensor]) -> list[list[int]]:
    """Per target layer, source layers from best to worst probe (mean of key and value R²; ties to lower index)."""
    mean = sum(scores.values()) / len(scores)  # (L_t, L_s)
    return [torch.sort(-row, stable=True).indices.tolist() for row in mean]


def layer_moments(pairs: Pairs, layer: int, chosen: list[int], kind: str) -> ridge.Moments:
    moments = None
    for source, target in pairs:
        x = torch.cat(source.read(kind, chosen), dim=1)  # (tokens, k * Hs*Ds), layer-major as the mapper reads
        (y,) = target.read(kind, [layer])  # (tokens, Ht*Dt)
        if moments is None:
            moments = ridge.Moments.zeros(x.shape[1], y.shape[1])
        moments.update(x, y)
    return moments


class Parts:
    """Per-candidate, per-layer tensors spilled to disk, so memory never holds every candidate at once."""

    def __init__(self, folder: Path):
        self.folder = folder
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    def put(self, candidate: str, layer: int, kind: str, tensors: tuple[torch.Tensor, ...]) -> None:
        named = {str(i): t.to(torch.float32).contiguous() for i, t in enumerate(tensors)}
        save_file(named, str(self.folder / f"{candidate}.{kind}.{layer:03d}.safetensors"))

    def take(self, candidate: str, layers: int, kind: str) -> list[tuple[torch.Tensor, ...]]:
        out = []
        for layer in range(layers):
            path = self.folder / f"{candidate}.{kind}.{layer:03d}.safetensors"
            named = load_file(str(path))
            out.append(tuple(named[str(i)] for i in range(len(named))))
            path.unlink()
        return out


def ridge_candidates(params: FitParams) -> list[tuple[str, str, int, float]]:
    return [(f"{family}_k{k}_lam{lam:g}", family, k, lam)
            for family in params.families for k in params.ks for lam in params.lambdas]


def fit_ridge_layer(layer: int, order: list[int], fit_pairs: Pairs, select_pairs: Pairs, params: FitParams,
                    heads_s: int, dim_s: int, heads_t: int, dim_t: int, parts: Parts, rows: list[dict],
                    summary: dict) -> None:
    """Every ridge candidate for one target layer: one accumulation at max(k), sub-block solves."""
    k_max = max(params.ks)
    chosen_max = sorted(order[:k_max])
    width_s = heads_s * dim_s
    for kind in KINDS:
        fit_m = layer_moments(fit_pairs, layer, chosen_max, kind)
        select_m = layer_moments(select_pairs, layer, chosen_max, kind)
        for name, family, k, lam in ridge_candidates(params):
            chosen = sorted(order[:k])
            blocks = [chosen_max.index(p) for p in chosen]
            if family == "linear":
                inputs = torch.cat([torch.arange(b * width_s, (b + 1) * width_s) for b in blocks])  # (k*Hs*Ds,)
                weight, bias = ridge.solve(fit_m.select(inputs), lam)  # (F, Ht*Dt), (Ht*Dt,): all heads, one solve
                sse_fit = ridge.residual_ss(fit_m.select(inputs), weight, bias)
                sse_sel = ridge.residual_ss(select_m.select(inputs), weight, bias)
                tensors = (weight.reshape(-1, heads_t, dim_t).permute(1, 0, 2), bias.reshape(heads_t, dim_t))
                per_head_params = inputs.numel() + 1
            else:  # head_matched: target head h reads source head h of each chosen layer: its own solve
                weights, biases, sse_fit, sse_sel = [], [], [], []
                for head in range(heads_t):
                    inputs = torch.cat([torch.arange(b * width_s + head * dim_s, b * width_s + (head + 1) * dim_s)
                                        for b in blocks])  # (k*Ds,)
                    outputs = torch.arange(head * dim_t, (head + 1) * dim_t)
                    weight, bias = ridge.solve(fit_m.select(inputs, outputs), lam)  # (k*Ds, Dt), (Dt,)
                    sse_fit.append(ridge.residual_ss(fit_m.select(inputs, outputs), weight, bias))
                    sse_sel.append(ridge.residual_ss(select_m.select(inputs, outputs), weight, bias))
                    weights.append(weight)
                    biases.append(bias)
                sse_fit, sse_sel = torch.cat(sse_fit), torch.cat(sse_sel)
                tensors = (torch.stack(weights), torch.stack(biases))  # (H, k*Ds, Dt), (H, Dt)
                per_head_params = inputs.numel() + 1
            parts.put(name, layer, kind, tensors)
            r2_fit = ridge.pooled_r2(sse_fit, ridge.total_ss(fit_m), heads_t)
            r2_sel = ridge.pooled_r2(sse_sel, ridge.total_ss(select_m), heads_t)
            _record(rows, summary, name, layer, kind, r2_fit, r2_sel, per_head_params / fit_m.n)


def _record(rows, summary, name, layer, kind, r2_fit, r2_sel, ratio) -> None:
    for head, (r_in, r_out) in enumerate(zip(r2_fit.tolist(), r2_sel.tolist())):
        rows.append({"candidate": name, "layer": layer, "head": head, "kind": kind, "r2_in_sample": round(r_in, 6),
                     "r2_heldout": round(r_out, 6), "param_to_sample_ratio": round(ratio, 6)})
    summary.setdefault((name, kind), []).extend(r2_sel.tolist())


def gather_rows(pairs: Pairs, layer: int, chosen: list[int], kind: str, held: set[str]):
    """x (N, k*Hs*Ds), y (N, Ht*Dt) float32 rows of a split and (N,) bool: rows of `held` sequences."""
    xs, ys, masks = [], [], []
    for source, target in pairs:
        xs.append(torch.cat(source.read(kind, chosen), dim=1))
        ys.append(target.read(kind, [layer])[0])
        masks.append(held_rows(source, held))
    return torch.cat(xs), torch.cat(ys), torch.cat(masks)


def _mlp_predict(x: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    in_weight, in_bias, weight, bias = tensors
    hidden = torch.nn.functional.gelu(x @ in_weight + in_bias)  # (N, hidden)
    return torch.einsum("nf,hfd->nhd", hidden, weight).flatten(1) + bias.flatten()  # (N, Ht*Dt)


def fit_mlp_layer(layer: int, order: list[int], k: int, fit_pairs: Pairs, select_pairs: Pairs, held: set[str],
                  params: FitParams, heads_t: int, parts: Parts, rows: list[dict], summary: dict) -> dict:
    name = f"mlp_k{k}"
    chosen = sorted(order[:k])
    facts = {}
    for kind_index, kind in enumerate(KINDS):
        x, y, mask = gather_rows(fit_pairs, layer, chosen, kind, held)
        settings = MlpSettings(params.mlp.hidden, params.mlp.lr, params.mlp.batch_rows, params.mlp.max_epochs,
                               params.mlp.patience, seed=params.seed * 100003 + layer * 2 + kind_index)
        tensors, facts[kind] = train_mlp(x[~mask], y[~mask], x[mask], y[mask], heads_t, settings)
        parts.put(name, layer, kind, tensors)
        x_sel, y_sel, _ = gather_rows(select_pairs, layer, chosen, kind, set())
        with torch.no_grad():
            sse = lambda x_, y_: ((y_ - _mlp_predict(x_, tensors)) ** 2).double().sum(0)  # noqa: E731
            sst = lambda y_: ((y_ - y_.mean(0)) ** 2).double().sum(0)  # noqa: E731
            r2_fit = ridge.pooled_r2(sse(x[~mask], y[~mask]), sst(y[~mask]), heads_t)
            r2_sel = ridge.pooled_r2(sse(x_sel, y_sel), sst(y_sel), heads_t)
        n_params = sum(t.numel() for t in tensors)
        _record(rows, summary, name, layer, kind, r2_fit, r2_sel, n_params / (int((~mask).sum()) * y.shape[1]))
    return facts


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def time_against_prefill(mapper: Mapper, source_model, token_ids: list[int], content: list, repeats: int) -> float:
    """Mapper time / source prefill time over the same tokens (batch 1, this machine, median of repeats)."""
    ids = torch.tensor(token_ids, dtype=torch.long)[None]  # (1, T)
    positions = torch.arange(ids.shape[1])
    prefill_s = _median_seconds(lambda: source_model.model(input_ids=ids, use_cache=True), repeats)
    map_s = _median_seconds(lambda: mapper.apply(content, positions), repeats)
    return map_s / prefill_s


def first_sequence_content(pairs: Pairs, source_layers: int, heads_s: int, dim_s: int) -> list:
    """The first select sequence's source content cache as the mapper reads it: per layer (1, Hs, T, Ds)."""
    shard = pairs[0][0]
    length = shard.lengths[0]
    out = []
    for layer in range(source_layers):
        keys, values = (shard.read(kind, [layer])[0][:length] for kind in KINDS)  # (T, Hs*Ds)
        out.append(tuple(t.reshape(1, length, heads_s, dim_s).transpose(1, 2) for t in (keys, values)))
    return out


def run(source_root: Path, target_root: Path, source_model_dir: Path, select_data: Path, out_dir: Path,
        metrics_dir: Path, params: FitParams) -> dict:
    start = time.perf_counter()
    torch.set_num_threads(params.threads)
    torch.use_deterministic_algorithms(True)
    source_manifest, target_manifest = read_manifest(source_root), read_manifest(target_root)
    geo_s, geo_t = source_manifest["geometry"], target_manifest["geometry"]
    heads_s, dim_s, heads_t, dim_t = geo_s["kv_heads"], geo_s["head_dim"], geo_t["kv_heads"], geo_t["head_dim"]
    for k in params.ks + params.mlp.ks:
        if k > geo_s["layers"]:
            raise ValueError(f"fit: k={k} exceeds the source's {geo_s['layers']} layers; lower fit.ks / fit.mlp.ks")
    if "head_matched" in params.families and heads_s != heads_t:
        raise ValueError(f"fit.families has head_matched but KV head counts differ ({heads_s} vs {heads_t})")

    fit_pairs = paired_split(source_root, target_root, "fit")
    select_pairs = paired_split(source_root, target_root, "select")
    held = holdout_sequences(fit_pairs, params.probe_holdout, params.seed)
    budget = params.accumulator_gib * 2**30
    scores = probe_r2(fit_pairs, held, geo_s["layers"], geo_t["layers"], heads_s * dim_s, heads_t * dim_t,
                      params.probe_lambda, budget)
    orders = ranking(scores)

    parts = Parts(out_dir / ".parts")
    rows, summary, mlp_facts = [], {}, {}
    for layer in tqdm(range(geo_t["layers"]), desc="fit layers"):
        if params.families:
            fit_ridge_layer(layer, orders[layer], fit_pairs, select_pairs, params, heads_s, dim_s, heads_t, dim_t,
                            parts, rows, summary)
        for k in params.mlp.ks:
            mlp_facts[(k, layer)] = fit_mlp_layer(layer, orders[layer], k, fit_pairs, select_pairs, held, params,
                                                  heads_t, parts, rows, summary)

    candidates = ridge_candidates(params)
    candidates += [(f"mlp_k{k}", "mlp", k, 0.0) for k in params.mlp.ks]
    source_model = load_model(str(source_model_dir), dtype="float32", device="cpu")
    token_ids = pd.read_parquet(select_data, columns=["token_ids"]).token_ids[0].tolist()
    content = first_sequence_content(select_pairs, geo_s["layers"], heads_s, dim_s)
    fit_tokens = sum(s.tokens for s, _ in fit_pairs)
    metrics = {"fit_sequences": sum(len(s.doc_ids) for s, _ in fit_pairs), "fit_tokens": fit_tokens,
               "select_tokens": sum(s.tokens for s, _ in select_pairs), "probe_heldout_sequences": len(held)}
    for name, family, k, lam in tqdm(candidates, desc="write mappers"):
        extra = {"probe_lambda": params.probe_lambda, "fit_tokens": fit_tokens, "seed": params.seed}
        if family == "mlp":
            extra["mlp"] = {"hidden": params.mlp.hidden, "epochs": [mlp_facts[(k, l)] for l in range(geo_t["layers"])]}
        mapper = Mapper(family, source_manifest["model_path"], target_manifest["model_path"], geo_s, geo_t,
                        source_manifest["rotary"], target_manifest["rotary"], k=k, ridge_lambda=lam,
                        source_layers=[sorted(order[:k]) for order in orders],
                        keys=parts.take(name, geo_t["layers"], "keys"),
                        values=parts.take(name, geo_t["layers"], "values"), extra=extra)
        save_mapper(mapper, out_dir / f"{name}.safetensors")
        metrics[f"{name}/r2_keys_select"] = round(statistics.mean(summary[(name, "keys")]), 6)
        metrics[f"{name}/r2_values_select"] = round(statistics.mean(summary[(name, "values")]), 6)
        metrics[f"{name}/params"] = mapper.parameter_count()
        metrics[f"{name}/macs_per_token"] = mapper.macs_per_token()
        metrics[f"{name}/time_vs_source_prefill"] = round(
            time_against_prefill(mapper, source_model, token_ids, content, params.timing_repeats), 4)
        del mapper
    shutil.rmtree(parts.folder)

    _write_csv(metrics_dir / "fit_layers.csv", rows)
    _write_csv(metrics_dir / "fit_probe.csv", [
        {"target_layer": l, "source_layer": p, "r2_keys_heldout": round(scores["keys"][l, p].item(), 6),
         "r2_values_heldout": round(scores["values"][l, p].item(), 6)}
        for l in range(geo_t["layers"]) for p in range(geo_s["layers"])])
    metrics["fit_wall_s"] = round(time.perf_counter() - start, 3)
    metrics["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return metrics


def _write_csv(path: Path, rows: list[dict]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write mappers and tables here instead (the controls' refit)")
    args = parser.parse_args(argv)
    params = load_section(FitParams, "fit")
    out, metrics_dir = (args.out, args.out) if args.out else (Path("models/mappers"), Path("metrics"))
    metrics = run(Path("caches/source"), Path("caches/target"), Path("models/source"), Path("data/select.parquet"),
                  out, metrics_dir, params)
    write_json_atomic(metrics_dir / "fit.json", metrics)
    print({k: v for k, v in metrics.items() if "/" not in k})


if __name__ == "__main__":
    main()
