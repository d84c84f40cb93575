"""Stage `candidates`: every fitted and distilled map's task accuracy on the eval part and its time to first token.

    python -m pipeline.candidates

Whether the cheap numbers (select's agreement, attention-output cosine and KL; fit's held-out R²) predict task
retention can only be read off candidates whose retention was measured too, and the quality/speed frontier needs each
candidate's speed beside its quality. Per map: the eval tasks, the handoff's TTFT against the target's prefill at
`candidates.length` tokens (medians of `repeats` after `warmup`), and the FLOP bound here and at `bound_pair`'s shapes.
"""
from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from pipeline.kv.flops import mapper_macs_per_token, speedup_bound
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapnames import MapName
from pipeline.kv.pair import Pair
from pipeline.measure.compare import read_prompts
from pipeline.measure.evaluation import evaluate
from pipeline.measure.latency import measure
from pipeline.measure.settings import MeasureParams
from pipeline.schema.candidates import CandidatesParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, load_artifact, require_controls_passed
from pipeline.store.cli import entry, no_arguments
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import load_section
from pipeline.store.ranks import stage_ranks
from pipeline.store.shapes import bound_configs as bound_configs_of


def candidate_figures(handoff: Handoff, path: Path, params: CandidatesParams, bound_configs) -> dict:
    """TTFTs in ms at `params.length`; the FLOP bound both here and at the bound pair's shapes."""
    mapper = handoff.mapper
    row = measure(handoff, [params.length], params.warmup, params.repeats, memory=False, progress=False)[0]
    real_macs = mapper_macs_per_token(*bound_configs, mapper.k, mapper.family, mapper.width)
    return {"family": mapper.family, "k": mapper.k, "ridge_lambda": mapper.ridge_lambda,
            "parameters": mapper.parameter_count(), "mapper_bytes": path.stat().st_size,
            **{key: round(row[key], 4) for key in ("target_ms", "handoff_ms", "speedup", "bound")},
            "bound_at_pair": round(speedup_bound(*bound_configs, real_macs, params.length), 4)}


def run(params: CandidatesParams, models: ModelsParams, device: str, items: int | None = None) -> dict:
    """Every fitted and distilled map on each eval task's first `items`, and timed."""
    require_controls_passed()
    candidates = paths.map_candidates()
    pair = Pair.load(models, device)
    bound_configs = bound_configs_of(params.bound_pair, pair.configs)
    metrics: dict[str, float | int | str] = {"candidates": len(candidates), "length": params.length,
                                             "bound_pair": params.bound_pair}
    # each distilled map and its start also on the eval prompts, against the oracle's stored outputs (the
    # rollouts at evaluate.horizon), so the distillation study pairs them prompt by prompt
    names = {path.stem: MapName.parse(path.stem) for path in candidates}
    distilled = {stem: str(name.start) for stem, name in names.items() if name.distilled}
    paired = set(distilled) | set(distilled.values())
    prompts = read_prompts(paths.EVAL_PROMPTS) if paired else []
    oracle = load_artifact(paths.ORACLE_OUTPUTS)[0] if paired else {}
    with atomic_dir(paths.CANDIDATE_ITEMS) as staging:
        for path in tqdm(candidates, desc="candidates", unit="candidate"):
            router = pair.router(mode="mapped", mapper=path, batch_size=params.batch_size)
            on_prompts = path.stem in paired
            evaluation = evaluate(router, prompts if on_prompts else (), oracle, tasks=pair.eval_tasks,
                                  tokenizer=pair.target_tokenizer, progress=False, task_limit=items)
            evaluation.write_rows(paths.candidate_prompts(path.stem, staging / paths.CANDIDATE_PROMPTS.name)
                                  if on_prompts else None, paths.candidate_items(path.stem, staging))
            metrics[f"maps/{path.stem}"] = {**evaluation.figures(),
                                            **candidate_figures(router.handoff, path, params, bound_configs)}
    return metrics


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.candidates", __doc__, argv)
    params, models = load_section(CandidatesParams, "candidates"), load_section(ModelsParams, "models")
    machine = load_section(MachineParams, "machine")
    with stage_ranks(machine.torch_device, threads=machine.threads) as stage:
        items = load_section(MeasureParams, "measure").study_items
        stage.write_metrics(paths.CANDIDATES, run(params, models, stage.device, items))


if __name__ == "__main__":
    entry(main)
