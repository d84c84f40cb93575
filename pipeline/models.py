"""Loading models and tokenizers by local path or hub id, failing fast and clearly when one is missing.

A hub id is resolved from the local Hugging Face cache first; only if it is not there is the hub asked,
after a short reachability check, so a machine without the hub gets an error naming the model at once
instead of minutes of retries.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from dataclasses import dataclass
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotAvailableError(RuntimeError):
    pass


@dataclass
class ModelsParams:
    """The `models` section: where the pair comes from and how it runs.

    kind `trained`: the tiny pair trained by prepare_models (source/target are unused names);
    kind `hub`: hub ids, revisions pinned by prepare_models; kind `random`: shape names in pipeline/configs.
    Downstream stages always load `models/source` and `models/target`, which for `hub` and `random` hold
    a pointer file (hub.json / random.json) instead of weights.
    """

    kind: Literal["trained", "hub", "random"]
    source: str
    target: str
    source_revision: str | None = None
    target_revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda", "auto"] = "auto"

    @property
    def torch_device(self) -> str:
        return default_device() if self.device == "auto" else self.device


class IncompatiblePairError(ValueError):
    pass


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    return DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve(name_or_path: str, revision: str | None = None) -> str:
    """A local folder holding the model files: the path itself, or the hub snapshot for an id."""
    if Path(name_or_path).is_dir():
        return str(name_or_path)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name_or_path, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the local cache, go on to the hub
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    if offline or not hub_reachable():
        raise ModelNotAvailableError(
            f"model {name_or_path!r}{f' (revision {revision})' if revision else ''} is neither a local folder nor "
            f"in the local Hugging Face cache, and the hub is {'disabled (HF_HUB_OFFLINE)' if offline else 'unreachable'}. "
            f"Download it on a machine with the hub (`huggingface-cli download {name_or_path}`) or pass a local path."
        )
    try:
        return snapshot_download(name_or_path, revision=revision)
    except Exception as err:  # noqa: BLE001
        raise ModelNotAvailableError(f"model {name_or_path!r} could not be fetched from the hub: {err}") from err


def read_pointer(folder: str | Path) -> dict | None:
    """The pointer a prepared model folder holds instead of weights (hub.json or random.json), if any."""
    for name in ("hub.json", "random.json"):
        path = Path(folder) / name
        if path.is_file():
            return {"kind": name.split(".")[0], **json.loads(path.read_text())}
    return None


def load_model(name_or_path: str, revision: str | None = None, dtype="float32", device=None):
    from transformers import AutoModelForCausalLM

    pointer = read_pointer(name_or_path) if Path(name_or_path).is_dir() else None
    if pointer and pointer["kind"] == "hub":
        return load_model(pointer["id"], pointer["revision"], dtype, device)
    if pointer and pointer["kind"] == "random":
        from pipeline.shapes import random_model, shape_config

        model = random_model(shape_config(pointer["shape"]), parse_dtype(dtype), device or default_device(), pointer["seed"])
        model.config._name_or_path = f"random:{pointer['shape']}"
        return model.eval()
    folder = resolve(name_or_path, revision)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype))
    model.config._name_or_path = name_or_path
    return model.to(device or default_device()).eval()


def load_tokenizer(name_or_path: str, revision: str | None = None):
    from transformers import AutoTokenizer

    pointer = read_pointer(name_or_path) if Path(name_or_path).is_dir() else None
    if pointer and pointer["kind"] == "hub":
        return load_tokenizer(pointer["id"], pointer["revision"])
    return AutoTokenizer.from_pretrained(resolve(name_or_path, revision))


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary and the special tokens."""
    content = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()),
    }
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()


def check_pair(source_name: str, source_tokenizer, target_name: str, target_tokenizer) -> None:
    """Fail closed unless the two models read and write the same token ids."""
    if tokenizer_fingerprint(source_tokenizer) != tokenizer_fingerprint(target_tokenizer):
        source_vocab, target_vocab = len(source_tokenizer.get_vocab()), len(target_tokenizer.get_vocab())
        raise IncompatiblePairError(
            f"incompatible pair: source {source_name!r} (vocabulary {source_vocab}) and target {target_name!r} "
            f"(vocabulary {target_vocab}) have different tokenizers (vocabulary or special tokens differ); a cache "
            f"handoff needs both models to share one tokenizer"
        )
