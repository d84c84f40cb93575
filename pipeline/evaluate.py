"""Stages `evaluate` and `evaluate_mapped`: variants of the handoff on the eval prompts and the task items' eval part.

    python -m pipeline.evaluate <variant> [<variant> ...]

A variant is a baseline (`oracle`: the target's own cache, whose stored outputs every other variant is compared with,
so it runs first; `direct`; `source`, the source model alone; `zero`) or a key of `evaluate.mapped`, its map handed off
(`shuffled`: with the cache's token order permuted), repaired by the target where `evaluate.repair` names it. Every
variant needs the controls to have passed. Several variants run in one process, sharing the pair's models.
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.kv.modes import BASELINES
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.measure.compare import read_prompts
from pipeline.measure.evaluation import OracleStore, evaluate
from pipeline.schema.evaluate import SELECTED, EvaluateParams, selected_repair
from pipeline.store import paths
from pipeline.store.artifacts import (
    ArtifactError,
    atomic_dir,
    load_artifact,
    require_controls_passed,
    save_artifact,
    write_json_atomic,
)
from pipeline.store.cli import entry, parser
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, load_section, load_value
from pipeline.store.ranks import ONE_PROCESS, Ranks, stage_ranks

SKIPPED = "SKIPPED"  # in eval/<variant>/ of a variant the pair's contract leaves undefined: the reason


def variant_mode(variant: str) -> str:
    return variant if variant in BASELINES or variant == "shuffled" else "mapped"


def variant_request(variant: str, params: EvaluateParams) -> dict:
    """`variant`'s handoff as `Pair.router` takes it (an unknown name was refused earlier): a mapped variant with its
    repair (`selected`: select's choice, and the look-ahead settings select chose it under where its policy reads
    them; the empty setting for none)."""
    if variant in BASELINES:
        return {"mode": variant}
    setting = params.repair.get(variant)
    if setting == SELECTED:
        repair, lookahead = selected_repair(f"evaluate.repair.{variant}")
    else:
        repair, lookahead = Repair() if setting is None else Repair.parse(setting), None
    return {"mode": variant_mode(variant), "mapper": params.mapped[variant], "repair": repair,
            "speculative": lookahead, "shuffle_seed": params.shuffle_seed}


def run(variant: str, params: EvaluateParams, pair: Pair, margin: float,
        ranks: Ranks = ONE_PROCESS) -> dict | None:
    """Each rank scores its share of prompts and items; rank 0 writes eval/<variant>/ and returns the metrics (the
    others {}). None where the pair's contract leaves the variant undefined (e.g. `direct` between unequal KV
    geometries): rank 0 writes its reason instead. `margin`: the oracle's top-2 margin from which a position is
    confident."""
    require_controls_passed()
    reason = pair.contract.modes[variant_mode(variant)]
    if reason:  # recorded, and shown in the report, instead of failing the run
        if ranks.main:
            with atomic_dir(paths.variant_folder(variant)) as staging:
                (staging / SKIPPED).write_text(reason + "\n")
            write_json_atomic(paths.variant_metrics(variant), {"skipped": reason})
        return None
    router = pair.router(**variant_request(variant, params), batch_size=params.batch_size)
    prompts = read_prompts(paths.EVAL_PROMPTS)
    options = {"margin": margin, "tasks": pair.eval_tasks, "tokenizer": pair.target_tokenizer, "ranks": ranks}
    if variant == "oracle":  # its outputs are stored, and every other variant compared with them
        options["store"] = OracleStore(params.top_k, params.horizon)
        oracle = None
    else:
        oracle, meta = load_artifact(paths.ORACLE_OUTPUTS)
        if meta["prompts"] != len(prompts):
            raise ArtifactError(f"{paths.ORACLE_OUTPUTS} holds {meta['prompts']} prompts, "
                                f"data/eval.parquet {len(prompts)}: the oracle outputs do not match the prompts; "
                                f"rerun the evaluate stage (its oracle)")
    if not ranks.main:  # lm-eval gathers this rank's samples and metrics on rank 0
        evaluate(router, prompts, oracle, **options)
        return {}
    with atomic_dir(paths.variant_folder(variant)) as staging:
        evaluation = evaluate(router, prompts, oracle, raw_to=staging / "lm_eval", **options)
        evaluation.write_rows(paths.variant_rows("prompts", staging), paths.variant_rows("items", staging))
    if evaluation.oracle is not None:
        save_artifact(paths.ORACLE_OUTPUTS, evaluation.oracle,
                      {"prompts": len(prompts), "top_k": params.top_k, "horizon": params.horizon})
    metrics = evaluation.figures()
    if variant in params.repair:  # its declared setting, `none` included
        metrics["repair"] = str(router.handoff.repair)
    mapper = router.handoff.mapper
    if mapper is not None:  # best_of_k: select's best closed-form map of its k (models/best/, V0's rows)
        metrics["map"] = {"family": mapper.family, "k": mapper.k, "distilled": mapper.distilled is not None,
                          "best_of_k": Path(params.mapped[variant]) == paths.best_map(mapper.k)}
    return metrics


def ordered_variants(names: list[str], params: EvaluateParams) -> list[str]:
    """Each once, the oracle first (the others read its outputs); an unknown name is refused before any work."""
    for name in names:
        if name not in BASELINES and name not in params.mapped:
            raise ParamError(f"pipeline.evaluate: unknown variant {name!r}; name a baseline "
                             f"({', '.join(BASELINES)}) or a key of evaluate.mapped in params.yaml")
    return sorted(dict.fromkeys(names), key=lambda name: name != "oracle")


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.evaluate", __doc__)
    cli.add_argument("variants", nargs="+", metavar="variant",
                     help=f"{', '.join(BASELINES)} or a key of evaluate.mapped; several run in one process")
    argv = sys.argv[1:] if argv is None else argv
    names = cli.parse_args(argv).variants
    params, models = load_section(EvaluateParams, "evaluate"), load_section(ModelsParams, "models")
    machine = load_section(MachineParams, "machine")
    margin = load_value(float, "measure.confident_margin")  # check_params holds it within [0, 1]
    variants = ordered_variants(names, params)
    with stage_ranks(machine.torch_device, params.processes, "pipeline.evaluate", argv, machine.threads) as stage:
        pair = Pair.load(models, stage.device)  # one load of each model, shared by the variants
        for variant in variants:
            stage.restart_usage()  # each variant's metrics: its own wall time
            metrics = run(variant, params, pair, margin, stage.ranks)
            if metrics is not None:  # None: a variant the pair's contract leaves undefined, its reason recorded
                stage.write_metrics(paths.variant_metrics(variant), metrics)


if __name__ == "__main__":
    entry(main)
