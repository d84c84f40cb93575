"""Sharded on-disk KV caches: what `extract` writes and `fit` reads.

Layout under a model's cache folder (e.g. `caches/source`):

    manifest.json                       model, geometry, rotary settings, storage dtype, shards per split
    <split>/shard-00000.safetensors     consecutive sequences of the split, tokens concatenated:
        keys.<layer>    (tokens, kv_heads, head_dim)  content space (RoPE stripped), storage dtype
        values.<layer>  (tokens, kv_heads, head_dim)  as cached, storage dtype
        lengths         (sequences,) int64

(tokens, kv_heads, head_dim) makes a row of `reshape(tokens, kv_heads * head_dim)` exactly one block of the
linear mapper's input (all KV heads of a layer, head-major). Each shard is a checksummed artifact whose
metadata names its doc_ids and content hashes, so source and target shards can be checked to hold the same
sequences. A reader verifies a shard's whole checksum once, then reads single layers through safetensors'
memory map, so a pass that needs two layers does not load twenty-eight.
"""
from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.artifacts import ArtifactError, stream_artifact, verify_file

SHARD_FORMAT = "kv-handoff/cache-shard/v1"
MANIFEST = "manifest.json"
KINDS = ("keys", "values")


@dataclass
class Shard:
    path: Path
    doc_ids: list[str]
    content_hashes: list[str]
    lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def read(self, kind: str, layers: list[int]) -> list[torch.Tensor]:
        """float32 (tokens, kv_heads * head_dim) rows of `kind` for each of `layers`, in that order."""
        with safe_open(str(self.path), framework="pt") as f:
            blocks = [f.get_tensor(f"{kind}.{layer}") for layer in layers]  # (tokens, H, D) each
        return [b.to(torch.float32).reshape(b.shape[0], -1) for b in blocks]  # (tokens, H*D) each


def open_shard(path: Path) -> Shard:
    """Verify a shard's checksum (refusing a flipped byte anywhere) and read its metadata."""
    meta, _ = verify_file(path)
    if meta.get("format") != SHARD_FORMAT:
        raise ArtifactError(f"{path}: not a cache shard (format {meta.get('format')!r}, expected {SHARD_FORMAT!r})")
    return Shard(Path(path), meta["doc_ids"], meta["content_hashes"], meta["lengths"])


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
class ShardWriter:
    """Collects sequences into shards and writes each full shard on a background thread.

    The model computes the next shard while the previous one is hashed and written (both release the GIL).
    Memory: the shard being filled, at most one waiting in the queue and the one being written.
    """

    folder: Path
    metadata: dict
    shard_sequences: int
    dtype: torch.dtype
    records: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self._pending: list[tuple[str, str, list[torch.Tensor], list[torch.Tensor]]] = []
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_loop, daemon=True)
        self._thread.start()

    def add(self, doc_id: str, content_hash: str, keys_content: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """One sequence: per layer (tokens, kv_heads, head_dim) content-space keys and values."""
        self._pending.append((doc_id, content_hash, [k.to(self.dtype) for k in keys_content],
                              [v.to(self.dtype) for v in values]))
        if len(self._pending) == self.shard_sequences:
            self._flush()

    def close(self) -> list[dict]:
        if self._pending:
            self._flush()
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        return self.records

    def _flush(self) -> None:
        self._raise_if_failed()
        lengths = [seq[2][0].shape[0] for seq in self._pending]
        meta = dict(self.metadata, format=SHARD_FORMAT, shard=len(self.records),
                    doc_ids=[seq[0] for seq in self._pending], content_hashes=[seq[1] for seq in self._pending],
                    lengths=lengths)
        name = f"shard-{len(self.records):05d}.safetensors"
        self.records.append({"file": name, "sequences": len(self._pending), "tokens": sum(lengths),
                             "bytes": None, "sha256": None})
        self._queue.put((self.folder / name, self._pending, meta, self.records[-1]))
        self._pending = []

    @staticmethod
    def _shard_tensors(sequences: list, lengths: list[int]) -> dict[str, torch.Tensor]:
        """The shard's tensors: per layer, the sequences' rows concatenated (on the writer thread)."""
        tensors = {"lengths": torch.tensor(lengths, dtype=torch.int64)}
        for kind, slot in (("keys", 2), ("values", 3)):
            for layer in range(len(sequences[0][slot])):
                tensors[f"{kind}.{layer}"] = torch.cat([seq[slot][layer] for seq in sequences])  # (tokens, H, D)
        return tensors

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue
            path, sequences, meta, record = item
            try:
                record["sha256"] = stream_artifact(path, self._shard_tensors(sequences, meta["lengths"]), meta)
                record["bytes"] = path.stat().st_size
            except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
                self._error = err

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing a cache shard under {self.folder} failed: {self._error}") from self._error
