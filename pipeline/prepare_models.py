"""Stage `prepare_models`: the source/target pair under models/, checked against the architecture contract.

Kind `trained` trains the models on the generated corpus; `hub` writes pointers to what `pin_models` pinned (the weights
stay in the Hugging Face cache or the folder); `random` records each side's shape and seed; a self source (`self:<n>`)
is a pointer to models/target, loaded as its first n layers. A pair whose mapped handoff is undefined stops here; the
scoring is stage `score_models`, so that a change to the scoring code never retrains the models.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.kv.pair import Pair
from pipeline.schema.prepare_models import TrainParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dirs, read_table, write_json_atomic
from pipeline.store.cli import entry, no_arguments
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, load_section
from pipeline.store.shapes import shape_config
from pipeline.store.splits import TASKS
from pipeline.store.truncated import SELF_POINTER
from pipeline.tiny.train import train_model

torch = lazy("torch")
transformers = lazy("transformers")


def train_pair(train: TrainParams, threads: int, staging: dict[str, Path]) -> None:
    """Each side of `staging` (the target alone for a self source) trained and saved there with the tokenizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths.TOKENIZER)
    corpus = read_table(paths.CORPUS)
    dev = {task: read_table(paths.task_items(task, "dev")) for task in TASKS}
    for name, folder in staging.items():
        model, stats = train_model(getattr(train, name), tokenizer, corpus, dev, threads)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        write_json_atomic(paths.train_stats(folder), stats)


def point_at_target(layers: int, staging: Path) -> None:
    """models/source as the target's first `layers` decoder layers: self.json pointing at models/target by a relative
    path (so the folder can move with the repository); no weights, no tokenizer."""
    target = os.path.relpath(paths.model("target"), paths.model("source"))
    write_json_atomic(staging / SELF_POINTER, {"layers": layers, "target": target})


def point_at_pinned_pair(pins_file: Path, staging: dict[str, Path]) -> None:
    """Each side's pointer to its pinned identity: hub.json (id, commit), local.json (folder, hash) or self.json."""
    pins = json.loads(pins_file.read_text())
    for name in ("target", "source"):
        pinned = dict(pins[name])
        if pinned["kind"] == "self":
            point_at_target(pinned["layers"], staging[name])
        else:
            write_json_atomic(staging[name] / f"{pinned.pop('kind')}.json", pinned)


def record_random_pair(models: ModelsParams, seed: int, staging: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths.TOKENIZER)
    for offset, (name, shape) in enumerate((("source", models.source), ("target", models.target))):
        if name == "source" and models.self_layers:
            point_at_target(models.self_layers, staging[name])
            continue
        config = shape_config(shape)  # fails here, naming the shape, if it does not exist
        if len(tokenizer) > config.vocab_size:
            raise ParamError(f"models.{name}: a tokenizer of {len(tokenizer)} tokens does not fit shape {shape!r} "
                             f"(vocab {config.vocab_size})")
        write_json_atomic(staging[name] / "random.json", {"shape": shape, "seed": seed + offset})
        tokenizer.save_pretrained(staging[name])


def prepare(models: ModelsParams, train: TrainParams, threads: int) -> None:
    """The pair of `models.kind`, written beside the one in models/ and swapped in only once both sides are
    complete: an interrupted run (its outputs `persist` in dvc.yaml, so dvc leaves them) keeps the committed pair."""
    with atomic_dirs([paths.model("source"), paths.model("target")]) as (source, target):
        staging = {"source": source, "target": target}
        if models.kind == "trained":
            train_pair(train, threads, {"target": target} if models.self_layers else staging)
            if models.self_layers:
                point_at_target(models.self_layers, source)
        elif models.kind == "hub":
            point_at_pinned_pair(paths.PINS, staging)
        else:
            record_random_pair(models, train.random_seed, staging)


def check_contract() -> dict:
    """The modes and families the contract defines, from configs and tokenizers; refused unless `mapped` is one. A
    sliding window is checked where sequences are fed (extract at its sequences' length, every handoff at each
    sequence's), so the profile's lengths are not this stage's parameters."""
    contract = Pair(str(paths.model("target")), str(paths.model("source"))).contract  # no weights loaded
    contract.require("mapped")
    return {"modes": sorted(m for m in contract.modes if contract.defined(m)),
            "families": sorted(f for f in contract.families if contract.family_defined(f))}


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.prepare_models", __doc__, argv)
    models = load_section(ModelsParams, "models")
    train, machine = load_section(TrainParams, "train"), load_section(MachineParams, "machine")
    torch.set_num_threads(machine.threads)
    started = time.perf_counter()
    prepare(models, train, machine.threads)
    defined = check_contract()
    print(json.dumps({"kind": models.kind, **defined, "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    entry(main)
