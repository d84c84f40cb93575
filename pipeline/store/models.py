"""Loading models and tokenizers by local path or hub id, failing fast and clearly when one is missing: a hub id is
read from the local Hugging Face cache first, the hub asked only after a short reachability check; a name that looks
like a path is never asked of the hub. A prepared `self:<n>` source (`store.truncated`) is a pointer, self.json.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import huggingface_hub
import huggingface_hub.constants as hub_constants
from pydantic import model_validator
from tqdm.auto import tqdm

from pipeline.store.artifacts import hash_file
from pipeline.store.cli import Refusal
from pipeline.store.devices import ModelDtype, default_device, parse_dtype
from pipeline.store.lazy import lazy
from pipeline.store.params import ParamError, Params
from pipeline.store.shapes import random_model, shape_config
from pipeline.store.truncated import SELF_POINTER, self_layers, truncate, truncated_config
from pipeline.store.weights import weights_refusal

transformers = lazy("transformers")
configuration_auto = lazy("transformers.models.auto.configuration_auto")


class ModelNotAvailableError(Refusal, RuntimeError):
    pass


class ModelFolderError(Refusal, ValueError):
    """A model folder whose config or tokenizer cannot be read: the message names the folder and what is wrong."""


class NoTokenizerError(ModelFolderError):
    pass


class ModelsParams(Params):
    """kind `trained`: the tiny pair prepare_models trains (names unused); `hub`: hub ids or local checkpoint
    folders; `random`: shape names in pipeline/store/configs. With any kind, `source: self:<n>` is the target's first
    n layers. For `hub` and `random`, `models/source` and `models/target` hold a pointer file, not weights."""

    kind: Literal["trained", "hub", "random"]
    source: str
    target: str
    source_revision: str | None  # hub: null resolves the current revision (recorded in models/*/hub.json)
    target_revision: str | None
    dtype: ModelDtype  # float32, bfloat16, float16 or auto (machine_dtype)
    # null: each model whole on `machine.device`; auto/balanced/sequential: accelerate spreads a checkpoint too large
    # for one device over the visible GPUs (then CPU), and the handoff moves each cache layer to its layer
    device_map: Literal["auto", "balanced", "sequential"] | None

    @model_validator(mode="after")
    def _random_has_no_checkpoint_and_self_is_a_source(self) -> ModelsParams:
        if self.kind == "random" and self.device_map is not None:
            raise ParamError(f"models.device_map: {self.device_map!r} needs a checkpoint, and a random model of a "
                             f"stored shape has none; set models.device_map: null")
        self_layers(self.source)  # refuses a malformed self:<n>; n against the target's depth: check_params
        if self_layers(self.target) is not None:
            raise ParamError(f"models.target: {self.target!r}; self:<n> names a source cut from the target, so "
                             f"it belongs in models.source")
        return self

    @property
    def self_layers(self) -> int | None:
        return self_layers(self.source)


class IncompatiblePairError(Refusal, ValueError):
    pass


def hub_reachable(timeout: float = 3.0) -> bool:
    host = urlparse(hub_constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


CONFIG_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "vocab*",
                "merges.txt", "*.model", "chat_template*"]  # what describes a model without its weights
TOKENIZER_CONFIG = "tokenizer_config.json"  # the tokenizer's class and special tokens
# files that carry a vocabulary: without one, transformers 5 builds a stand-in tokenizer of one to five tokens
# for several model types (qwen2, qwen3, gemma, gpt2, phi) instead of raising, and it must never be compared
TOKENIZER_MARKERS = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model", "*.tiktoken",
                   "sentencepiece*.model")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def looks_like_path(name: str) -> bool:
    """Whether `name` is meant as a local folder: not a hub id `name` or `owner/name` (no leading `.`, `/` or `~`,
    no backslash or trailing slash), or `models/target` where `models` is a local folder, not a hub owner."""
    if name.startswith((".", "/", "~")) or "\\" in name or name.endswith("/") or name.count("/") > 1:
        return True
    return "/" in name and Path(name.split("/")[0]).is_dir()


def unavailable(name_or_path: str, revision: str | None) -> ModelNotAvailableError:
    if Path(name_or_path).exists():  # a file (README.md): a path, never a hub id to download
        return ModelNotAvailableError(f"model folder {name_or_path}: a file, not a folder; point at the folder that "
                                      f"holds the model's config.json")
    if looks_like_path(name_or_path):
        return ModelNotAvailableError(f"model folder {name_or_path}: no such folder")
    return ModelNotAvailableError(
        f"model {name_or_path!r}{f' (revision {revision})' if revision else ''} is neither a local folder nor "
        f"in the local Hugging Face cache, and the hub is "
        f"{'disabled (HF_HUB_OFFLINE)' if hub_offline() else 'unreachable'}. "
        f"Download it on a machine with the hub (`huggingface-cli download {name_or_path}`) or pass a local path."
    )


def resolve(name_or_path: str, revision: str | None = None, config_only: bool = False) -> str:
    """A local folder holding the model files: the path itself, or an id's hub snapshot (`config_only`: no weights)."""
    if Path(name_or_path).is_dir():
        return str(name_or_path)
    if looks_like_path(name_or_path) or Path(name_or_path).exists():
        raise unavailable(name_or_path, revision)
    patterns = CONFIG_FILES if config_only else None
    with contextlib.suppress(Exception):  # not in the local cache: go on to the hub
        return huggingface_hub.snapshot_download(name_or_path, revision=revision, local_files_only=True,
                                                 allow_patterns=patterns)
    if hub_offline() or not hub_reachable():
        raise unavailable(name_or_path, revision)
    try:
        return huggingface_hub.snapshot_download(name_or_path, revision=revision, allow_patterns=patterns)
    except Exception as err:  # noqa: BLE001
        raise ModelNotAvailableError(f"model {name_or_path!r} could not be fetched from the hub: {err}") from err


def pin_hub_id(model_id: str, revision: str | None) -> str:
    """The commit a hub id's revision (None: the default branch) resolves to, from the local cache when there."""
    with contextlib.suppress(Exception):  # not in the local cache: go on to the hub
        return Path(huggingface_hub.snapshot_download(model_id, revision=revision, local_files_only=True,
                                                      allow_patterns=CONFIG_FILES)).name  # .../snapshots/<commit>
    if hub_offline() or not hub_reachable():
        raise unavailable(model_id, revision)
    return huggingface_hub.HfApi().model_info(model_id, revision=revision).sha


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
            hash_file(digest, path, bar)
    return digest.hexdigest()


def read_pointer(folder: str | Path) -> dict | None:
    """The pointer a prepared model folder holds instead of weights, if any (a self source's `target` made a path)."""
    for name in ("hub.json", "local.json", "random.json", SELF_POINTER):
        path = Path(folder) / name
        if path.is_file():
            pointer = {"kind": name.split(".")[0], **json.loads(path.read_text())}
            if pointer["kind"] == "local" and not Path(pointer["path"]).is_dir():
                raise ModelNotAvailableError(
                    f"model folder {pointer['path']} (pinned in {path}) is gone or has moved; point models.source / "
                    f"models.target at its new place and run `dvc repro`")
            if pointer["kind"] == "self":
                pointer["target"] = str(Path(folder) / pointer["target"])
            return pointer
    return None


def follow(name_or_path: str, revision: str | None) -> tuple[str, str | None, dict | None]:
    """(id or folder, revision, random pointer or None) to load for `name_or_path`, a hub or local pointer followed."""
    pointer = read_pointer(name_or_path)
    if pointer and pointer["kind"] == "hub":
        return pointer["id"], pointer["revision"], None
    if pointer and pointer["kind"] == "local":
        return pointer["path"], None, None
    return name_or_path, revision, pointer


def self_source(name_or_path: str, target: str | None = None,
                target_revision: str | None = None) -> tuple[int, str, str | None] | None:
    """(n, target, its revision) when `name_or_path` is a self source: a prepared folder's self.json (its target
    the prepared one beside it) or the name `self:<n>` (its target `target`, which it then needs); else None."""
    layers = self_layers(name_or_path)
    if layers is not None:
        if target is None:
            raise ParamError(f"models.source: {name_or_path!r} is the target's first {layers} layers, and no target "
                             f"was given; name the target too (models.target, check_pair's TARGET)")
        return layers, target, target_revision
    pointer = read_pointer(name_or_path)
    if pointer and pointer["kind"] == "self":
        return pointer["layers"], pointer["target"], None
    return None


def load_model(name_or_path: str, revision: str | None = None, dtype="float32", device=None, device_map=None,
               target: str | None = None, target_revision: str | None = None):
    """A causal LM in eval mode: on `device`, or with `device_map` spread by accelerate. A self source is its target
    loaded and truncated (the deeper layers freed with the target object)."""
    cut = self_source(name_or_path, target, target_revision)
    if cut:
        layers, target, target_revision = cut
        return truncate(load_model(target, target_revision, dtype, device, device_map), layers)
    name, revision, random = follow(name_or_path, revision)
    if random:
        if device_map:
            raise ParamError(f"models.device_map: {device_map!r} needs a checkpoint, and {name_or_path} is a random "
                             f"model of a stored shape; set models.device_map: null")
        model = random_model(shape_config(random["shape"]), parse_dtype(dtype), device or default_device(),
                             random["seed"])
        model.config._name_or_path = f"random:{random['shape']}"
        return model.eval()
    spread = {"device_map": device_map} if device_map else {}
    model = loaded(transformers.AutoModelForCausalLM.from_pretrained(
        model_folder(name, revision), dtype=parse_dtype(dtype), output_loading_info=True, **spread), name)
    return (model if device_map else model.to(device or default_device())).eval()


def config_refusal(folder: str | Path) -> str | None:
    """What is wrong with a model folder's config.json, as the rest of a sentence naming the folder; None when
    transformers can build its config without running the model's own code."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        present = sorted(entry.name for entry in Path(folder).iterdir())[:5] if Path(folder).is_dir() else []
        return (f"holds no config.json ({'it holds ' + ', '.join(present) if present else 'it is empty'}); point at "
                f"the folder of a model's files, or download them into it")
    try:
        content = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"has a config.json that is not valid JSON ({err}); download it again"
    if not isinstance(content, dict):
        return f"has a config.json holding a JSON {type(content).__name__}, not an object with a model_type"
    model_type = content.get("model_type")
    if not model_type:
        return "has a config.json without a model_type, so the architecture is unknown: not a transformers model"
    if model_type not in configuration_auto.CONFIG_MAPPING:
        if content.get("auto_map"):
            return (f"has model_type {model_type!r}, which needs the model's own code (auto_map "
                    f"{', '.join(sorted(content['auto_map']))}); this project runs no remote code "
                    f"(trust_remote_code)")
        return (f"has model_type {model_type!r}, an architecture transformers {transformers.__version__} does not "
                f"know (a newer transformers may)")
    return None


def model_folder(name: str, revision: str | None = None, config_only: bool = False) -> str:
    """`resolve`, refusing (one line naming the folder) a config transformers cannot build, or incomplete weights."""
    folder = resolve(name, revision, config_only)
    refusal = config_refusal(folder) or (None if config_only else weights_refusal(folder))
    if refusal:
        raise ModelFolderError(f"model folder {name if folder == name else f'{name} ({folder})'} {refusal}")
    return folder


def require_weights(name_or_path: str, revision: str | None = None, target: str | None = None,
                    target_revision: str | None = None) -> None:
    """Refuse a local checkpoint whose weights would not load whole, from its files alone (a self source: its
    target's; a hub id or a random shape has no folder yet)."""
    cut = self_source(name_or_path, target, target_revision)
    if cut:
        return require_weights(cut[1], cut[2])
    name, _, random = follow(name_or_path, revision)
    refusal = None if random or not Path(name).is_dir() else weights_refusal(name)
    if refusal:
        raise ModelFolderError(f"model folder {name} {refusal}")


def loaded(loading, name: str):
    """`from_pretrained(..., output_loading_info=True)`'s model, refused where the checkpoint lacks a tensor."""
    model, info = loading
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ModelFolderError(f"model folder {name}: its weights lack {len(missing)} tensor(s) of the architecture "
                               f"({missing[0]}{', ...' if len(missing) > 1 else ''}), which would run at random "
                               f"values; download the complete checkpoint")
    model.config._name_or_path = name
    return model


def load_config(name_or_path: str, revision: str | None = None, target: str | None = None,
                target_revision: str | None = None):
    cut = self_source(name_or_path, target, target_revision)
    if cut:
        return truncated_config(load_config(cut[1], cut[2]), cut[0])
    name, revision, random = follow(name_or_path, revision)
    if random:
        config = shape_config(random["shape"])
        config._name_or_path = f"random:{random['shape']}"
        return config
    folder = model_folder(name, revision, config_only=True)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as err:  # valid JSON of a known type, wrong fields
        raise ModelFolderError(f"model folder {name}: transformers cannot build its config "
                               f"({first_line(err)})") from err
    config._name_or_path = name
    return config


def first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"


def load_tokenizer(name_or_path: str, revision: str | None = None, target: str | None = None,
                   target_revision: str | None = None):
    """A model's tokenizer (a self source's: its target's); a folder without tokenizer files (NoTokenizerError:
    never a stand-in) or tokenizer_config.json is refused."""
    cut = self_source(name_or_path, target, target_revision)
    if cut:
        return load_tokenizer(cut[1], cut[2])
    name, revision, _ = follow(name_or_path, revision)
    folder = resolve(name, revision, config_only=True)
    if not any(any(Path(folder).glob(pattern)) for pattern in TOKENIZER_MARKERS):
        raise NoTokenizerError(f"model folder {name} holds no tokenizer files (none of {', '.join(TOKENIZER_MARKERS)})")
    if not (Path(folder) / TOKENIZER_CONFIG).is_file():  # transformers would guess the class and special tokens
        raise ModelFolderError(f"model folder {name} has tokenizer files but no {TOKENIZER_CONFIG}, without which its "
                               f"prompts are tokenized wrongly; copy the model's {TOKENIZER_CONFIG} into it")
    try:
        return transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises a bare Exception on a broken file
        raise ModelFolderError(f"model folder {name}: its tokenizer cannot be loaded ({first_line(err)})") from err


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary and the special tokens."""
    content = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()),
    }
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()
