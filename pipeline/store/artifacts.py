"""Checksummed safetensors artifacts, atomic writes, and the one reader of parquet tables (`read_table`). An
artifact's header holds its metadata (JSON) and a SHA-256 of the whole file written with the digest field zeroed, so a
flipped byte anywhere is refused at load naming the file. A write goes to a private temporary name beside its output,
takes the umask's modes (`take_umask`) and is renamed when complete: an interrupted write never shows.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import shutil
import signal
import struct
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from pipeline.store import paths
from pipeline.store.cli import Refusal
from pipeline.store.lazy import lazy

torch = lazy("torch")
safetensors_torch = lazy("safetensors.torch")
pd = lazy("pandas")
pyarrow = lazy("pyarrow")

# One header key only: safetensors does not keep the order of metadata keys, and the bytes must be
# deterministic. Its value is JSON {"meta": <the artifact's metadata>, "sha256": <digest>}.
HEADER_KEY = "kv-handoff"
_ZERO_DIGEST = "0" * 64


class ArtifactError(Refusal, RuntimeError):
    """An artifact is missing, truncated, corrupted or not what the reader expects."""


class ControlsNotPassed(Refusal, RuntimeError):
    """The controls have not run, or one failed: nothing is evaluated (the user reruns or fixes the pair)."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it to `path` only if the block completes."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = private_name(final, ".tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """An empty staging folder beside `path` that replaces it only if the block completes (a killed run's go first)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    for leftover in [*final.parent.glob(f".{final.name}.*.tmp"), *final.parent.glob(f".{final.name}.*.old")]:
        shutil.rmtree(leftover, ignore_errors=True)
    staging, retired = private_name(final, ".tmp"), private_name(final, ".old")
    try:
        os.mkdir(staging, 0o700)
        yield staging
        take_umask(staging)
        if final.exists():
            os.mkdir(retired, 0o700)
            os.replace(final, retired / final.name)
        os.replace(staging, final)
    finally:
        if (retired / final.name).exists() and not final.exists():  # interrupted between the two renames
            os.replace(retired / final.name, final)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def atomic_dirs(finals: Sequence[str | os.PathLike]) -> Iterator[list[Path]]:
    """`atomic_dir` for outputs that belong together (a model pair): none replaces its output unless the block
    completes, and the renames run under `held_signals`, so an interrupt leaves the old set or the new, never a mix."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(atomic_dir(final)) for final in finals]
        with held_signals():
            stack.close()


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the block runs, then re-raised. Python runs handlers in the main thread
    whichever thread the kernel signals, so holding them there holds them for the process; off it, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    handlers = {signum: signal.signal(signum, lambda signum, frame: came.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        if came:
            signal.raise_signal(came[0])


def private_name(final: Path, suffix: str) -> Path:
    """`.<name>.<random><suffix>` beside `final`, named before it is made (unlike mkstemp): an interrupt leaves none."""
    return final.parent / f".{final.name}.{secrets.token_hex(6)}{suffix}"


def take_umask(root: str | os.PathLike) -> None:
    """Give `root` and all under it the umask's modes for a new file or folder: writers that make files private (a
    staging folder's 0700, safetensors' `save_file`, `save_pretrained`: 0600) do not decide who may read an output."""
    mask, root = _umask(), Path(root)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        executable = path.is_dir() or path.stat().st_mode & 0o111
        os.chmod(path, (0o777 if executable else 0o666) & ~mask)


def _umask() -> int:
    """The process's umask (reading it means setting it: it is set back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def hash_file(digest, path: str | os.PathLike, bar=None) -> None:
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())


def nested(flat: Mapping[str, Any]) -> dict:
    """`group/name/key` metric keys nested, so a reader indexes them (`dvc metrics show` flattens them again)."""
    out: dict = {}
    for key, value in flat.items():
        *groups, leaf = key.split("/")
        node = out
        for group in groups:
            node = node.setdefault(group, {})
            if not isinstance(node, dict):
                raise ValueError(f"metric {key!r}: {group!r} is both a value and a group")
        if leaf in node:
            raise ValueError(f"metric {key!r}: {leaf!r} is already a group")
        node[leaf] = value
    return out


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def require_controls_passed() -> None:
    """Refuse unless every control in the controls stage's verdict ({control: passed}) passed."""
    path = paths.CONTROLS_VERDICT
    if not path.is_file():
        raise ControlsNotPassed(f"{path} not found: run the controls stage before evaluating")
    failed = [name for name, passed in json.loads(path.read_text()).items() if passed is not True]
    if failed:
        raise ControlsNotPassed(f"controls failed ({', '.join(failed)}): no variant is evaluated until they pass; "
                                f"see {path}")


def read_table(path: str | os.PathLike, columns: Sequence[str] | None = None) -> "pd.DataFrame":
    """A parquet table (`columns` of it, or all): every parquet read goes through here, so a missing, truncated or
    corrupt file is one line naming it and the stage that makes it, not pyarrow's traceback."""
    path = Path(path)
    stage = paths.maker(path)
    fix = f"dvc repro -f {stage}" if stage else "replace it with a whole file"
    if not path.is_file():
        raise ArtifactError(f"{path}: not found" + (f"; make it (dvc repro {stage})" if stage else ""))
    try:
        return pd.read_parquet(path, columns=None if columns is None else list(columns))
    except (pyarrow.ArrowException, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ArtifactError(f"{path}: not a readable parquet table ({reason}); regenerate it: {fix}") from None


def _header(raw: bytes, path: Path) -> dict:
    if len(raw) < 8:
        raise ArtifactError(f"{path}: truncated artifact ({len(raw)} bytes)")
    (length,) = struct.unpack("<Q", raw[:8])
    if 8 + length > len(raw):
        raise ArtifactError(f"{path}: corrupted artifact (header length {length} exceeds the file)")
    try:
        return json.loads(raw[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ArtifactError(f"{path}: corrupted artifact header ({err})") from None


def save_artifact(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> str:
    """Write tensors plus JSON-serializable metadata (the same bytes for the same ones); return the file's digest."""
    header_meta = {HEADER_KEY: json.dumps({"meta": metadata, "sha256": _ZERO_DIGEST}, sort_keys=True)}
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    unsigned = safetensors_torch.save(cpu, metadata=header_meta)
    header_end = 8 + struct.unpack("<Q", unsigned[:8])[0]
    if unsigned[:header_end].count(_ZERO_DIGEST.encode()) != 1:
        raise ValueError("artifact metadata must not contain a run of 64 zeros")
    digest = hashlib.sha256(unsigned).hexdigest()
    write_bytes_atomic(path, unsigned.replace(_ZERO_DIGEST.encode(), digest.encode(), 1))
    return digest


def verify_header(raw: bytes, path: Path) -> tuple[dict, str]:
    """(metadata, digest) of an artifact's length prefix and header `raw`, its checksum field checked."""
    header = _header(raw, path)
    stored = header.get("__metadata__", {}).get(HEADER_KEY) if isinstance(header, dict) else None
    try:
        content = json.loads(stored) if isinstance(stored, str) else None
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: corrupted artifact metadata ({err})") from None
    if not isinstance(content, dict) or not isinstance(content.get("sha256"), str) or "meta" not in content:
        raise ArtifactError(f"{path}: not a checksummed artifact (no {HEADER_KEY!r} entry in its header)")
    metadata, digest = content["meta"], content["sha256"]
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    if len(digest) != 64 or raw[:header_end].count(digest.encode()) != 1:
        raise ArtifactError(f"{path}: corrupted artifact (malformed checksum field)")
    return metadata, digest


def load_artifact(path: str | os.PathLike, device="cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    metadata, _ = verify_file(path)
    try:
        tensors = safetensors_torch.load(path.read_bytes())
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise ArtifactError(f"{path}: unreadable tensors ({err})") from None
    return {name: t.to(device) for name, t in tensors.items()}, metadata


# safetensors' names of the torch dtypes, by the dtype's str: keys built from torch would import it with this module
_ST_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16", "torch.int64": "I64"}
CHUNK = 1 << 24
TensorSpec = tuple["torch.dtype", Sequence[int]]  # dtype and shape of a tensor to be written


def data_layout(specs: dict[str, TensorSpec]) -> dict[str, tuple[int, int]]:
    """Byte range of each tensor in a streamed artifact's data section: tensors in sorted-name order, packed."""
    ranges, position = {}, 0
    for name in sorted(specs):
        dtype, shape = specs[name]
        if str(dtype) not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} not supported in streamed artifacts")
        size = math.prod(shape) * dtype.itemsize
        ranges[name] = (position, position + size)
        position += size
    return ranges


def artifact_prefix(specs: dict[str, TensorSpec], metadata: dict[str, Any]) -> bytes:
    """An artifact's bytes before its data (`data_layout`): the header's length, the header (digest zeroed) padded."""
    offsets = {name: {"dtype": _ST_DTYPES[str(specs[name][0])], "shape": list(specs[name][1]),
                      "data_offsets": list(span)} for name, span in data_layout(specs).items()}
    header_meta = {HEADER_KEY: json.dumps({"meta": metadata, "sha256": _ZERO_DIGEST}, sort_keys=True)}
    header = json.dumps({"__metadata__": header_meta, **offsets}, sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors aligns the data start to 8 bytes
    if header.count(_ZERO_DIGEST.encode()) != 1:
        raise ValueError("artifact metadata must not contain a run of 64 zeros")
    return struct.pack("<Q", len(header)) + header


def write_streamed(path: str | os.PathLike, prefix: bytes, chunks: Iterable[memoryview]) -> str:
    """Write `prefix` and data `chunks` atomically, hashing on the way, then the digest into its slot; return it."""
    hasher = hashlib.sha256(prefix)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as out:
            out.write(prefix)
            for chunk in chunks:
                hasher.update(chunk)
                out.write(chunk)
            digest = hasher.hexdigest()
            out.seek(prefix.index(_ZERO_DIGEST.encode()))
            out.write(digest.encode())
            out.flush()
            os.fsync(out.fileno())
    return digest


def byte_chunks(tensor: torch.Tensor) -> Iterator[memoryview]:
    """A tensor's bytes, in order, as views of its own storage (no copy beyond what contiguity needs)."""
    data = tensor.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
    for start in range(0, len(data), CHUNK):
        yield memoryview(data[start : start + CHUNK])


def stream_artifact(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> str:
    """`save_artifact`'s bytes and digest, written and hashed tensor by tensor, never the whole file in memory."""
    prefix = artifact_prefix({name: (t.dtype, t.shape) for name, t in tensors.items()}, metadata)
    return write_streamed(path, prefix, (chunk for name in sorted(tensors) for chunk in byte_chunks(tensors[name])))


def verify_file(path: str | os.PathLike) -> tuple[dict, str]:
    """An artifact's (metadata, digest), its whole file hashed in chunks (memory independent of its size)."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: artifact not found")
    with open(path, "rb") as f:
        start = f.read(8)
        length = struct.unpack("<Q", start)[0] if len(start) == 8 else 0  # else `_header` refuses it
        header = f.read(min(length, path.stat().st_size))  # a length past the file: `_header` refuses it
        metadata, digest = verify_header(start + header, path)
        hasher = hashlib.sha256(start + header.replace(digest.encode(), _ZERO_DIGEST.encode(), 1))
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    actual = hasher.hexdigest()
    if actual != digest:
        raise ArtifactError(f"{path}: checksum mismatch (stored {digest[:12]}..., content {actual[:12]}...): the file "
                            f"is corrupted or was modified after writing; regenerate it (dvc repro -f the stage that "
                            f"writes it)")
    return metadata, digest
