"""The rows and kept oracles of distillation (`fitting.distill_rows`): the oracle read from the target's stored cache
is the target's own prefill, a kept oracle is each batch's own, groups beyond the budget keep none, and cache rows cut
from stored sequences hold each model's own cache."""
import pytest
import torch
from helpers.architectures import SUPPORTED, random_of
from helpers.distill import VOCAB, content_cache, oracle_of, random_rows, rows_of

from pipeline.fitting.distill_rows import CacheRows, StoredOracle, batch_bytes, oracle, oracle_bytes, with_oracles
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.handoff import Handoff
from pipeline.store.cachefiles import ShardWriter, open_shard

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/fitting/conftest.py: one torch thread, then back


@pytest.mark.parametrize("architecture", sorted(SUPPORTED))
def test_the_oracle_read_from_the_targets_stored_cache_is_its_own_prefill_and_a_wrong_cache_is_not(architecture):
    model = random_of(SUPPORTED[architecture]())
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    batch, handoff = rows_of(model, model, ids), oracle_of(model)
    read = oracle(handoff, batch)
    own = handoff.step_logprobs(handoff.prefix_layers(batch.prefix), batch.steps)  # (B, h + 1, V)
    assert torch.allclose(read.logprobs, own, atol=1e-4)
    swapped = batch.take([0, 1, 2])
    swapped.target = [(keys.flip(0), values.flip(0)) for keys, values in swapped.target]  # another row's cache
    assert (oracle(handoff, swapped).logprobs - own).abs().max() > 1e-2


def test_a_kept_oracle_is_each_batchs_own_oracle_bit_for_bit_whatever_rows_share_its_batch(random_pair):
    target, source = random_pair
    rows = random_rows(source, target, 8, 12)
    kept = StoredOracle(rows, oracle_of(target), 5)  # batches 0-4, 5-9, 10-11
    chosen = [11, 2, 7, 3]
    own = oracle(Handoff(target), rows.take(chosen))
    taken = kept.oracle(chosen)
    assert torch.equal(taken.logprobs, own.logprobs)
    assert all(torch.equal(a, b) for pair, own_pair in zip(taken.content, own.content) for a, b in zip(pair, own_pair))


def test_groups_beyond_the_oracle_budget_keep_no_oracle(random_pair):
    target, source = random_pair
    groups = [random_rows(source, target, 8, 16), random_rows(source, target, 9, 8)]
    first_row = groups[0].take([0])
    first_group = (oracle_bytes(oracle(Handoff(target), first_row)) + batch_bytes(first_row)) * len(groups[0])
    assert with_oracles(groups, oracle_of(target), 8, 0) == groups
    first_only = with_oracles(groups, oracle_of(target), 8, first_group)
    assert isinstance(first_only[0], StoredOracle) and first_only[1] is groups[1]


def open_split_shards(root):
    """The fit split's shards as ShardWriter left them (no manifest: the test writes shards alone)."""
    return [open_shard(path) for path in sorted((root / "fit").glob("*.safetensors"))]


def write_split(root, model, sequences: list[torch.Tensor]) -> list:
    """`model`'s content caches of `sequences` written as the fit split's shards, two sequences a shard (the rows
    cross a shard boundary); the shards, as ShardWriter left them (no manifest)."""
    writer = ShardWriter(root, {}, 2, torch.float32)
    writer.begin("fit", [len(ids) for ids in sequences])
    for number, ids in enumerate(sequences):
        layers = content_cache(model, ids[None])  # (1, H, T, D) per layer
        stacked = [torch.stack([pair[kind][0].transpose(0, 1) for pair in layers]) for kind in (0, 1)]
        writer.add(f"doc{number}", f"hash{number}", *stacked)  # (layers, T, H, D) each
    writer.close()
    return [open_shard(path) for path in sorted((root / "fit").glob("*.safetensors"))]


def test_cache_rows_cut_from_stored_sequences_hold_each_models_own_cache_of_each_prefix(random_pair, tmp_path):
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(0, VOCAB, (length,), generator=generator) for length in (20, 12, 25)]
    models = dict(zip(("target", "source"), random_pair))
    shards = {side: write_split(tmp_path / side, model, sequences) for side, model in models.items()}
    geometries = {side: tuple(kv_geometry(model.config)[key] for key in ("layers", "kv_heads", "head_dim"))
                  for side, model in models.items()}
    rows = CacheRows(shards, [ids.tolist() for ids in sequences], 10, 3, geometries)
    assert len(rows) == 2  # the 12-token sequence is shorter than 10 + 3
    batch = rows.take([1, 0])
    kept = torch.stack([sequences[2][:13], sequences[0][:13]])
    assert torch.equal(batch.prefix, kept[:, :9]) and torch.equal(batch.steps, kept[:, 9:])
    for side, model in models.items():
        for (keys, values), (own_keys, own_values) in zip(getattr(batch, side), content_cache(model, kept[:, :9]),
                                                          strict=True):
            assert torch.allclose(keys, own_keys, atol=1e-5) and torch.allclose(values, own_values, atol=1e-5)
    with pytest.raises(ValueError, match="hold different sequences"):
        CacheRows(shards, [ids.tolist() for ids in sequences[:2]], 10, 3, geometries)
