"""Sharded on-disk KV caches, one folder per model (e.g. `caches/source`):

    manifest.json                       model, geometry, rotary settings, storage dtype, shards per split
    <split>/shard-00000.safetensors     consecutive sequences of the split, tokens concatenated:
        keys.<layer>    (tokens, kv_heads, head_dim)  content space (RoPE stripped), storage dtype
        values.<layer>  (tokens, kv_heads, head_dim)  as cached, storage dtype
        lengths         (sequences,) int64

A row of `reshape(tokens, kv_heads * head_dim)` is one block of the linear mapper's input (a layer's KV heads,
head-major). Each shard is a checksummed artifact naming its doc_ids and content hashes, so source and target shards
can be checked to hold the same sequences. A reader verifies a shard's checksum once, then reads single layers
through safetensors' memory map, so a pass that needs two layers does not load twenty-eight.
"""
from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import safetensors

from pipeline.store.artifacts import (
    ArtifactError,
    artifact_prefix,
    byte_chunks,
    data_layout,
    verify_file,
    write_streamed,
)
from pipeline.store.lazy import lazy

torch = lazy("torch")

SHARD_FORMAT = "kv-handoff/cache-shard/v1"
MANIFEST = "manifest.json"
KINDS = ("keys", "values")
STORED_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # safetensors' dtype names -> bytes per element


@dataclass
class Shard:
    path: Path
    doc_ids: list[str]
    content_hashes: list[str]
    lengths: list[int]
    bytes_read: int = field(default=0, compare=False)  # tensor bytes `read` has taken from the file so far

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def stored_itemsize(self) -> int:
        """Bytes per element as the file stores its tensors, from the header alone."""
        with safetensors.safe_open(str(self.path), framework="pt") as f:
            return STORED_ITEMSIZE[f.get_slice(f"{KINDS[0]}.0").get_dtype()]

    def read(self, kind: str, layers: list[int], stored: bool = False) -> list[torch.Tensor]:
        """float32 (or `stored`: the file's dtype) (tokens, kv_heads * head_dim) rows of `kind` for each of `layers`."""
        with safetensors.safe_open(str(self.path), framework="pt") as f:
            blocks = [f.get_tensor(f"{kind}.{layer}") for layer in layers]  # (tokens, H, D) each
        self.bytes_read += sum(b.numel() * b.element_size() for b in blocks)
        return [(b if stored else b.to(torch.float32)).reshape(b.shape[0], -1) for b in blocks]  # (tokens, H*D) each


def open_shard(path: Path) -> Shard:
    meta, _ = verify_file(path)
    if meta.get("format") != SHARD_FORMAT:
        raise ArtifactError(f"{path}: not a cache shard (format {meta.get('format')!r}, expected {SHARD_FORMAT!r})")
    return Shard(Path(path), meta["doc_ids"], meta["content_hashes"], meta["lengths"])


def first_sequence(shard: Shard, layers: int, heads: int, head_dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The shard's first sequence as a content-space cache: per layer (keys, values), each (1, heads, T, head_dim)."""
    length = shard.lengths[0]
    out = []
    for layer in range(layers):
        keys, values = (shard.read(kind, [layer])[0][:length] for kind in KINDS)  # (T, H*D)
        out.append(tuple(t.reshape(1, length, heads, head_dim).transpose(1, 2) for t in (keys, values)))
    return out


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the extract stage for this model first (dvc repro extract)")
    return json.loads(path.read_text())


def open_split(root: Path, split: str) -> list[Shard]:
    manifest = read_manifest(root)
    if split not in manifest["splits"]:
        raise KeyError(f"{root}: no split {split!r} extracted (have {', '.join(manifest['splits'])})")
    return [open_shard(Path(root) / split / entry["file"]) for entry in manifest["splits"][split]["shards"]]


def paired_split(source_root: Path, target_root: Path, split: str) -> list[tuple[Shard, Shard]]:
    """Source and target shards of a split, checked to hold the same sequences in the same order."""
    source, target = open_split(source_root, split), open_split(target_root, split)
    if len(source) != len(target):
        raise ValueError(
            f"split {split!r}: {len(source)} source shards but {len(target)} target shards; both caches must be "
            f"extracted with the same extract.shard_sequences from the same data"
        )
    for s, t in zip(source, target):
        if (s.doc_ids, s.content_hashes, s.lengths) != (t.doc_ids, t.content_hashes, t.lengths):
            raise ValueError(f"{s.path} and {t.path} hold different sequences; re-extract both from the same data")
    return list(zip(source, target))


@dataclass
class _Image:
    """A shard being filled: the data section of its file, with the keys and the values region each viewed as
    (layers in file order, tokens, kv_heads, head_dim)."""

    path: Path
    lengths: list[int]
    specs: dict
    buffer: torch.Tensor  # uint8; reused from shard to shard
    data: torch.Tensor  # uint8, the first bytes of buffer: the file's data section
    regions: dict[str, torch.Tensor]
    positions: torch.Tensor  # position of each layer's block within its region
    doc_ids: list[str] = field(default_factory=list)
    content_hashes: list[str] = field(default_factory=list)
    filled: int = 0  # tokens placed so far


@dataclass
class ShardWriter:
    """Writes each split's sequences into shards under `root/<split>/`. `begin` declares a split's lengths, so `add`
    copies keys and values straight into their place in the shard's data section, and a background thread hashes
    and writes each full shard while the model computes the next. Memory: the shard filled, one queued, one written."""

    root: Path
    metadata: dict
    shard_sequences: int
    dtype: torch.dtype
    records: dict[str, list[dict]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self._split: str | None = None
        self._lengths: list[int] = []
        self._added = 0
        self._next_shard = 0
        self._image: _Image | None = None
        self._free: queue.SimpleQueue = queue.SimpleQueue()  # buffers of written shards, for reuse
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._writing = threading.Lock()  # held by the writer thread while it writes a shard (`abort` waits on it)
        self._thread = threading.Thread(target=self._write_loop, daemon=True)
        self._thread.start()

    def begin(self, split: str, lengths: list[int], first_shard: int = 0) -> None:
        """Start `split`, whose sequences (added next, in order) have these token counts; with `first_shard`, its
        sequences from that shard on (one process of several writes its part of a split, shards by global index)."""
        self._end_split()
        if any(length < 1 for length in lengths):
            raise ValueError(f"split {split!r}: every sequence needs at least one token")
        self._split, self._lengths, self._added, self._next_shard = split, list(lengths), 0, first_shard
        self.records.setdefault(split, [])

    def add(self, doc_id: str, content_hash: str, keys_content: torch.Tensor, values: torch.Tensor) -> None:
        """The next sequence of the split: (layers, tokens, kv_heads, head_dim) content-space keys and values."""
        if self._split is None or self._added == len(self._lengths):
            raise ValueError(f"more sequences added than declared for split {self._split!r} ({len(self._lengths)})")
        expected = self._lengths[self._added]
        if keys_content.shape != values.shape or keys_content.ndim != 4 or keys_content.shape[1] != expected:
            raise ValueError(f"sequence {doc_id!r}: keys {tuple(keys_content.shape)} and values {tuple(values.shape)}, "
                             f"expected both (layers, {expected}, kv_heads, head_dim)")
        if self._image is None:
            self._image = self._open_image(keys_content.shape)
        image = self._image
        span = slice(image.filled, image.filled + expected)
        for kind, rows in (("keys", keys_content), ("values", values)):
            image.regions[kind][:, span].index_copy_(0, image.positions, rows.to(self.dtype))
        image.doc_ids.append(doc_id)
        image.content_hashes.append(content_hash)
        image.filled += expected
        self._added += 1
        if len(image.doc_ids) == len(image.lengths):
            self._flush()

    def close(self) -> dict[str, list[dict]]:
        """Wait for every shard; return each split's shard records (file, sequences, tokens, bytes, sha256)."""
        self._end_split()
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        return self.records

    def abort(self) -> None:
        """Stop the writer after the shard it is writing, skipping any queued, so an interrupted stage leaves no
        temporary. It waits on the writer's own lock, never on the queue: an interrupt can stop the main thread inside
        `Queue.put` (a wake-up lost, or the queue's lock left held), and a wait on the queue then never ends."""
        if self._error is None:
            self._error = KeyboardInterrupt("the shard writer was aborted")
        with self._writing:  # the writer checks the error under it before each shard: none starts after this
            pass

    def _end_split(self) -> None:
        if self._added != len(self._lengths):
            raise ValueError(f"split {self._split!r}: {self._added} of {len(self._lengths)} declared sequences added")

    def _open_image(self, shape: torch.Size) -> _Image:
        layers, _, heads, dim = shape
        index = self._next_shard
        lengths = self._lengths[self._added : self._added + self.shard_sequences]
        tokens = sum(lengths)
        specs = {f"{kind}.{layer}": (self.dtype, (tokens, heads, dim)) for kind in KINDS for layer in range(layers)}
        specs["lengths"] = (torch.int64, (len(lengths),))
        ranges = data_layout(specs)
        size = max(end for _, end in ranges.values())
        buffer = None if self._free.empty() else self._free.get_nowait()  # only this thread takes from it
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=torch.uint8)
        data = buffer[:size]
        in_file = sorted(range(layers), key=str)  # files order tensors by name: keys.10 comes before keys.2
        regions = {kind: data[ranges[f"{kind}.{in_file[0]}"][0] : ranges[f"{kind}.{in_file[-1]}"][1]]
                   .view(self.dtype).view(layers, tokens, heads, dim) for kind in KINDS}
        positions = torch.tensor([in_file.index(layer) for layer in range(layers)])
        start, end = ranges["lengths"]
        data[start:end].copy_(torch.tensor(lengths, dtype=torch.int64).view(torch.uint8))
        return _Image(self.root / self._split / f"shard-{index:05d}.safetensors", lengths, specs, buffer, data, regions,
                      positions)

    def _flush(self) -> None:
        self._raise_if_failed()
        image, self._image = self._image, None
        meta = dict(self.metadata, split=self._split, format=SHARD_FORMAT, shard=self._next_shard,
                    doc_ids=image.doc_ids, content_hashes=image.content_hashes, lengths=image.lengths)
        self._next_shard += 1
        prefix = artifact_prefix(image.specs, meta)
        record = {"file": image.path.name, "sequences": len(image.lengths), "tokens": image.filled,
                  "bytes": len(prefix) + image.data.numel(), "sha256": None}
        self.records[self._split].append(record)
        self._queue.put((image, prefix, record))

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            with self._writing:
                if self._error is not None:  # failed or aborted: the shards after it are skipped
                    continue
                image, prefix, record = item
                try:
                    record["sha256"] = write_streamed(image.path, prefix, byte_chunks(image.data))
                    self._free.put(image.buffer)
                except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
                    self._error = err

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing a cache shard under {self.root} failed: {self._error}") from self._error
