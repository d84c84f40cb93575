"""Stage `repair`: mapped caches partly recomputed by the target (`kv.repair`), a quality dial against cost.

    python -m pipeline.repair

Each map of `repair.maps` at each setting of `repair.grid` (`none`: unrepaired) is scored on the eval tasks and prompts,
with its budget (multiply-adds over the target's prefill) and FLOP bound at `repair.bound_pair`'s shapes and its speedup
measured here. At each budget level two matched-cost baselines: the truncated prompt (the target's prefill of only the
last round(budget x its length) tokens of each context) and speculative prefill at share p = budget.
"""
from __future__ import annotations

from tqdm.auto import tqdm

from pipeline.kv.flops import (
    mapper_macs_per_token,
    repair_budget,
    source_scores_macs,
    speculative_bound,
    speedup_bound,
)
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.router import Router
from pipeline.kv.speculative import SpeculativeParams, chosen_lookahead
from pipeline.measure.compare import read_prompts
from pipeline.measure.evaluation import Evaluation, evaluate
from pipeline.measure.latency import measure
from pipeline.measure.settings import MeasureParams
from pipeline.schema.repair import RepairParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, load_artifact, require_controls_passed
from pipeline.store.cli import entry, no_arguments
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import load_section
from pipeline.store.ranks import stage_ranks
from pipeline.store.shapes import bound_configs as bound_configs_of


def scored(pair: Pair, router: Router, tasks, prompts, oracle, margin: float, items: int | None) -> Evaluation:
    """One handoff on each of `tasks`' first `items` and on the eval prompts against the oracle's stored outputs."""
    return evaluate(router, prompts, oracle, margin=margin, tasks=tasks, tokenizer=pair.target_tokenizer,
                    progress=False, task_limit=items)


def run(params: RepairParams, models: ModelsParams, device: str, margin: float, items: int | None,
        lookahead: SpeculativeParams | None) -> dict:
    """Every map at every setting of the grid, timed, and the matched-cost baselines at each budget level
    (`lookahead`: select's look-ahead settings)."""
    require_controls_passed()
    pair = Pair.load(models, device)
    bound_configs = bound_configs_of(params.bound_pair, pair.configs)
    prompts = read_prompts(paths.EVAL_PROMPTS)
    oracle = load_artifact(paths.ORACLE_OUTPUTS)[0]
    settings = params.settings()
    budgets = {str(s): repair_budget(bound_configs[1], s, params.length,
                                     source_scores_macs(bound_configs[0], s, lookahead, params.length))
               for s in settings}
    metrics: dict = {"length": params.length, "bound_pair": params.bound_pair, "grid": [str(s) for s in settings]}
    with atomic_dir(paths.REPAIR_ROWS) as staging:
        jobs = [(name, setting) for name in params.maps for setting in settings]
        for name, setting in tqdm(jobs, desc="repair", unit="setting"):
            reads = lookahead if setting.reads_source else None
            router = pair.router(mode="mapped", mapper=params.maps[name], repair=setting, speculative=reads,
                                 batch_size=params.batch_size)
            handoff, evaluation = router.handoff, scored(pair, router, pair.eval_tasks, prompts, oracle, margin, items)
            write_rows(staging, name, str(setting), evaluation)
            mapper = handoff.mapper
            macs = mapper_macs_per_token(*bound_configs, mapper.k, mapper.family, mapper.width)
            figures = evaluation.figures()
            figures.update({"policy": policy(setting), "budget": round(budgets[str(setting)], 6),
                            "bound": round(speedup_bound(*bound_configs, macs, params.length, setting,
                                                         source_scores_macs(bound_configs[0], setting, reads,
                                                                            params.length)), 4),
                            "recomputed": handoff.repaired.recomputed})
            row = measure(handoff, [params.length], params.warmup, params.repeats, memory=False, progress=False)[0]
            figures.update({key: round(row[key], 4) for key in ("target_ms", "handoff_ms", "speedup")})
            metrics[f"maps/{name}/{setting}"] = figures
        levels = sorted({min(round(b, 3), 1.0) for b in budgets.values() if round(b, 3) > 0})
        for name, level, evaluation, figures in matched_baselines(pair, params, levels, pair.eval_tasks, prompts,
                                                                  oracle, margin, items, lookahead, bound_configs):
            write_rows(staging, name, f"{level:g}", evaluation)
            metrics[f"{name}/{level:g}"] = figures
    return metrics


def matched_baselines(pair: Pair, params: RepairParams, levels: list[float], tasks, prompts, oracle, margin: float,
                      items: int | None, lookahead: SpeculativeParams | None, bound_configs: tuple):
    """(baseline, level, evaluation, figures) of the truncated prompt (`keep` = the level) and speculative prefill
    (p = the level, with its FLOP bound at `bound_configs`) at each budget level, scored as the repaired maps are."""
    for level in tqdm(levels, desc="matched-cost baselines", unit="budget"):
        truncated = pair.router(mode="oracle", keep=level, batch_size=params.batch_size)
        evaluation = scored(pair, truncated, tasks, prompts, oracle, margin, items)
        yield paths.TRUNCATED_BASELINE, level, evaluation, evaluation.figures()
        speculative = pair.router(mode="speculative", share=level, speculative=lookahead,
                                  batch_size=params.batch_size)
        evaluation = scored(pair, speculative, tasks, prompts, oracle, margin, items)
        bound = speculative_bound(*bound_configs, lookahead, level, params.length)
        yield paths.SPECULATIVE_BASELINE, level, evaluation, {**evaluation.figures(), "bound": round(bound, 4)}


def policy(setting: Repair) -> str:
    """A setting's parts without their sizes, in the applied order (the report draws a line per policy)."""
    parts = (["layers"] if setting.exact_layers else []) + (["sink"] if setting.sink else []) + (
        [setting.policy] if setting.tokens else [])
    return "+".join(parts) or "none"


def write_rows(staging, name: str, setting: str, evaluation: Evaluation) -> None:
    evaluation.write_rows(paths.repair_rows("prompts", name, setting, staging),
                          paths.repair_rows("items", name, setting, staging))


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.repair", __doc__, argv)
    params, models = load_section(RepairParams, "repair"), load_section(ModelsParams, "models")
    machine = load_section(MachineParams, "machine")
    measure = load_section(MeasureParams, "measure")
    lookahead = chosen_lookahead(paths.LOOKAHEAD)
    with stage_ranks(machine.torch_device, threads=machine.threads) as stage:
        stage.write_metrics(paths.REPAIR_METRICS, run(params, models, stage.device, measure.confident_margin,
                                                      measure.study_items, lookahead))


if __name__ == "__main__":
    entry(main)
