"""Rotary position encoding of cached keys: read the settings from a config, strip and apply.

Cached keys in transformers' Qwen3 are stored after k_norm and after RoPE. `strip` rotates them back to
content space (position-free); `apply` rotates content-space keys forward to given positions. The math
is done in float32 and cast back, so strip-then-apply is the identity to ~1e-6 whatever the cache dtype.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pipeline.store.cli import Refusal

SUPPORTED_ROPE_TYPES = ("default",)


class UnsupportedRopeError(Refusal, ValueError):
    pass


@dataclass(frozen=True)
class RotarySpec:
    """What a model's rotary embedding needs: base, rotated width and the position range it was built for."""

    rope_type: str
    theta: float
    head_dim: int
    max_positions: int

    @classmethod
    def from_config(cls, config) -> "RotarySpec":
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedRopeError(
                f"rope_type {rope_type!r} of model {getattr(config, '_name_or_path', '?')!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); stripping it would silently corrupt the cache"
            )
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise UnsupportedRopeError(f"no rope_theta in the config of {getattr(config, '_name_or_path', '?')!r}")
        if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedRopeError("partial rotary embeddings are not supported")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(rope_type, float(theta), int(head_dim), int(config.max_position_embeddings))

    def to_dict(self) -> dict:
        return asdict(self)

    def inv_freq(self, device) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponents)  # (head_dim/2,)


class Rotation:
    """The rotation of one set of positions (T,) under one spec: angles computed once, used for every layer.

    Same values as transformers' default rotary embedding, which duplicates the angles over both halves of
    the head dim and rotates with rotate_half; written on the halves, so no full-width copies:

        first, second = keys[..., :D/2], keys[..., D/2:]
        rotated = [first * cos - second * sin,  second * cos + first * sin]
    """

    def __init__(self, spec: RotarySpec, positions: torch.Tensor):
        self.spec, self.tokens = spec, positions.shape[0]
        angles = positions.to(torch.float32)[:, None] * spec.inv_freq(positions.device)  # (T, head_dim/2)
        self.cos, self.sin = angles.cos(), angles.sin()

    def first(self, tokens: int) -> "Rotation":
        """The rotation of the first `tokens` positions: one rotation built for the longest sequence serves all."""
        if tokens > self.tokens:
            raise ValueError(f"{tokens} tokens but this rotation covers {self.tokens} positions")
        prefix = object.__new__(Rotation)
        prefix.spec, prefix.tokens, prefix.cos, prefix.sin = self.spec, tokens, self.cos[:tokens], self.sin[:tokens]
        return prefix

    def apply(self, keys_content: torch.Tensor) -> torch.Tensor:
        """Rotate content-space keys (..., T, head_dim) forward to the positions."""
        return self._rotate(keys_content, self.sin)

    def strip(self, keys_rotated: torch.Tensor) -> torch.Tensor:
        """Rotate cached keys (..., T, head_dim) back by the positions: the inverse rotation."""
        return self._rotate(keys_rotated, -self.sin)

    def _rotate(self, keys: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if keys.shape[-1] != self.spec.head_dim:
            raise ValueError(f"keys have head_dim {keys.shape[-1]}, rotary settings say {self.spec.head_dim}")
        if keys.shape[-2] != self.tokens:
            raise ValueError(f"{keys.shape[-2]} cached tokens but {self.tokens} positions")
        cos, sin = self.cos.to(keys.device), sin.to(keys.device)  # (T, head_dim/2), broadcast over (..., T, head_dim/2)
        first, second = keys.to(torch.float32).chunk(2, dim=-1)  # (..., T, head_dim/2) each
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(keys.dtype)


def apply_rope(keys_content: torch.Tensor, positions: torch.Tensor, spec: RotarySpec) -> torch.Tensor:
    """Rotate content-space keys (..., T, head_dim) forward to `positions` (T,)."""
    return Rotation(spec, positions).apply(keys_content)


def strip_rope(keys_rotated: torch.Tensor, positions: torch.Tensor, spec: RotarySpec) -> torch.Tensor:
    """Rotate cached keys (..., T, head_dim) back by their `positions` (T,): the inverse rotation."""
    return Rotation(spec, positions).strip(keys_rotated)
