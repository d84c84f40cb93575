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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from huggingface_hub import constants, snapshot_download
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pipeline.store.cli import Refusal
from pipeline.store.devices import default_device, parse_dtype
from pipeline.store.shapes import random_model, shape_config


class ModelNotAvailableError(Refusal, RuntimeError):
    pass


@dataclass
class ModelsParams:
    """The `models` section: where the pair comes from and how it runs.

    kind `trained`: the tiny pair trained by prepare_models (source/target are unused names);
    kind `hub`: hub ids, revisions pinned by prepare_models; kind `random`: shape names in pipeline/store/configs.
    Downstream stages always load `models/source` and `models/target`, which for `hub` and `random` hold
    a pointer file (hub.json / random.json) instead of weights.
    """

    kind: Literal["trained", "hub", "random"]
    source: str
    target: str
    source_revision: str | None  # hub: null resolves the current revision (recorded in models/*/hub.json)
    target_revision: str | None
    dtype: Literal["float32", "bfloat16", "float16"]
    device: Literal["cpu", "cuda", "auto"]

    @property
    def torch_device(self) -> str:
        return default_device() if self.device == "auto" else self.device


class IncompatiblePairError(Refusal, ValueError):
    pass


def hub_reachable(timeout: float = 3.0) -> bool:
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


CONFIG_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "vocab*",
                "merges.txt", "*.model"]  # what describes a model without its weights


def resolve(name_or_path: str, revision: str | None = None, config_only: bool = False) -> str:
    """A local folder holding the model files: the path itself, or the hub snapshot for an id (with
    `config_only`, a snapshot of the config and tokenizer files alone: no weights are fetched)."""
    if Path(name_or_path).is_dir():
        return str(name_or_path)
    patterns = CONFIG_FILES if config_only else None
    try:
        return snapshot_download(name_or_path, revision=revision, local_files_only=True, allow_patterns=patterns)
    except Exception:  # noqa: BLE001 - not in the local cache, go on to the hub
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    if offline or not hub_reachable():
        raise ModelNotAvailableError(
            f"model {name_or_path!r}{f' (revision {revision})' if revision else ''} is neither a local folder nor "
            f"in the local Hugging Face cache, and the hub is "
            f"{'disabled (HF_HUB_OFFLINE)' if offline else 'unreachable'}. "
            f"Download it on a machine with the hub (`huggingface-cli download {name_or_path}`) or pass a local path."
        )
    try:
        return snapshot_download(name_or_path, revision=revision, allow_patterns=patterns)
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
    pointer = read_pointer(name_or_path) if Path(name_or_path).is_dir() else None
    if pointer and pointer["kind"] == "hub":
        return load_model(pointer["id"], pointer["revision"], dtype, device)
    if pointer and pointer["kind"] == "random":
        model = random_model(shape_config(pointer["shape"]), parse_dtype(dtype), device or default_device(),
                             pointer["seed"])
        model.config._name_or_path = f"random:{pointer['shape']}"
        return model.eval()
    folder = resolve(name_or_path, revision)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype))
    model.config._name_or_path = name_or_path
    return model.to(device or default_device()).eval()


def load_config(name_or_path: str, revision: str | None = None):
    """A model's config alone (no weights): what the architecture contract reads before anything is loaded."""
    pointer = read_pointer(name_or_path) if Path(name_or_path).is_dir() else None
    if pointer and pointer["kind"] == "hub":
        return load_config(pointer["id"], pointer["revision"])
    if pointer and pointer["kind"] == "random":
        config = shape_config(pointer["shape"])
        config._name_or_path = f"random:{pointer['shape']}"
        return config
    config = AutoConfig.from_pretrained(resolve(name_or_path, revision, config_only=True))
    config._name_or_path = name_or_path
    return config


def load_tokenizer(name_or_path: str, revision: str | None = None):
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
