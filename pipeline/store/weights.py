"""A checkpoint folder's weight files, from the files alone: which ones transformers would load (`weight_files`) and
whether they are complete (`weights_refusal`, from the headers and the config), so a folder that cannot load whole is
refused in one line before any weight is read.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.store.lazy import lazy

torch = lazy("torch")
transformers = lazy("transformers")

# the files transformers reads a folder's weights from, in its order of preference: one file, or an index of shards
WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
SAFETENSORS_PREFIX = 8  # a safetensors file: an 8-byte little-endian header length, the JSON header, the data


def weight_files(folder: str | Path) -> list[Path]:
    """What transformers would load: the first of WEIGHT_NAMES in `folder` (an index with the shards it names)."""
    folder = Path(folder)
    for name in WEIGHT_NAMES:
        path = folder / name
        if path.is_file():
            return [path, *shards(path)] if name.endswith(".index.json") else [path]
    return []


def shards(index: Path) -> list[Path]:
    """The shard files an index's weight_map names ([] when the index is no JSON object: `weights_refusal` says so)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return []
    return [index.parent / shard for shard in sorted(set(weight_map.values()))]


def safetensors_header(path: Path) -> tuple[dict | None, int]:
    """(JSON header or None where it cannot be read, the header's length in bytes)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(SAFETENSORS_PREFIX)
        length = int.from_bytes(prefix, "little") if len(prefix) == SAFETENSORS_PREFIX else None
        raw = handle.read(length) if length is not None and length <= size else b""
    try:
        header = json.loads(raw) if length is not None and len(raw) == length else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    return (header if isinstance(header, dict) else None), length or 0


def safetensors_refusal(path: Path) -> str | None:
    """What is wrong with a safetensors file's framing (unreadable header, data not the size it says); None if whole."""
    size = path.stat().st_size
    header, length = safetensors_header(path)
    if header is None:
        return f"{path.name} is not a safetensors file (its header cannot be read)"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    expected = SAFETENSORS_PREFIX + length + max(ends, default=0)
    if size != expected:
        return f"{path.name} holds {size} bytes where its header describes {expected} (truncated or altered)"
    return None


def weights_refusal(folder: str | Path) -> str | None:
    """What keeps a folder's weights from loading whole, as the rest of a sentence naming it; None when complete."""
    files = weight_files(folder)
    if not files:
        return (f"holds no weights (none of {', '.join(WEIGHT_NAMES)}); download the model's weights into it or "
                f"point at the folder that has them")
    if files[0].name.endswith(".index.json") and len(files) == 1:
        return f"has an index {files[0].name} that names no shards (not a weight_map); download it again"
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        return f"misses the shard {missing[0]} its {files[0].name} names; download it"
    for path in files:
        problem = path.suffix == ".safetensors" and safetensors_refusal(path)
        if problem:
            return f"has incomplete weights: {problem}; download them again"
    missing = missing_tensors(folder, files)
    if missing:
        more = ", ..." if len(missing) > 1 else ""
        return (f"lacks {len(missing)} tensor(s) of the architecture ({missing[0]}{more}), which would run at random "
                f"values; download the complete checkpoint")
    return None


def missing_tensors(folder: str | Path, files: list[Path]) -> list[str]:
    """Tensors of the folder's architecture (built on the meta device) that no safetensors header of `files` names;
    a tied tensor counts under any of its names, one `_keys_to_ignore_on_load_missing` lets go is skipped. [] where a
    weight file is not safetensors."""
    if any(path.suffix != ".safetensors" for path in files if not path.name.endswith(".index.json")):
        return []
    present = {name for path in files if path.suffix == ".safetensors"
               for name in (safetensors_header(path)[0] or {}) if name != "__metadata__"}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(folder)))
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    named = {name for names in aliases.values() for name in names}
    buffers = [[name] for name in model.state_dict() if name not in named]  # persistent buffers
    optional = [re.compile(pattern) for pattern in model._keys_to_ignore_on_load_missing or ()]
    return sorted(names[0] for names in [*aliases.values(), *buffers] if not present.intersection(names)
                  and not any(pattern.search(name) for pattern in optional for name in names))
