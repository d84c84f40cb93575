"""Stage `score_models`: metrics/models.json, what each prepared model is and how well it does alone.

Per model its parameter count (and, for the trained tiny pair, its training loss and time), then task accuracy on the
dev part (never eval) through lm-eval: the target (oracle mode), the source alone and direct injection of the source
cache where the KV geometry allows it, with paired-bootstrap intervals of the target's lead over each.
"""
from __future__ import annotations

import json

from pipeline.kv.pair import Pair
from pipeline.measure.evaluation import Evaluation, evaluate
from pipeline.measure.settings import MeasureParams
from pipeline.measure.stats import paired_bootstrap
from pipeline.schema.score_models import ScoreModelsParams
from pipeline.store import paths
from pipeline.store.cli import entry, no_arguments
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import load_section
from pipeline.store.ranks import stage_ranks
from pipeline.store.splits import TASKS


def dev_accuracy(models: ModelsParams, device: str, batch_size: int) -> dict[str, Evaluation]:
    files = {task: paths.task_items(task, "dev") for task in TASKS}
    pair = Pair.load(models, device)
    evaluations = {}
    for variant, mode in (("target", "oracle"), ("source", "source"), ("direct", "direct")):
        try:
            router = pair.router(mode=mode, batch_size=batch_size)
        except ValueError as err:  # direct injection undefined for this pair's KV geometry
            print(f"skipping {variant}: {err}")
            continue
        evaluations[variant] = evaluate(router, tasks=files, tokenizer=pair.target_tokenizer)
        del router
    return evaluations


def models_metrics(models: ModelsParams, params: ScoreModelsParams, measure: MeasureParams, device: str) -> dict:
    metrics: dict[str, float | int | str] = {"kind": models.kind}
    for name in ("source", "target"):  # one model in memory at a time: each side of its own pair, loaded alone
        metrics[f"{name}_parameters"] = sum(p.numel() for p in getattr(Pair.load(models, "cpu"), name).parameters())
        stats_file = paths.train_stats(paths.model(name))
        if stats_file.is_file():  # the trained tiny pair; hub and random models were not trained here
            stats = json.loads(stats_file.read_text())
            metrics |= {f"{name}_{key}": stats[key] for key in ("final_loss", "train_seconds")}
    evaluations = dev_accuracy(models, device, params.batch_size)
    for variant, evaluation in evaluations.items():
        metrics[variant] = evaluation.figures(digits=4)  # its tasks, per item kind too
    items = {variant: evaluation.item_rows for variant, evaluation in evaluations.items()}
    for other in ("source", "direct"):
        if other not in evaluations:
            continue
        for task in TASKS:
            a, b = (items[variant][items[variant].task == task].sort_values("item").acc.to_numpy()
                    for variant in ("target", other))
            interval = paired_bootstrap(a, b, *measure.bootstrap)
            for suffix, key in (("acc", "diff"), ("low", "low"), ("high", "high")):
                metrics[f"target_minus_{other}_{task}_{suffix}"] = round(interval[key], 4)
    return metrics


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.score_models", __doc__, argv)
    models, params = load_section(ModelsParams, "models"), load_section(ScoreModelsParams, "score_models")
    machine, measure = load_section(MachineParams, "machine"), load_section(MeasureParams, "measure")
    with stage_ranks(machine.torch_device, threads=machine.threads) as stage:
        stage.write_metrics(paths.MODEL_SCORES, models_metrics(models, params, measure, machine.torch_device))


if __name__ == "__main__":
    entry(main)
