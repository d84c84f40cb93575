"""Stage `prepare_models`: the source/target pair under models/, and metrics/models.json.

- `trained` (tiny profile): trains both Qwen3-architecture models on the generated corpus with the
  tokenizer from prepare_data, and saves them in Hugging Face format (models/source, models/target);
- `hub` (V0 profile): resolves the hub ids to pinned revisions and records them (models/*/hub.json); the
  weights stay in the Hugging Face cache, and downstream stages load by id and revision;
- `random` (real-shape smoke run): records the shape and seed (models/*/random.json); downstream stages
  build randomly initialised models of that exact configuration.

metrics/models.json: per model its parameter count, training loss and time, and its accuracy on the task
items' dev part (never eval) scored through lm-eval with the `kv-transfer` model: the target in oracle
mode, the source alone, and direct injection of the source cache (when the KV geometry allows it), with
paired-bootstrap intervals of the target's lead.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from pipeline.artifacts import atomic_dir, write_json_atomic
from pipeline.models import ModelNotAvailableError, ModelsParams, check_pair, hub_reachable, load_tokenizer
from pipeline.params import load_section, spec
from pipeline.stats import paired_bootstrap
from pipeline.train import TrainConfig

MODELS = Path("models")
DATA = Path("data")
TASKS = ("hellaswag", "piqa")


@dataclass
class TrainParams:
    threads: int = spec(1, positive=True)
    source: TrainConfig | None = None
    target: TrainConfig | None = None


def train_pair(train: TrainParams) -> dict:
    from transformers import AutoTokenizer

    from pipeline.train import train_model

    if train.source is None or train.target is None:
        raise ValueError("train.source and train.target are required when models.kind is 'trained'")
    tokenizer = AutoTokenizer.from_pretrained(DATA / "tokenizer")
    corpus = pd.read_parquet(DATA / "corpus.parquet")
    dev = {task: pd.read_parquet(DATA / f"{task}_dev.parquet") for task in TASKS}
    stats = {}
    for name, cfg in (("source", train.source), ("target", train.target)):
        model, stats[name] = train_model(replace(cfg, threads=train.threads), tokenizer, corpus, dev)
        with atomic_dir(MODELS / name) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            write_json_atomic(staging / "train_stats.json", stats[name])
    return stats


def pin_hub_pair(models: ModelsParams) -> None:
    from huggingface_hub import HfApi

    for name, model_id, revision in (("source", models.source, models.source_revision),
                                     ("target", models.target, models.target_revision)):
        if not hub_reachable():
            raise ModelNotAvailableError(
                f"cannot resolve model {model_id!r} ({name}): the Hugging Face hub is unreachable. The qwen3-v0 "
                f"profile needs the hub (or a machine where `huggingface-cli download {model_id}` has been run)"
            )
        sha = HfApi().model_info(model_id, revision=revision).sha
        with atomic_dir(MODELS / name) as staging:
            write_json_atomic(staging / "hub.json", {"id": model_id, "revision": sha})
    check_pair(models.source, load_tokenizer(str(MODELS / "source")), models.target, load_tokenizer(str(MODELS / "target")))


def record_random_pair(models: ModelsParams, seed: int = 0) -> None:
    from transformers import AutoTokenizer

    from pipeline.shapes import shape_config

    tokenizer = AutoTokenizer.from_pretrained(DATA / "tokenizer")
    for offset, (name, shape) in enumerate((("source", models.source), ("target", models.target))):
        config = shape_config(shape)  # fails here, naming the shape, if it does not exist
        if len(tokenizer) > config.vocab_size:
            raise ValueError(f"tokenizer of {len(tokenizer)} tokens does not fit shape {shape!r} (vocab {config.vocab_size})")
        with atomic_dir(MODELS / name) as staging:
            write_json_atomic(staging / "random.json", {"shape": shape, "seed": seed + offset})
            tokenizer.save_pretrained(staging)


def dev_accuracy(models: ModelsParams) -> tuple[dict, pd.DataFrame]:
    """Dev-part accuracy of the target (oracle), the source alone and direct injection, per item."""
    from pipeline.lm_eval_model import KVTransferLM
    from pipeline.taskeval import evaluate_tasks

    files = {task: DATA / f"{task}_dev.parquet" for task in TASKS}
    common = dict(dtype=models.dtype, device=models.torch_device, batch_size=16)
    runs = {
        "target": dict(target=str(MODELS / "target"), transfer="oracle"),
        "source": dict(target=str(MODELS / "source"), transfer="oracle"),
        "direct": dict(target=str(MODELS / "target"), source=str(MODELS / "source"), transfer="direct"),
    }
    summaries, frames = {}, []
    for variant, args in runs.items():
        try:
            lm = KVTransferLM(**args, **common)
        except ValueError as err:  # direct injection undefined for this pair's KV geometry
            print(f"skipping {variant}: {err}")
            continue
        summaries[variant], frame = evaluate_tasks(lm, files)
        frames.append(frame.assign(variant=variant))
        del lm
    return summaries, pd.concat(frames, ignore_index=True)


def models_metrics(models: ModelsParams, train_stats: dict, seed: int = 0) -> dict:
    from pipeline.models import load_model

    metrics: dict[str, float | int | str] = {"kind": models.kind}
    for name in ("source", "target"):
        model = load_model(str(MODELS / name), dtype=models.dtype, device="cpu")
        metrics[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())
        del model
        if name in train_stats:
            metrics[f"{name}_final_loss"] = train_stats[name]["final_loss"]
            metrics[f"{name}_train_seconds"] = train_stats[name]["train_seconds"]
    summaries, items = dev_accuracy(models)
    for variant, per_task in summaries.items():
        for task, result in per_task.items():
            for metric in ("acc", "acc_norm"):
                metrics[f"{variant}_{task}_{metric}"] = round(result[metric], 4)
            metrics[f"{variant}_{task}_n"] = result["n"]
        for key, value in _kinds(items[items.variant == variant]).items():
            metrics[f"{variant}_{key}"] = round(value, 4)
    for other in ("source", "direct"):
        if other not in summaries:
            continue
        for task in TASKS:
            a = items[(items.variant == "target") & (items.task == task)].sort_values("item").acc.to_numpy()
            b = items[(items.variant == other) & (items.task == task)].sort_values("item").acc.to_numpy()
            interval = paired_bootstrap(a, b, seed=seed)
            metrics[f"target_minus_{other}_{task}_acc"] = round(interval["diff"], 4)
            metrics[f"target_minus_{other}_{task}_low"] = round(interval["low"], 4)
            metrics[f"target_minus_{other}_{task}_high"] = round(interval["high"], 4)
    return metrics


def _kinds(frame: pd.DataFrame) -> dict[str, float]:
    from pipeline.taskeval import by_kind

    return {key.replace("/", "_") + "_acc": value for key, value in by_kind(frame).items() if "/" in key}


def main() -> None:
    models = load_section(ModelsParams, "models")
    train = load_section(TrainParams, "train")
    torch.set_num_threads(train.threads)
    started = time.perf_counter()
    stats = {}
    if models.kind == "trained":
        stats = train_pair(train)
    elif models.kind == "hub":
        pin_hub_pair(models)
    else:
        record_random_pair(models)
    metrics = models_metrics(models, stats)
    metrics["stage_seconds"] = round(time.perf_counter() - started, 1)
    write_json_atomic("metrics/models.json", metrics)
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
