"""The numbers and inputs a user tool takes (flags, `kv-transfer`'s model args), checked before any model work by the
rules params.yaml's values obey: each returns the value as the tool uses it or raises `ParamError` naming `name`, the
flag or arg as the user spelt it (`--keep`, `keep=`).
"""
from __future__ import annotations

import math
import operator
from pathlib import Path
from typing import Sequence

from pipeline.store.lazy import lazy
from pipeline.store.params import ParamError

torch = lazy("torch")


class ParamTypeError(ParamError, TypeError):
    """A value of the wrong kind (text where token ids go, a float id)."""


def number(value, name: str, kind: type = float):
    try:
        # lm-eval reads `batch_size=-1` as the float -1.0: an integral float is an integer, 2.5 is not
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return kind(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ParamError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {value!r}") from None


def choice(value, name: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ParamError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def share(value, name: str) -> float:
    parsed = number(value, name)
    if not 0 < parsed <= 1:
        raise ParamError(f"{name}: expected a share in (0, 1], got {value}")
    return parsed


def temperature(value, name: str) -> float:
    parsed = number(value, name)
    if not math.isfinite(parsed) or parsed < 0:
        raise ParamError(f"{name}: expected a finite number >= 0 (0 is greedy), got {value}")
    return parsed


def at_least(value, name: str, low: int, why: str = "") -> int:
    parsed = number(value, name, int)
    if parsed < low:
        raise ParamError(f"{name}: expected an integer >= {low}{f' ({why})' if why else ''}, got {value}")
    return parsed


def lengths(values: Sequence, name: str) -> list[int]:
    return [at_least(value, name, 2, "a prefix for the source and a last token for the target") for value in values]


def ks(values: Sequence, name: str, source_layers: int, source: str) -> list[int]:
    parsed = [at_least(value, name, 1) for value in values]
    for k in parsed:
        if k > source_layers:
            raise ParamError(f"{name}: k={k} exceeds the source's {source_layers} layers ({source}); give k in "
                             f"1..{source_layers}")
    return parsed


def within(count: int, name: str, available: int, what: str) -> int:
    """A count to take, at most `available` (`what` names them: "prompts in data/eval.parquet")."""
    if count > available:
        raise ParamError(f"{name}: {count} asked, but there are {available} {what}; give at most {available}")
    return count


def positions(tokens: int, new_tokens: int, name: str, allowed: int) -> None:
    if tokens + new_tokens > allowed:
        raise ParamError(f"{name}: the prompt is {tokens} tokens and {new_tokens} new ones are asked, past the models' "
                         f"{allowed} positions; give a shorter prompt or fewer new tokens")


def token_ids(values, name: str, vocabulary: int) -> list[int]:
    """One prompt's token ids as plain ints: integers of any library in 0..vocabulary-1; text, a float (int() would
    truncate it) or a nested sequence is a ParamTypeError."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ParamTypeError(f"{name}: expected token ids (a list of ints), got {type(values).__name__} "
                             f"{values!r:.40}; encode text with the target's tokenizer first")
    ids = []
    for position, value in enumerate(values):
        try:
            if isinstance(value, bool):
                raise TypeError
            ids.append(operator.index(value))  # exact for integers of any library, refused for floats
        except (TypeError, ValueError, RuntimeError):
            raise ParamTypeError(f"{name}: token {position} is {type(value).__name__} {value!r:.40}, not an integer "
                                 f"id; give ints (a float would be truncated)") from None
    outside = [token for token in ids if not 0 <= token < vocabulary]
    if outside:
        raise ParamError(f"{name}: token id {outside[0]} is outside the vocabulary (ids 0..{vocabulary - 1}); give "
                         f"ids the target's tokenizer makes")
    return ids


def text(value: str, name: str) -> str:
    """UTF-8 text (an argument in another encoding reaches Python as lone surrogates, which no tokenizer encodes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ParamError(f"{name}: not UTF-8 text (byte {value[err.start].encode('utf-8', 'surrogateescape')!r} at "
                         f"character {err.start}); give UTF-8 text") from None
    return value


def text_file(path: str | Path, name: str) -> str:
    path = Path(path)
    if path.is_dir():
        raise ParamError(f"{name} {path}: a folder, not a text file; give a file")
    if not path.is_file():
        raise ParamError(f"{name} {path}: no such file")
    data = path.read_bytes()
    if b"\0" in data:
        raise ParamError(f"{name} {path}: a binary file (it holds NUL bytes), not text; give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ParamError(f"{name} {path}: not UTF-8 (byte {data[err.start:err.start + 1]!r} at offset {err.start}); "
                         f"convert it, e.g. iconv -f latin1 -t utf-8") from None


def out_folder(path: Path | None, name: str) -> None:
    """A folder a long run writes into (made if absent), refused before work where a file is in the way."""
    if path is not None and path.exists() and not path.is_dir():
        raise ParamError(f"{name} {path}: an existing file, not a folder; give a folder (it is made if absent)")
    _nothing_above(path, name, "no folder can be made under it; give a folder path outside it")


def out_file(path: Path | None, name: str) -> None:
    """A file a long run writes at its end, refused before work where a folder or a file above it is in the way."""
    if path is not None and path.is_dir():
        raise ParamError(f"{name} {path}: a folder, not a file; give a file path")
    _nothing_above(path, name, "nothing can be written under it; give a path outside it")


def _nothing_above(path: Path | None, name: str, refusal: str) -> None:
    existing = next((parent for parent in (path.parents if path is not None else ()) if parent.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ParamError(f"{name} {path}: {existing} is a file, so {refusal}")


def device(value: str, name: str) -> str:
    """A torch device name this machine has and can run a model on (never `meta`)."""
    try:
        parsed = torch.device(value)
    except (RuntimeError, TypeError):
        raise ParamError(f"{name}: {value!r} is not a torch device; give cpu, cuda or cuda:N") from None
    if parsed.type == "meta":
        raise ParamError(f"{name} meta: a meta device holds no weights to run the models on; give cpu or cuda")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ParamError(f"{name} {value}: this machine has no CUDA device (torch.cuda.is_available() is "
                             f"False); give cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ParamError(f"{name} {value}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return value
