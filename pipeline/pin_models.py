"""Stage `pin_models`: what the `models` section points at, pinned, at every `dvc repro`.

DVC cannot see a checkpoint outside the repository, so this stage always runs and writes models/pins.json, each side's
identity: the stages after it rerun exactly when one changes. A local folder is pinned by a sha256 of its fingerprint
(weights, configs, tokenizer; not a README beside them), a hub id by the commit of `models.*_revision` (from the local
Hugging Face cache when there, so offline), kinds `trained` and `random` by name, a self source as the target and n.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.store import paths
from pipeline.store.artifacts import write_json_atomic
from pipeline.store.cli import entry, no_arguments
from pipeline.store.fingerprints import folder_pin
from pipeline.store.models import ModelsParams, pin_hub_id, require_weights
from pipeline.store.params import load_section


def pin(name_or_path: str, revision: str | None) -> dict:
    """The identity of one model: a local folder's path (relative to the repository when inside it, so every clone
    pins alike) and fingerprint's hash, refused unless its weights are complete; or a hub id's commit."""
    folder = Path(name_or_path)
    if folder.is_dir():
        require_weights(name_or_path)
        place = folder.resolve()
        if place.is_relative_to(Path.cwd().resolve()):
            place = place.relative_to(Path.cwd().resolve())
        return {"kind": "local", "path": str(place), "sha256": folder_pin(folder)}
    return {"kind": "hub", "id": name_or_path, "revision": pin_hub_id(name_or_path, revision)}


def pins(models: ModelsParams) -> dict:
    if models.kind != "hub":
        return {"kind": models.kind, "source": models.source, "target": models.target}
    source = None if models.self_layers else pin(models.source, models.source_revision)
    target = pin(models.target, models.target_revision)
    return {"kind": "hub", "source": source or {"kind": "self", "layers": models.self_layers, "target": target},
            "target": target}


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.pin_models", __doc__, argv)
    result = pins(load_section(ModelsParams, "models"))
    write_json_atomic(paths.PINS, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    entry(main)
