"""The rows a map is distilled on, and the target's oracle of them kept once (PROTOCOL.md, "Distilled map"). A row is
one context under the last-token protocol: the prefix c[0..n-2], both models' caches of it as `extract` stored them,
and the tokens c[n-1] e[0..h-1]. A batch's oracle reads the stored target cache, prefilling nothing."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

import safetensors

from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import Layers
from pipeline.kv.mapper import map_cache
from pipeline.kv.rope import Rotation
from pipeline.store.cachefiles import KINDS, Shard
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")
F = lazy("torch.nn.functional")


@dataclass
class Batch:
    """Rows of equal prefix length; the caches are content-space, per layer (keys, values), each (B, H, P, D)."""

    prefix: torch.Tensor  # (B, P): c[0..n-2]
    source: Layers
    steps: torch.Tensor  # (B, h + 1): c[n-1] e[0..h-1]
    target: Layers

    def __len__(self) -> int:
        return self.prefix.shape[0]

    def take(self, rows: list[int]) -> "Batch":
        index = torch.tensor(rows, dtype=torch.long)
        return Batch(self.prefix[index], [(k[index], v[index]) for k, v in self.source], self.steps[index],
                     [(k[index], v[index]) for k, v in self.target])


class Rows(Protocol):

    def __len__(self) -> int: ...

    def take(self, rows: list[int]) -> Batch: ...


class CacheRows:
    """The rows of context length n cut from a split's stored sequences of at least n + horizon tokens. A causal
    model's cache of a prefix is the first positions of its cache of the whole sequence, so the caches are sliced from
    `extract`'s shards, read per batch through safetensors' memory map. `shards` and `geometries`: per side (source,
    target), its shards and (layers, kv heads, head dim)."""

    def __init__(self, shards: dict[str, Sequence[Shard]], token_ids: Sequence[Sequence[int]], length: int,
                 horizon: int, geometries: dict[str, tuple[int, int, int]]):
        self.geometries, self.length, self.horizon = geometries, length, horizon
        places = {side: [(shard.path, start, stored) for shard in side_shards
                         for start, stored in zip(itertools.accumulate([0, *shard.lengths[:-1]]), shard.lengths)]
                  for side, side_shards in shards.items()}
        if any([stored for _, _, stored in side] != [len(ids) for ids in token_ids] for side in places.values()):
            raise ValueError("the stored caches and the token ids hold different sequences: re-extract the caches "
                             "from the same data (dvc repro extract)")
        long_enough = [len(ids) >= length + horizon for ids in token_ids]
        self.tokens = [list(ids[: length + horizon]) for ids, kept in zip(token_ids, long_enough) if kept]
        self.places = {side: [(path, start) for (path, start, _), kept in zip(found, long_enough) if kept]
                       for side, found in places.items()}

    def __len__(self) -> int:
        return len(self.tokens)

    def cache(self, side: str, rows: list[int]) -> Layers:
        """One side's content cache of these rows' prefixes, float32, (B, H, P, D) per layer."""
        layers, heads, head_dim = self.geometries[side]
        prefix_length = self.length - 1
        per_kind = {kind: [[] for _ in range(layers)] for kind in KINDS}
        for row in rows:
            path, start = self.places[side][row]
            with safetensors.safe_open(str(path), framework="pt") as stored:
                for kind, blocks_of in per_kind.items():
                    for layer, blocks in enumerate(blocks_of):
                        blocks.append(stored.get_slice(f"{kind}.{layer}")[start : start + prefix_length])  # (P, H, D)
        cache = [tuple(torch.stack(blocks).to(torch.float32).transpose(1, 2) for blocks in pair)  # (B, H, P, D)
                 for pair in zip(per_kind["keys"], per_kind["values"])]
        shape = (len(rows), heads, prefix_length, head_dim)
        if cache and tuple(cache[0][0].shape) != shape:
            raise ValueError(f"{side} cache rows of shape {tuple(cache[0][0].shape)}, expected {shape} from the "
                             "manifest")
        return cache

    def take(self, rows: list[int]) -> Batch:
        tokens = torch.tensor([self.tokens[row] for row in rows], dtype=torch.long).reshape(len(rows), -1)  # (B, n+h)
        prefix_length = self.length - 1
        return Batch(tokens[:, :prefix_length], self.cache("source", rows), tokens[:, prefix_length:],
                     self.cache("target", rows))


class Splits(NamedTuple):
    """Rows in groups of one prefix length each (a batch never mixes lengths)."""

    fit: Sequence[Rows]  # trained on: each group cut into batches in a seeded order, the batches shuffled
    select: Sequence[Rows]  # scored after each epoch: its KL stops training and picks the epoch kept


class Oracle(NamedTuple):
    logprobs: torch.Tensor  # (B, h + 1, V): the target after its own prefill
    content: Layers  # the target's own content-space cache, a list over target layers of (B, H_t, P, D_t) pairs


def in_order(count: int, batch: int) -> list[list[int]]:
    """Rows 0..count-1, `batch` at a time (how the select rows are scored and the oracles kept)."""
    return [list(range(first, min(first + batch, count))) for first in range(0, count, batch)]


class StoredOracle:
    """A group's rows read once into memory, with each row's oracle computed once (in batches, in order) and kept. A
    row's oracle does not depend on the rows batched with it (checked bit for bit on the CPU), so the maps come out as
    from oracles and rows read per batch."""

    def __init__(self, rows: Rows, handoff: Handoff, batch: int):
        self.rows = rows.take(list(range(len(rows))))  # a Batch: (N, P) prefixes, (N, H, P, D) caches
        # the oracle's content is the rows' target cache, held once, laid out as the batches' oracles were concatenated
        self.rows.target = [tuple(t.to(handoff.device).contiguous() for t in pair) for pair in self.rows.target]
        self.content = self.rows.target  # per target layer (keys, values), each (N, H_t, P, D_t)
        self.logprobs = torch.cat([oracle(handoff, self.rows.take(chosen)).logprobs
                                   for chosen in in_order(len(rows), batch)])  # (N, h + 1, V)

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, rows: list[int]) -> Batch:
        return self.rows.take(rows)

    def oracle(self, rows: list[int]) -> Oracle:
        index = torch.tensor(rows, dtype=torch.long, device=self.logprobs.device)
        return Oracle(self.logprobs[index], [(keys[index], values[index]) for keys, values in self.content])


def oracle_bytes(reference: Oracle) -> int:
    """An oracle's log-probabilities and content cache. A group's size (this and its rows') counts the target cache
    twice, though a kept group holds it once: the size groups had before, so the same groups are kept."""
    return sum(t.numel() * t.element_size() for t in [reference.logprobs, *itertools.chain(*reference.content)])


def batch_bytes(batch: Batch) -> int:
    return sum(t.numel() * t.element_size()
               for t in [batch.prefix, batch.steps, *itertools.chain(*batch.source, *batch.target)])


def with_oracles(groups: Sequence[Rows], handoff: Handoff, batch: int, budget_bytes: float) -> list[Rows]:
    """Each group as a `StoredOracle` while the oracles and rows kept so far fit `budget_bytes` (a group's size: one
    row's oracle and row times its rows); the others as they are."""
    kept, out = 0, []
    for group in groups:
        first = group.take([0]) if len(group) else None
        size = (oracle_bytes(oracle(handoff, first)) + batch_bytes(first)) * len(group) if len(group) else 0
        if size and kept + size <= budget_bytes:
            kept += size
            group = StoredOracle(group, handoff, batch)
        out.append(group)
    return out


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """float32, or float64 for float64: log-softmax and the regression are not done in bfloat16."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


@no_grad
def oracle(handoff: Handoff, batch: Batch) -> Oracle:
    """The target after its own prefill, read from its stored content cache rotated to the prefix's positions."""
    rotation = Rotation(handoff.decoder_spec, torch.arange(batch.prefix.shape[1], device=handoff.device))
    content = [(keys.to(handoff.device), values.to(handoff.device)) for keys, values in batch.target]
    layers = [cached for _, cached in map_cache(None, content, rotation, handoff.decoder.dtype, handoff.device)]
    logprobs = F.log_softmax(widened(handoff.step_logits(layers, batch.steps)), dim=-1)  # (B, h + 1, V)
    return Oracle(logprobs, content)
