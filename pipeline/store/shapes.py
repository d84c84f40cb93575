"""Real model shapes without the hub: stored public configs (`configs/<name>.json`) and random models of those shapes,
enough where the outcome does not depend on the weights (timing, memory: the `*-shapes` profiles, the latency study).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator

from pipeline.store.devices import no_grad, parse_dtype
from pipeline.store.lazy import lazy

torch = lazy("torch")
transformers = lazy("transformers")
initialization = lazy("transformers.initialization")

CONFIGS = Path(__file__).resolve().parent / "configs"
# source, target shape names: the pairs a profile can name
PAIRS = {
    "qwen3-v0": ("qwen3-0.6b", "qwen3-1.7b"),
    "qwen3-1.7b-4b": ("qwen3-1.7b", "qwen3-4b"),
    "qwen3-4b-8b": ("qwen3-4b", "qwen3-8b"),
    "llama-3.2-1b-3b": ("llama-3.2-1b", "llama-3.2-3b"),
    # the smol profile's pair: SmolLM2-135M(-Instruct) and its own first 9 of 30 layers as the source (self:9)
    "smol-self9": ("smollm2-135m-first9", "smollm2-135m"),
    "qwen25-coder": ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"),
}


LOADED = "loaded"  # a bound pair: the loaded pair's own configs, whatever its models are


def _known_pair(name: str) -> str:
    if name != LOADED and name not in PAIRS:
        raise ValueError(f"unknown pair {name!r} (known: {LOADED}, {', '.join(PAIRS)})")
    return name


# a params key naming one of PAIRS or `loaded` (`<section>.bound_pair: unknown pair ...` otherwise)
BoundPair = Annotated[str, AfterValidator(_known_pair)]
POOL_SIZE = 1_000_003  # a prime


def shape_names() -> list[str]:
    return sorted(path.stem for path in CONFIGS.glob("*.json"))


def shape_config(name: str) -> transformers.PreTrainedConfig:
    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model shape {name!r} (known: {', '.join(shape_names())}; files in {CONFIGS})")
    fields = json.loads(path.read_text())
    if "model_type" not in fields:
        raise ValueError(f"{path} has no model_type: it must be a model's config.json as published")
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._name_or_path = f"shapes/{name}"
    return config


def pair_configs(pair: str) -> tuple[transformers.PreTrainedConfig, transformers.PreTrainedConfig]:
    source, target = PAIRS[pair]  # a name params (BoundPair) or latency's --config-shapes (choices) checked
    return shape_config(source), shape_config(target)


def bound_configs(name: str, loaded: tuple) -> tuple:
    """(source, target) configs the FLOP bounds are counted at: the running pair's for `loaded`, else stored shapes."""
    return loaded if name == LOADED else pair_configs(name)


@no_grad
def random_model(config: transformers.PreTrainedConfig, dtype="float32", device="cpu",
                 seed: int = 0) -> transformers.PreTrainedModel:
    """A causal LM of `config` with random weights, built on `device` in `dtype`. Instead of a draw per weight
    (a minute for Qwen3-1.7B on a small CPU), every matrix tiles one pool of normal draws at the initializer std, of
    prime length so no row copies another; norms ones, biases zeros. Rotary buffers stay exact (float32)."""
    dtype = parse_dtype(dtype)
    generator = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL_SIZE, generator=generator) * config.initializer_range).to(device, dtype)  # (P,)
    with initialization.no_init_weights(), torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    for name, param in model.named_parameters():  # tied embeddings appear once
        param.requires_grad_(False)
        if param.dim() == 1:
            param.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        flat = param.view(-1)
        whole = flat.numel() // POOL_SIZE * POOL_SIZE
        flat[:whole].view(-1, POOL_SIZE).copy_(pool)  # (numel // P, P), pool broadcast over rows
        flat[whole:].copy_(pool[: flat.numel() - whole])
    return model.eval()
