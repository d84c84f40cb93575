"""Each way to change a copy of a model folder, and the part of its fingerprint the change reaches (`EDITS`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def add_extra_files(folder: Path) -> None:
    (folder / "NOTES.md").write_text("a copy of the target, with notes\n")
    (folder / "README.md").write_text("# model card\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")


def flip_last_weight_byte(folder: Path) -> None:
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[-1] ^= 0x01
    (folder / "model.safetensors").write_bytes(bytes(weights))


def edit_json(name: str, key: str, value):
    def edit(folder: Path) -> None:
        content = json.loads((folder / name).read_text())
        content[key] = value
        (folder / name).write_text(json.dumps(content, indent=2))
    return edit


def reindent_tokenizer(folder: Path) -> None:
    """Other bytes, the same vocabulary and special tokens: the pair's contract still holds, the fingerprint not."""
    path = folder / "tokenizer.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4))


def add_stray_weights(folder: Path) -> None:
    """Weight-like files transformers does not read beside model.safetensors: a map, an old .bin, a stray shard."""
    (folder / "mapper.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:64])
    (folder / "pytorch_model.bin").write_bytes(b"an older checkpoint")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"a leftover shard")


def reindent_config(folder: Path) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=8, sort_keys=True) + "\n\n")


def add_chat_template(folder: Path) -> None:
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")


# each way to change a copy of a model folder: the part of its fingerprint that changes (None: no part)
EDITS = {
    "extra files": (add_extra_files, None),
    "stray weight files": (add_stray_weights, None),
    "reindented config": (reindent_config, None),
    "chat template": (add_chat_template, "tokenizer"),
    "weights": (flip_last_weight_byte, "weights"),
    "config": (edit_json("config.json", "initializer_range", 0.05), "config"),
    "generation config": (edit_json("generation_config.json", "temperature", 0.7), "generation_config"),
    "tokenizer": (reindent_tokenizer, "tokenizer"),
}


def edited_copy(folder: Path, out: Path, edit: str) -> str:
    """A copy of the model folder `folder` at `out`, changed by `EDITS[edit]`."""
    shutil.copytree(folder, out)
    EDITS[edit][0](out)
    return str(out)
