"""Shard writer: sequences copied into each shard's file image give the same bytes as writing the shard's
concatenated tensors, in every layer order and storage dtype; it refuses sequences that do not match what
was declared."""
import json
import threading

import pytest
import torch

from pipeline.store import cachefiles
from pipeline.store.artifacts import atomic_path, load_artifact, stream_artifact
from pipeline.store.cachefiles import SHARD_FORMAT, ShardWriter, open_split


def _sequences(layers: int, lengths: list[int], seed: int = 0):
    """Per sequence (keys, values) as extract hands them over: (layers, tokens, H, D) non-contiguous views."""
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(layers, 2, length, 4, generator=generator).transpose(1, 2) for _ in range(2))
            for length in lengths]


def _write(root, layers, splits: dict[str, list[int]], shard_sequences: int, dtype: torch.dtype):
    writer = ShardWriter(root, {"model": "m"}, shard_sequences, dtype)
    sequences = {}
    for split, lengths in splits.items():
        writer.begin(split, lengths)
        sequences[split] = _sequences(layers, lengths, seed=len(sequences))
        for index, (keys, values) in enumerate(sequences[split]):
            writer.add(f"{split}-{index}", f"h{index}", keys, values)
    return writer.close(), sequences


@pytest.mark.parametrize("layers, dtype", [(3, torch.float32), (12, torch.bfloat16)])  # 12: keys.10 sorts before keys.2
def test_shard_bytes_equal_the_concatenated_tensors_written_directly(tmp_path, layers, dtype):
    lengths = [5, 3, 7, 1, 4, 6, 2]
    records, sequences = _write(tmp_path / "caches", layers, {"fit": lengths, "select": [3, 2]}, 3, dtype)
    assert [len(records[s]) for s in ("fit", "select")] == [3, 1]  # 7 = 3 + 3 + 1; the buffers are reused
    for split in ("fit", "select"):
        for number, record in enumerate(records[split]):
            chunk = list(range(3 * number, min(3 * number + 3, len(sequences[split]))))
            path = tmp_path / "caches" / split / record["file"]
            meta = load_artifact(path)[1]
            assert meta["format"] == SHARD_FORMAT and meta["doc_ids"] == [f"{split}-{i}" for i in chunk]
            tensors = {"lengths": torch.tensor(meta["lengths"], dtype=torch.int64)}
            for kind, slot in (("keys", 0), ("values", 1)):
                for layer in range(layers):
                    tensors[f"{kind}.{layer}"] = torch.cat([sequences[split][i][slot][layer] for i in chunk]).to(dtype)
            expected = tmp_path / "expected.safetensors"
            digest = stream_artifact(expected, tensors, meta)
            assert path.read_bytes() == expected.read_bytes()
            assert record["sha256"] == digest and record["bytes"] == path.stat().st_size


def test_shards_read_back_per_layer(tmp_path):
    records, sequences = _write(tmp_path / "caches", 12, {"fit": [4, 2, 3]}, 2, torch.float32)
    (tmp_path / "caches" / "manifest.json").write_text(json.dumps({"splits": {"fit": {"shards": records["fit"]}}}))
    shards = open_split(tmp_path / "caches", "fit")
    for layer in (2, 10):
        rows = torch.cat([shard.read("values", [layer])[0] for shard in shards])
        assert torch.equal(rows, torch.cat([values[layer].reshape(-1, 8) for _, values in sequences["fit"]]))


def test_sequences_that_do_not_match_the_declaration_are_refused(tmp_path):
    (keys, values), = _sequences(3, [5])
    writer = ShardWriter(tmp_path, {}, 2, torch.float32)
    writer.begin("fit", [4, 5])
    with pytest.raises(ValueError, match="expected both"):
        writer.add("a", "h", keys, values)  # 5 tokens where 4 were declared
    writer = ShardWriter(tmp_path, {}, 2, torch.float32)
    writer.begin("fit", [5])
    writer.add("a", "h", keys, values)
    with pytest.raises(ValueError, match="more sequences"):
        writer.add("b", "h", keys, values)
    writer = ShardWriter(tmp_path, {}, 2, torch.float32)
    writer.begin("fit", [5, 5])
    writer.add("a", "h", keys, values)
    with pytest.raises(ValueError, match="1 of 2 declared"):
        writer.close()


def test_an_aborted_writer_waits_for_the_shard_it_is_writing_and_skips_the_queued_ones(tmp_path, monkeypatch):
    writing, release = threading.Event(), threading.Event()

    def slow_write(path, prefix, chunks):  # the real write, held open inside its temporary until released
        with atomic_path(path) as tmp:
            tmp.write_bytes(prefix + b"".join(bytes(chunk) for chunk in chunks))
            writing.set()
            release.wait(5)
        return "0" * 64

    monkeypatch.setattr(cachefiles, "write_streamed", slow_write)
    writer = ShardWriter(tmp_path / "caches", {"model": "m"}, 1, torch.float32)
    writer.begin("fit", [2, 3, 4])
    sequences = _sequences(2, [2, 3, 4])
    writer.add("fit-0", "h0", *sequences[0])
    assert writing.wait(5)
    writer.add("fit-1", "h1", *sequences[1])  # queued behind the shard being written
    temporaries = list((tmp_path / "caches" / "fit").glob(".*.tmp"))
    assert len(temporaries) == 1  # what an exit now would leave behind: the daemon thread is cut off mid-write
    threading.Timer(0.2, release.set).start()
    writer.abort()
    assert not list((tmp_path / "caches" / "fit").glob(".*.tmp"))
    assert [path.name for path in (tmp_path / "caches" / "fit").iterdir()] == ["shard-00000.safetensors"]


def test_an_abort_returns_though_the_interrupted_main_thread_left_the_queues_lock_held(tmp_path):
    writer = ShardWriter(tmp_path / "caches", {"model": "m"}, 1, torch.float32)
    writer.begin("fit", [2])
    writer._queue.mutex.acquire()  # as a Ctrl-C inside Queue.put can leave it (bpo-29988): put and get both wait
    try:
        aborting = threading.Thread(target=writer.abort, daemon=True)
        aborting.start()
        aborting.join(5)
        assert not aborting.is_alive(), "abort waited on the queue"
    finally:
        writer._queue.mutex.release()
