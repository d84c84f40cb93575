"""What a map is bound to: a fingerprint of each model of its pair made of named parts (`FINGERPRINT_PARTS`), content
only, so a copied folder still matches and a README.md beside the weights is no part of it. A map written before
fingerprints had parts is compared in its form (`legacy_fingerprint`), which cannot say which part differs.
"""
from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.store.artifacts import hash_file
from pipeline.store.models import TOKENIZER_MARKERS, folder_digest, follow, pin_hub_id, resolve, self_source
from pipeline.store.weights import weight_files

TOKENIZER_DESCRIPTION = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt")
# transformers 5's chat template file: part of the tokenizer, though legacy maps recorded their digest without it
CHAT_TEMPLATES = ("chat_template.jinja", "chat_template.json")
# the top-level files of a checkpoint folder each part digests; the weights: `store.weights.weight_files`
PART_FILES = {
    "config": ("config.json",),
    "generation_config": ("generation_config.json",),
    "tokenizer": (*TOKENIZER_MARKERS, *TOKENIZER_DESCRIPTION, *CHAT_TEMPLATES),
}
PARSED = ("config", "generation_config")  # parts compared by their parsed JSON: a re-indented config is the same
# what a refusal says of each part that differs
FINGERPRINT_PARTS = {"weights": "weights differ", "config": "config differs",
                     "generation_config": "generation config differs", "tokenizer": "tokenizer differs"}
LEGACY_PARTS = {"pin": "weights, config, generation config or extra files differ", "tokenizer": "tokenizer differs"}
LEGACY_NOTE = ("; the map records one digest of a folder's every file, as maps did before fingerprints named their "
               "parts, so it cannot say which")


def part_files(folder: str | Path, part: str) -> list[Path]:
    folder = Path(folder)
    if part == "weights":
        return [path for path in weight_files(folder) if path.is_file()]
    return sorted({path for pattern in PART_FILES[part] for path in folder.glob(pattern) if path.is_file()})


def parsed_json(path: Path) -> bytes | None:
    """A JSON file's content, keys sorted and no whitespace; None when it is not JSON."""
    try:
        return json.dumps(json.loads(path.read_text()), sort_keys=True, separators=(",", ":")).encode()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def files_digest(files: list[Path], bar: tqdm | None = None, parsed: bool = False) -> str | None:
    """sha256 over `files` (each name, NUL, contents or with `parsed` `parsed_json`, NUL); None for no files."""
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0".encode())
        canonical = parsed_json(path) if parsed else None
        if canonical is None:
            hash_file(digest, path, bar)
        else:
            digest.update(canonical)
            if bar is not None:
                bar.update(path.stat().st_size)
        digest.update(b"\0")
    return digest.hexdigest()


def tokenizer_digest(folder: str | Path) -> str | None:
    """The tokenizer's digest as maps recorded it before fingerprints had parts (the chat template files aside)."""
    return files_digest([path for path in part_files(folder, "tokenizer") if path.name not in CHAT_TEMPLATES])


def folder_parts(folder: str | Path, parts=tuple(FINGERPRINT_PARTS)) -> dict[str, str | None]:
    files = {part: part_files(folder, part) for part in parts}
    size = sum(path.stat().st_size for paths in files.values() for path in paths)
    with tqdm(total=size, unit="B", unit_scale=True, desc=f"hashing {Path(folder).name}") as bar:
        digests = {part: files_digest(paths, bar, part in PARSED) for part, paths in files.items()}
    return {part: None if digest is None else f"sha256:{digest}" for part, digest in digests.items()}


def folder_pin(folder: str | Path) -> str:
    """One sha256 over a local checkpoint folder's fingerprint: a NOTES.md written beside the weights reruns nothing."""
    return hashlib.sha256(json.dumps(folder_parts(folder), sort_keys=True).encode()).hexdigest()


def fingerprint(name_or_path: str, revision: str | None = None, target: str | None = None,
                target_revision: str | None = None) -> dict[str, str | None]:
    """One model's `FINGERPRINT_PARTS`: a hub id's weights by the commit its revision resolves to, a random model's
    by shape and seed, a self source's its target's cut at n; everything else by content."""
    cut = self_source(name_or_path, target, target_revision)
    if cut:
        layers, target, target_revision = cut
        whole = fingerprint(target, target_revision)
        return {**whole, "weights": f"self:{layers}:{whole['weights']}", "config": f"self:{layers}:{whole['config']}"}
    name, revision, random = follow(name_or_path, revision)
    if random:
        return {"weights": f"random:{random['shape']}:seed{random['seed']}", "config": f"shape:{random['shape']}",
                "generation_config": None, "tokenizer": None}
    if Path(name).is_dir():
        return folder_parts(name)
    described = folder_parts(resolve(name, revision, config_only=True), ("config", "generation_config", "tokenizer"))
    return {"weights": f"hub:{name}@{pin_hub_id(name, revision)}", **described}


def legacy_fingerprint(name_or_path: str, revision: str | None = None, target: str | None = None,
                       target_revision: str | None = None) -> dict[str, str | None]:
    """A model's fingerprint as maps recorded it before it had parts: `pin` (a local folder's `folder_digest`, as
    `fingerprint` otherwise) and `tokenizer` (`tokenizer_digest`)."""
    cut = self_source(name_or_path, target, target_revision)
    if cut:
        layers, target, target_revision = cut
        whole = legacy_fingerprint(target, target_revision)
        return {"pin": f"self:{layers}:{whole['pin']}", "tokenizer": whole["tokenizer"]}
    name, revision, random = follow(name_or_path, revision)
    if random:
        return {"pin": f"random:{random['shape']}:seed{random['seed']}", "tokenizer": None}
    if Path(name).is_dir():
        return {"pin": f"sha256:{folder_digest(name)}", "tokenizer": tokenizer_digest(name)}
    return {"pin": f"hub:{name}@{pin_hub_id(name, revision)}",
            "tokenizer": tokenizer_digest(resolve(name, revision, config_only=True))}


class PairFingerprints:
    """A loaded pair's fingerprints, each form hashed once, when first compared: `parts` (what a map records) and
    `legacy` (for a map written before fingerprints had parts). `source` None: a target alone."""

    def __init__(self, source: str | None, target: str, source_revision: str | None = None,
                 target_revision: str | None = None):
        self.sides = {"source": (source, source_revision), "target": (target, target_revision)}

    def _each(self, of) -> dict:
        target, target_revision = self.sides["target"]
        return {side: of(name, revision, target, target_revision) if name else None
                for side, (name, revision) in self.sides.items()}

    @cached_property
    def parts(self) -> dict:
        return self._each(fingerprint)

    @cached_property
    def legacy(self) -> dict:
        return self._each(legacy_fingerprint)


def pair_fingerprints(source: str, target: str) -> dict:
    return PairFingerprints(source, target).parts


def short(value: str | None) -> str:
    return "none" if value is None else value if len(value) <= 24 else value[:24] + "…"


def model_differences(fitted: dict | None, loaded: PairFingerprints) -> str | None:
    """What differs between the models a map was fitted on (`Mapper.models`) and the loaded ones, as the rest of a
    sentence naming each part that differs; None when they are the same (extra files are no part of either)."""
    if fitted is None:
        return "records no fingerprints of the models it was fitted on (written before maps were bound to their pair)"
    legacy = any("pin" in (side or {}) for side in fitted.values())
    said, current = (LEGACY_PARTS, loaded.legacy) if legacy else (FINGERPRINT_PARTS, loaded.parts)
    if fitted == current:
        return None
    if fitted.get("source") == current["target"] and fitted.get("target") == current["source"]:
        return "was fitted on this pair with source and target swapped"
    differ = []
    for side in ("source", "target"):
        was, now = fitted.get(side) or {}, current[side] or {}
        differ += [f"the {side}'s {said[part]} (fitted on {short(was.get(part))}, loaded {short(now.get(part))})"
                   for part in said if was.get(part) != now.get(part)]
    return "was fitted on other models: " + "; ".join(differ) + (LEGACY_NOTE if legacy else "")
