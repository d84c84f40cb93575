"""The rows and kept oracles of distillation (`fitting.distill_rows`): a kept oracle is each batch's own,
groups beyond the budget keep none, and cache rows cut from stored sequences hold the source's own cache."""
import pytest
import torch
from helpers.distill import VOCAB, content_cache, oracle_of, random_rows

from pipeline.fitting.distill_rows import CacheRows, StoredOracle, batch_bytes, oracle, oracle_bytes, with_oracles
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.handoff import Handoff
from pipeline.store.cachefiles import ShardWriter, open_shard

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/fitting/conftest.py: one torch thread, then back


def test_a_kept_oracle_is_each_batchs_own_oracle_bit_for_bit_whatever_rows_share_its_batch(random_pair):
    target, source = random_pair
    rows = random_rows(source, 8, 12)
    kept = StoredOracle(rows, oracle_of(target), 5)  # batches 0-4, 5-9, 10-11
    chosen = [11, 2, 7, 3]
    own = oracle(Handoff(target), rows.take(chosen))
    taken = kept.oracle(chosen)
    assert torch.equal(taken.logprobs, own.logprobs)
    assert all(torch.equal(a, b) for pair, own_pair in zip(taken.content, own.content) for a, b in zip(pair, own_pair))


def test_groups_beyond_the_oracle_budget_keep_no_oracle(random_pair):
    target, source = random_pair
    groups = [random_rows(source, 8, 16), random_rows(source, 9, 8)]
    first_row = groups[0].take([0])
    first_group = (oracle_bytes(oracle(Handoff(target), first_row)) + batch_bytes(first_row)) * len(groups[0])
    assert with_oracles(groups, oracle_of(target), 8, 0) == groups
    first_only = with_oracles(groups, oracle_of(target), 8, first_group)
    assert isinstance(first_only[0], StoredOracle) and first_only[1] is groups[1]


def open_split_shards(root):
    """The fit split's shards as ShardWriter left them (no manifest: the test writes shards alone)."""
    return [open_shard(path) for path in sorted((root / "fit").glob("*.safetensors"))]


def test_cache_rows_cut_from_stored_sequences_hold_the_sources_own_cache_of_each_prefix(random_pair, tmp_path):
    _, source = random_pair
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(0, VOCAB, (length,), generator=generator) for length in (20, 12, 25)]
    writer = ShardWriter(tmp_path, {}, 2, torch.float32)  # two shards: the rows cross a shard boundary
    writer.begin("fit", [len(ids) for ids in sequences])
    for number, ids in enumerate(sequences):
        layers = content_cache(source, ids[None])  # (1, H, T, D) per layer
        stacked = [torch.stack([pair[kind][0].transpose(0, 1) for pair in layers]) for kind in (0, 1)]
        writer.add(f"doc{number}", f"hash{number}", *stacked)  # (layers, T, H, D) each
    writer.close()
    geometry = kv_geometry(source.config)
    rows = CacheRows(open_split_shards(tmp_path), [ids.tolist() for ids in sequences], 10, 3,
                     (geometry["layers"], geometry["kv_heads"], geometry["head_dim"]))
    assert len(rows) == 2  # the 12-token sequence is shorter than 10 + 3
    batch = rows.take([1, 0])
    kept = torch.stack([sequences[2][:13], sequences[0][:13]])
    assert torch.equal(batch.prefix, kept[:, :9]) and torch.equal(batch.steps, kept[:, 9:])
    for (keys, values), (own_keys, own_values) in zip(batch.source, content_cache(source, kept[:, :9]), strict=True):
        assert torch.allclose(keys, own_keys, atol=1e-5) and torch.allclose(values, own_values, atol=1e-5)
    with pytest.raises(ValueError, match="hold different sequences"):
        CacheRows(open_split_shards(tmp_path), [ids.tolist() for ids in sequences[:2]], 10, 3, (1, 1, 1))
