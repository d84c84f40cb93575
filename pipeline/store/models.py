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

from huggingface_hub import HfApi, constants, snapshot_download
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pipeline.store.cli import Refusal
from pipeline.store.devices import default_device, parse_dtype
from pipeline.store.params import ParamError
from pipeline.store.shapes import random_model, shape_config


class ModelNotAvailableError(Refusal, RuntimeError):
    pass


@dataclass
class ModelsParams:
    """The `models` section: where the pair comes from and how it runs.

    kind `trained`: the tiny pair trained by prepare_models (source/target are unused names);
    kind `hub`: hub ids (revisions pinned by pin_models, offline when the id is in the local cache) or local
    checkpoint folders (pinned by path and content hash); kind `random`: shape names in pipeline/store/configs.
    Downstream stages always load `models/source` and `models/target`, which for `hub` and `random` hold
    a pointer file (hub.json / local.json / random.json) instead of weights.
    """

    kind: Literal["trained", "hub", "random"]
    source: str
    target: str
    source_revision: str | None  # hub: null resolves the current revision (recorded in models/*/hub.json)
    target_revision: str | None
    dtype: Literal["float32", "bfloat16", "float16"]
    device: Literal["cpu", "cuda", "auto"]
    # null: each model whole on `device`; auto/balanced/sequential: accelerate spreads a checkpoint too large
    # for one device over the visible GPUs (then CPU), and the handoff moves each cache layer to its layer
    device_map: Literal["auto", "balanced", "sequential"] | None

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


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def unavailable(name_or_path: str, revision: str | None) -> ModelNotAvailableError:
    return ModelNotAvailableError(
        f"model {name_or_path!r}{f' (revision {revision})' if revision else ''} is neither a local folder nor "
        f"in the local Hugging Face cache, and the hub is "
        f"{'disabled (HF_HUB_OFFLINE)' if hub_offline() else 'unreachable'}. "
        f"Download it on a machine with the hub (`huggingface-cli download {name_or_path}`) or pass a local path."
    )


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
    if hub_offline() or not hub_reachable():
        raise unavailable(name_or_path, revision)
    try:
        return snapshot_download(name_or_path, revision=revision, allow_patterns=patterns)
    except Exception as err:  # noqa: BLE001
        raise ModelNotAvailableError(f"model {name_or_path!r} could not be fetched from the hub: {err}") from err


def pin_hub_id(model_id: str, revision: str | None) -> str:
    """The commit a hub id's revision (None: the default branch) resolves to: from the local Hugging Face cache
    when the id is there, so it works offline, else from the hub."""
    try:
        return Path(snapshot_download(model_id, revision=revision, local_files_only=True,
                                      allow_patterns=CONFIG_FILES)).name  # .../snapshots/<commit>
    except Exception:  # noqa: BLE001 - not in the local cache, go on to the hub
        pass
    if hub_offline() or not hub_reachable():
        raise unavailable(model_id, revision)
    return HfApi().model_info(model_id, revision=revision).sha


def folder_digest(folder: str | Path) -> str:
    """sha256 over a checkpoint folder's files (relative paths and contents; hidden entries skipped)."""
    folder = Path(folder)
    files = sorted(path for path in folder.rglob("*") if path.is_file()
                   and not any(part.startswith(".") for part in path.relative_to(folder).parts))
    digest = hashlib.sha256()
    with tqdm(total=sum(path.stat().st_size for path in files), unit="B", unit_scale=True,
              desc=f"hashing {folder.name}") as bar:
        for path in files:
            digest.update(f"{path.relative_to(folder).as_posix()}\0".encode())
            with open(path, "rb") as handle:
                while chunk := handle.read(1 << 24):
                    digest.update(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def read_pointer(folder: str | Path) -> dict | None:
    """The pointer a prepared model folder holds instead of weights (hub.json, local.json or random.json), if
    any; a local checkpoint's pointer is followed to its folder, which must still be there."""
    for name in ("hub.json", "local.json", "random.json"):
        path = Path(folder) / name
        if path.is_file():
            pointer = {"kind": name.split(".")[0], **json.loads(path.read_text())}
            if pointer["kind"] == "local" and not Path(pointer["path"]).is_dir():
                raise ModelNotAvailableError(
                    f"model folder {pointer['path']} (pinned in {path}) is gone or has moved; point models.source / "
                    f"models.target at its new place and run `dvc repro`")
            return pointer
    return None


def follow(name_or_path: str, revision: str | None) -> tuple[str, str | None, dict | None]:
    """What to load for `name_or_path`: a prepared folder's hub or local pointer followed to (id or folder,
    revision); a random pointer returned as the third item; anything else as given."""
    pointer = read_pointer(name_or_path) if Path(name_or_path).is_dir() else None
    if pointer and pointer["kind"] == "hub":
        return pointer["id"], pointer["revision"], None
    if pointer and pointer["kind"] == "local":
        return pointer["path"], None, None
    return name_or_path, revision, pointer


def load_model(name_or_path: str, revision: str | None = None, dtype="float32", device=None, device_map=None):
    """A causal LM in eval mode: on `device`, or with `device_map` spread by accelerate over the devices."""
    name, revision, random = follow(name_or_path, revision)
    if random and device_map:
        raise ParamError(f"models.device_map: {device_map!r} needs a checkpoint, and {name_or_path} is a random "
                         f"model of a stored shape; set models.device_map: null")
    if device_map:
        model = AutoModelForCausalLM.from_pretrained(resolve(name, revision), dtype=parse_dtype(dtype),
                                                     device_map=device_map)
        model.config._name_or_path = name
        return model.eval()
    if random:
        model = random_model(shape_config(random["shape"]), parse_dtype(dtype), device or default_device(),
                             random["seed"])
        model.config._name_or_path = f"random:{random['shape']}"
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(resolve(name, revision), dtype=parse_dtype(dtype))
    model.config._name_or_path = name
    return model.to(device or default_device()).eval()


def load_config(name_or_path: str, revision: str | None = None):
    """A model's config alone (no weights): what the architecture contract reads before anything is loaded."""
    name, revision, random = follow(name_or_path, revision)
    if random:
        config = shape_config(random["shape"])
        config._name_or_path = f"random:{random['shape']}"
        return config
    config = AutoConfig.from_pretrained(resolve(name, revision, config_only=True))
    config._name_or_path = name
    return config


def load_tokenizer(name_or_path: str, revision: str | None = None):
    """A model's tokenizer; a hub id fetches its config and tokenizer files only, never the weights."""
    name, revision, _ = follow(name_or_path, revision)
    return AutoTokenizer.from_pretrained(resolve(name, revision, config_only=True))


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary and the special tokens."""
    content = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()),
    }
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()
