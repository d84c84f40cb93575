"""A model's KV geometry read off its config (decoder layers, KV heads, head_dim): what every cache shape, map shape
and multiply-add count of the handoff is in. Configs only, so it loads no tensor library."""
from __future__ import annotations


def kv_geometry(config) -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads, "head_dim": head_dim}
