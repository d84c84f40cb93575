"""Stage `evaluate`: one variant of the handoff on the eval prompts and the task items' eval part.

    python -m pipeline.evaluate <variant>

With `evaluate.processes` N > 1 it runs as N torchrun processes (`store.ranks`): each scores every N-th batch of
prompts and, through lm-eval's rank contract, every N-th task document; rank 0 gathers and writes.

Variants: `oracle` (the target's own cache; it also computes and stores the oracle's outputs that every
other variant is compared with), `direct`, `source` (the source model alone), `zero`, and the mapped
variants: `mapped_k<k>` (the best ridge strength for that k), `selected` (the mapper chosen by `select`) and
`shuffled` (the selected mapper's cache with its token order permuted). Every variant needs the controls to
have passed (metrics/controls.json). A variant the pair's architecture contract leaves undefined (`direct`
between unequal KV geometries) is not run: its metrics file and eval/<variant>/SKIPPED hold the reason.

Writes metrics/eval/<variant>.json (small, flat), eval/<variant>/prompts.parquet (per prompt),
eval/<variant>/items.parquet (per task item, for the paired statistics of the report) and lm-eval's own
results and samples (eval/<variant>/lm_eval/).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.kv.contract import pair_contract
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import load_mapper
from pipeline.lm_eval_model import KVTransferLM
from pipeline.measure.compare import oracle_outputs, read_prompts, summarize, variant_rows
from pipeline.measure.taskeval import by_kind, evaluate_tasks
from pipeline.store.artifacts import (
    atomic_dir,
    load_artifact,
    require_controls_passed,
    save_artifact,
    write_json_atomic,
)
from pipeline.store.cli import entry, parser
from pipeline.store.devices import StageUsage, usage_of_ranks
from pipeline.store.models import ModelsParams, load_config, load_model, load_tokenizer
from pipeline.store.params import ParamError, load_section, spec
from pipeline.store.ranks import SINGLE, World, join, leave, relaunch
from pipeline.store.splits import TASKS

ORACLE_OUTPUTS = Path("eval/oracle_outputs.safetensors")
EVAL_PROMPTS = Path("data/eval.parquet")
BASELINES = ("oracle", "direct", "source", "zero")
SKIPPED = "SKIPPED"  # in eval/<variant>/ of a variant the pair's contract leaves undefined: the reason


@dataclass
class EvaluateParams:
    baselines: list[str]
    mapped: dict[str, str]  # variant -> mapper file
    top_k: int = spec(positive=True)
    horizon: int = spec(positive=True)
    batch_size: int = spec(positive=True)
    shuffle_seed: int
    threads: int = spec(positive=True)
    processes: int = spec(min=1)  # torchrun processes, each scoring every N-th batch and task document

    def __post_init__(self):
        for name in self.baselines:
            if name not in BASELINES[1:]:
                raise ParamError(f"evaluate.baselines: unknown variant {name!r} (known: {', '.join(BASELINES[1:])})")
        for name in self.mapped:
            if name in BASELINES:
                raise ParamError(f"evaluate.mapped.{name}: a mapped variant cannot take a baseline's name")


def variant_mode(variant: str) -> str:
    """The contract's mode of a variant (kv.contract.MODES)."""
    if variant in BASELINES:
        return variant
    return "shuffled" if variant == "shuffled" else "mapped"


def skip_reason(variant: str) -> str | None:
    """Why the pair's architecture contract leaves this variant undefined (e.g. `direct` between unequal KV
    geometries), read from the configs and tokenizers; None when it is defined."""
    tokenizers = {name: load_tokenizer(f"models/{name}") for name in ("source", "target")}
    contract = pair_contract(load_config("models/target"), load_config("models/source"), tokenizers["target"],
                             tokenizers["source"])
    return contract.reason(variant_mode(variant))


def build_handoff(variant: str, params: EvaluateParams, models: ModelsParams, device: str) -> Handoff:
    load = lambda name: load_model(f"models/{name}", dtype=models.dtype, device=device,  # noqa: E731
                                    device_map=models.device_map)
    if variant == "oracle":
        return Handoff(load("target"))
    if variant == "source":
        return Handoff(load("source"))  # the source alone: its own cache, its own predictions
    if variant == "zero":
        return Handoff(load("target"), mode="zero")
    tokenizers = (load_tokenizer("models/source"), load_tokenizer("models/target"))  # the contract compares them
    if variant == "direct":
        return Handoff(load("target"), load("source"), "direct", tokenizers=tokenizers)
    if variant not in params.mapped:
        raise ValueError(f"unknown variant {variant!r}: not a baseline and not in evaluate.mapped")
    mapper = load_mapper(params.mapped[variant], device=device)
    mode = "shuffled" if variant == "shuffled" else "mapped"
    return Handoff(load("target"), load("source"), mode, mapper, shuffle_seed=params.shuffle_seed,
                   tokenizers=tokenizers)


def run(variant: str, params: EvaluateParams, models: ModelsParams, world: World = SINGLE) -> dict:
    """Evaluate `variant`; under several processes every rank scores its share of the prompts and task items
    and rank 0 writes (the others return {})."""
    require_controls_passed()
    reason = skip_reason(variant)
    if reason:  # recorded, and shown in the report, instead of failing the run
        metrics = {"skipped": reason}
        if world.main:
            with atomic_dir(Path("eval") / variant) as staging:
                (staging / SKIPPED).write_text(reason + "\n")
            write_json_atomic(Path("metrics/eval") / f"{variant}.json", metrics)
        return metrics
    torch.set_num_threads(params.threads)
    device = world.device(models.torch_device)
    usage = StageUsage(device)
    handoff = build_handoff(variant, params, models, device)
    prompts = read_prompts(EVAL_PROMPTS)
    if variant == "oracle":
        oracle = oracle_outputs(handoff, prompts, params.top_k, params.horizon, params.batch_size, world=world)
        if world.main:
            save_artifact(ORACLE_OUTPUTS, oracle,
                          {"prompts": len(prompts), "top_k": params.top_k, "horizon": params.horizon})
    else:
        oracle, meta = load_artifact(ORACLE_OUTPUTS)
        if meta["prompts"] != len(prompts):
            raise RuntimeError(f"{ORACLE_OUTPUTS} holds {meta['prompts']} prompts, "
                               f"data/eval.parquet {len(prompts)}: rerun evaluate@oracle")
    rows = variant_rows(handoff, prompts, oracle, params.batch_size, world=world)
    lm = KVTransferLM.from_handoff(handoff, load_tokenizer("models/target"), batch_size=params.batch_size,
                                   world=world)
    files = {task: Path(f"data/{task}_eval.parquet") for task in TASKS}
    if not world.main:  # lm-eval gathers this rank's samples and metrics on rank 0
        evaluate_tasks(lm, files)
        world.gather(usage.figures())
        return {}
    metrics: dict[str, float | int] = {k: round(v, 6) if isinstance(v, float) else v
                                       for k, v in summarize(rows).items()}
    with atomic_dir(Path("eval") / variant) as staging:
        tasks, items = evaluate_tasks(lm, files, raw_to=staging / "lm_eval")
        rows.to_parquet(staging / "prompts.parquet", index=False)
        items.to_parquet(staging / "items.parquet", index=False)
    for task, result in tasks.items():
        for key, value in result.items():
            metrics[f"{task}_{key}"] = round(value, 6) if isinstance(value, float) else value
    for metric in ("acc", "acc_norm"):
        for key, value in by_kind(items, metric).items():
            if "/" in key:
                metrics[f"{key.replace('/', '_')}_{metric}"] = round(value, 6)
    metrics.update(usage_of_ranks(world.gather(usage.figures())))
    write_json_atomic(Path("metrics/eval") / f"{variant}.json", metrics)
    return metrics


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.evaluate", __doc__)
    cli.add_argument("variant", help="oracle, a baseline (evaluate.baselines) or a key of evaluate.mapped")
    argv = sys.argv[1:] if argv is None else argv
    variant = cli.parse_args(argv).variant
    params, models = load_section(EvaluateParams, "evaluate"), load_section(ModelsParams, "models")
    if relaunch(params.processes, "pipeline.evaluate", argv):
        return
    world = join(models.torch_device)
    metrics = run(variant, params, models, world)
    if world.main:
        print(json.dumps(metrics, indent=2))
    leave(world)


if __name__ == "__main__":
    entry(main)
