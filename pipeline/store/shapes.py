"""Real model shapes without the hub: stored Qwen3 configs and random models of those shapes.

`configs/qwen3-0.6b.json` and `configs/qwen3-1.7b.json` are the public config.json files of Qwen3-0.6B and
Qwen3-1.7B. A model built from one has the exact architecture, parameter count and KV geometry of the real
model, with random weights: enough for anything whose outcome does not depend on the weights (timing,
memory, shapes: the `qwen3-shapes` smoke profile and the latency study), meaningless for anything else.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.initialization import no_init_weights

from pipeline.store.devices import parse_dtype

CONFIGS = Path(__file__).resolve().parent / "configs"
# source, target: the pairs a profile can name
PAIRS = {"qwen3-v0": ("qwen3-0.6b", "qwen3-1.7b")}
POOL_SIZE = 1_000_003  # a prime


def shape_names() -> list[str]:
    return sorted(path.stem for path in CONFIGS.glob("*.json"))


def shape_config(name: str) -> Qwen3Config:
    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model shape {name!r} (known: {', '.join(shape_names())}; files in {CONFIGS})")
    config = Qwen3Config(**json.loads(path.read_text()))
    config._name_or_path = f"shapes/{name}"
    return config


def pair_configs(pair: str) -> tuple[Qwen3Config, Qwen3Config]:
    """(source, target) configs of a named pair."""
    if pair not in PAIRS:
        raise ValueError(f"unknown model pair {pair!r} (known: {', '.join(PAIRS)})")
    source, target = PAIRS[pair]
    return shape_config(source), shape_config(target)


@torch.no_grad()
def random_model(config: Qwen3Config, dtype="float32", device="cpu", seed: int = 0) -> Qwen3ForCausalLM:
    """A model of `config` with random weights, built directly on `device` in `dtype`.

    Skips transformers' per-module initialization (a random draw per weight: about a minute for the 2B
    parameters of Qwen3-1.7B on a small CPU) and tiles every matrix with one shared pool of normal draws of
    the model's initializer std; norm weights are ones. The pool's length is prime, so no matrix row is an
    exact copy of another. The rotary buffers are computed in the modules' constructors, so they are exact.
    """
    dtype = parse_dtype(dtype)
    generator = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL_SIZE, generator=generator) * config.initializer_range).to(device, dtype)  # (P,)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.tie_weights()
    for param in model.parameters():  # tied embeddings appear once
        param.requires_grad_(False)
        if param.dim() == 1:
            param.fill_(1.0)
            continue
        flat = param.view(-1)
        whole = flat.numel() // POOL_SIZE * POOL_SIZE
        flat[:whole].view(-1, POOL_SIZE).copy_(pool)  # (numel // P, P), pool broadcast over rows
        flat[whole:].copy_(pool[: flat.numel() - whole])
    return model.eval()
