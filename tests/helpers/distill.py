"""The distillation tests' world: frozen tiny models, their oracle handoff and content cache, and the rows distillation
reads."""
from __future__ import annotations

import torch

from pipeline.fitting.distill_rows import Batch
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import Layers, cache_to_layers
from pipeline.kv.pair import Pair
from pipeline.kv.rope import RotarySpec, Rotation

VOCAB = 97
PREFIX, HORIZON = 12, 3  # the prefix c[0..n-2] and the teacher-forced positions after the handoff position


def oracle_of(model) -> Handoff:
    """The oracle handoff of `model` alone, as the stage builds it (`Pair`)."""
    return Pair.of(model).handoff("oracle")


def frozen(model):
    return model.requires_grad_(False).eval()


def content_cache(model, ids: torch.Tensor) -> Layers:
    """`model`'s own cache of ids (B, P) with RoPE stripped: what the extract stage stores."""
    with torch.no_grad():
        layers = cache_to_layers(model.model(input_ids=ids, use_cache=True).cache)
    rotation = Rotation(RotarySpec.from_model(model), torch.arange(ids.shape[1]))
    return [(rotation.strip(keys), values) for keys, values in layers]  # (B, H, P, D) each


def rows_of(source, target, ids: torch.Tensor) -> Batch:
    """Sequences (B, PREFIX + 1 + HORIZON) as a batch: prefix, both models' caches of it, and c[n-1] e[0..h-1]."""
    prefix = ids[:, :PREFIX]
    return Batch(prefix, content_cache(source, prefix), ids[:, PREFIX:], content_cache(target, prefix))


def random_rows(source, target, seed: int, rows: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return rows_of(source, target, torch.randint(0, VOCAB, (rows, PREFIX + 1 + HORIZON), generator=generator))
