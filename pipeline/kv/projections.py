"""The query, key and value paths of a decoder layer's attention as each architecture defines them, and RoPE as the
model applies it, for reading a layer's attention outside its forward. Queries and keys take q_norm / k_norm where the
module has them, per head (Qwen3) or over every head at once (OLMo2), before RoPE.
Shapes: hidden states (B, T, hidden) in, per-head states (B, H, T, D) out.
"""
from __future__ import annotations

from contextlib import contextmanager

from pipeline.store.lazy import lazy

torch = lazy("torch")


def layer_input(layer, hidden: torch.Tensor) -> torch.Tensor:
    """What `layer`'s attention reads: its input norm (pre-norm) or the residual stream itself (OLMo2's post-norm)."""
    norm = getattr(layer, "input_layernorm", None)
    return hidden if norm is None else norm(hidden)


def _heads(attention, hidden: torch.Tensor, kind: str) -> torch.Tensor:
    batch, tokens = hidden.shape[:2]
    states = getattr(attention, f"{kind}_proj")(hidden)  # (B, T, H*D)
    norm = getattr(attention, f"{kind}_norm", None)
    whole = norm is not None and norm.weight.shape[-1] != attention.head_dim
    states = norm(states) if whole else states  # OLMo2: one norm over all heads, before the split
    states = states.view(batch, tokens, -1, attention.head_dim)  # (B, T, H, D)
    states = norm(states) if norm is not None and not whole else states  # Qwen3: per head
    return states.transpose(1, 2)


def queries(attention, hidden: torch.Tensor) -> torch.Tensor:
    """(B, Hq, T, D) before RoPE."""
    return _heads(attention, hidden, "q")


def keys(attention, hidden: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) before RoPE."""
    return _heads(attention, hidden, "k")


def values(attention, hidden: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D)."""
    batch, tokens = hidden.shape[:2]
    return attention.v_proj(hidden).view(batch, tokens, -1, attention.head_dim).transpose(1, 2)


def rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the model applies it: states (B, H, T, D), cos/sin (B, T, D)."""
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos[:, None] + rotated * sin[:, None]


@contextmanager
def attention_inputs(model, indices=None):
    """Yields a dict each forward inside the block fills, per decoder layer of `indices` (None: every layer), with
    (its attention module, the states (B, T, hidden) it read, its (cos, sin))."""
    layers = model.model.layers
    captured: dict[int, tuple] = {}

    def keep(index):
        def hook(module, args, kwargs, output):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            captured[index] = (module, hidden, kwargs.get("position_embeddings"))
        return hook

    hooks = [layers[index].self_attn.register_forward_hook(keep(index), with_kwargs=True)
             for index in (range(len(layers)) if indices is None else indices)]
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()
