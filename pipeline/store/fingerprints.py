"""What a map is bound to: a fingerprint of each model of the pair it was fitted on (the pin `pin_models`
records, and a digest of its tokenizer files), content only, so a map's bytes depend on its models alone and a
copied folder still matches. `kv.pair.Pair` compares a map's fingerprints with its own models' before any forward.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline.store.models import TOKENIZER_FILES, folder_digest, follow, pin_hub_id, resolve, self_source

TOKENIZER_DESCRIPTION = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt")


def tokenizer_digest(folder: str | Path) -> str | None:
    """sha256 over a model folder's tokenizer files (names and contents); None where it holds none."""
    folder = Path(folder)
    files = sorted({path for pattern in (*TOKENIZER_FILES, *TOKENIZER_DESCRIPTION) for path in folder.glob(pattern)
                    if path.is_file()})
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0".encode())
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def fingerprint(name_or_path: str, revision: str | None = None, target: str | None = None) -> dict:
    """What a map is bound to, of one model: its pin, the identity `pin_models` records (`folder_digest`, the sha256
    of a local folder's weights, config and tokenizer; `pin_hub_id`, a hub id's commit; a random model's shape and
    seed), and `tokenizer_digest`. Content only, never a path or a time: a map's bytes depend on its models alone.
    A self source (`self_source`; the bare name with its `target`) is its target's fingerprint and its n."""
    cut = self_source(name_or_path, target)
    if cut:
        layers, target, target_revision = cut
        whole = fingerprint(target, target_revision)
        return {"pin": f"self:{layers}:{whole['pin']}", "tokenizer": whole["tokenizer"]}
    name, revision, random = follow(name_or_path, revision)
    if random:
        return {"pin": f"random:{random['shape']}:seed{random['seed']}", "tokenizer": None}
    if Path(name).is_dir():
        return {"pin": f"sha256:{folder_digest(name)}", "tokenizer": tokenizer_digest(name)}
    return {"pin": f"hub:{name}@{pin_hub_id(name, revision)}",
            "tokenizer": tokenizer_digest(resolve(name, revision, config_only=True))}


def pair_fingerprints(source: str, target: str, source_revision: str | None = None,
                      target_revision: str | None = None) -> dict:
    """Both models' `fingerprint`s, as a map's metadata records them (`Mapper.models`)."""
    return {"source": fingerprint(source, source_revision, target), "target": fingerprint(target, target_revision)}
