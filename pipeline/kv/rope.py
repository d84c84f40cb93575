"""Rotary position encoding of cached keys: read the settings from a config, check them against the model, strip to
content space (position-free) and apply. Frequencies come in float32 from transformers' own initialisers and are checked
against the model's buffer (an `inv_freq` cast to bfloat16 rotates with rounded angles: refused). The maths runs in
float32 (float64 keys in float64), so strip-then-apply is the identity to ~1e-6 whatever the cache dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.store import paths
from pipeline.store.cli import Refusal
from pipeline.store.lazy import lazy

torch = lazy("torch")
modeling_rope_utils = lazy("transformers.modeling_rope_utils")

# rope types whose frequencies are fixed at load time; `dynamic` and `longrope` change them with the length
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


class UnsupportedRopeError(Refusal, ValueError):
    pass


def model_name(config) -> str:
    """The config's model as messages name it: its hub id or folder, else its model type."""
    return paths.shown(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "?"))


def rope_parameters(config) -> dict:
    """The config's RoPE settings as one flat dict (transformers 5 keeps them in `rope_parameters`)."""
    return dict(getattr(config, "rope_parameters", None) or {})


def rope_refusal(config) -> str | None:
    """Why the keys of this config's model cannot be stripped and re-applied exactly; None when they can."""
    params = rope_parameters(config)
    if params and all(isinstance(value, dict) for value in params.values()):
        return f"has per-layer-type RoPE parameters ({', '.join(params)}); one rotation per model is needed"
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    if float(partial) != 1.0:
        return (f"rotates only part of each head (partial_rotary_factor {partial}); stripping it as full RoPE would "
                f"corrupt the unrotated dimensions")
    if rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
        return (f"uses length-dependent RoPE ({rope_type!r}): its frequencies change with the sequence length, so a "
                f"cache stripped at one length is re-encoded at another")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"uses rope_type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    if params.get("rope_theta", getattr(config, "rope_theta", None)) is None:
        return "has no rope_theta"
    return None


@dataclass(frozen=True)
class RotarySpec:
    rope_type: str
    theta: float
    head_dim: int
    max_positions: int
    scaling: tuple[tuple[str, float], ...]  # sorted rope_parameters beyond type and theta; () for `default`
    attention_scaling: float  # cos and sin are multiplied by it (YaRN's mscale); 1.0 otherwise
    frequencies: tuple[float, ...]  # inv_freq, float32 values, (head_dim/2,)

    @classmethod
    def default(cls, theta: float, head_dim: int, max_positions: int) -> "RotarySpec":
        """Plain RoPE: inv_freq[i] = theta ** (-2i / head_dim), computed as transformers does, in float32."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (float(theta) ** exponents)  # (head_dim/2,)
        return cls("default", float(theta), int(head_dim), int(max_positions), (), 1.0, tuple(inv_freq.tolist()))

    @classmethod
    def from_config(cls, config) -> "RotarySpec":
        refusal = rope_refusal(config)
        if refusal:
            raise UnsupportedRopeError(f"model {model_name(config)!r} {refusal}")
        params = rope_parameters(config)
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 0.0)))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if rope_type == "default":
            return cls.default(theta, head_dim, config.max_position_embeddings)
        inv_freq, attention_scaling = modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        scaling = tuple(sorted((key, float(value)) for key, value in params.items()
                               if key not in ("rope_type", "type", "rope_theta") and value is not None
                               and isinstance(value, (int, float))))
        return cls(rope_type, theta, int(head_dim), int(config.max_position_embeddings), scaling,
                   float(attention_scaling), tuple(inv_freq.to(torch.float32).tolist()))

    @classmethod
    def from_model(cls, model) -> "RotarySpec":
        """The spec of `model`'s config, verified against the rotary embedding the model really runs."""
        spec = cls.from_config(model.config)
        rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
        name = model_name(model.config)
        if rotary is None or not hasattr(rotary, "inv_freq"):
            raise UnsupportedRopeError(f"model {name!r} has no rotary embedding module (model.rotary_emb.inv_freq)")
        if rotary.inv_freq.dtype != torch.float32:
            raise UnsupportedRopeError(
                f"model {name!r} rotates with a {str(rotary.inv_freq.dtype).replace('torch.', '')} inv_freq (cast "
                f"with .to(dtype) after loading), so its cached keys carry rounded angles; load it with "
                f"from_pretrained(dtype=...) instead, which keeps the rotary buffers in float32")
        measured = rotary.inv_freq.detach().cpu()
        expected = spec.inv_freq("cpu")
        if measured.shape != expected.shape or not torch.allclose(measured, expected, rtol=1e-6, atol=0.0):
            raise UnsupportedRopeError(
                f"model {name!r}: its rotary embedding's inv_freq {tuple(measured.shape)} differs from the one its "
                f"config defines {tuple(expected.shape)}; the cache could not be re-encoded exactly")
        if float(getattr(rotary, "attention_scaling", 1.0)) != spec.attention_scaling:
            raise UnsupportedRopeError(
                f"model {name!r}: attention scaling {rotary.attention_scaling} of its rotary embedding differs from "
                f"its config's {spec.attention_scaling}")
        return spec

    def to_dict(self) -> dict:
        """The settings recorded in metadata (plain RoPE keeps V0's four keys)."""
        recorded = {"rope_type": self.rope_type, "theta": self.theta, "head_dim": self.head_dim,
                    "max_positions": self.max_positions}
        if self.rope_type != "default":
            recorded.update(scaling=dict(self.scaling), attention_scaling=self.attention_scaling)
        return recorded

    def inv_freq(self, device) -> torch.Tensor:
        return torch.tensor(self.frequencies, dtype=torch.float32, device=device)  # (head_dim/2,)


class Rotation:
    """The rotation of positions (T,) under one spec, angles computed once. transformers' rotate_half on the halves:

        first, second = keys[..., :D/2], keys[..., D/2:]
        rotated = [first * cos - second * sin,  second * cos + first * sin]

    A scaled type's attention factor multiplies cos and sin: `apply` scales by it, `strip` divides it out.
    """

    def __init__(self, spec: RotarySpec, positions: torch.Tensor):
        self.spec, self.tokens = spec, positions.shape[0]
        angles = positions.to(torch.float32)[:, None] * spec.inv_freq(positions.device)  # (T, head_dim/2)
        self.cos, self.sin = angles.cos(), angles.sin()

    def first(self, tokens: int) -> "Rotation":
        if tokens > self.tokens:
            raise ValueError(f"{tokens} tokens but this rotation covers {self.tokens} positions")
        prefix = object.__new__(Rotation)
        prefix.spec, prefix.tokens, prefix.cos, prefix.sin = self.spec, tokens, self.cos[:tokens], self.sin[:tokens]
        return prefix

    def apply(self, keys_content: torch.Tensor) -> torch.Tensor:
        """Rotate content-space keys (..., T, head_dim) forward to the positions."""
        return self._rotate(keys_content, self.sin, self.spec.attention_scaling)

    def strip(self, keys_rotated: torch.Tensor) -> torch.Tensor:
        """Rotate cached keys (..., T, head_dim) back by the positions: the inverse rotation."""
        return self._rotate(keys_rotated, -self.sin, 1.0 / self.spec.attention_scaling)

    def _rotate(self, keys: torch.Tensor, sin: torch.Tensor, scale: float) -> torch.Tensor:
        if keys.shape[-1] != self.spec.head_dim:
            raise ValueError(f"keys have head_dim {keys.shape[-1]}, rotary settings say {self.spec.head_dim}")
        if keys.shape[-2] != self.tokens:
            raise ValueError(f"{keys.shape[-2]} cached tokens but {self.tokens} positions")
        cos, sin = self.cos.to(keys.device), sin.to(keys.device)  # (T, head_dim/2), broadcast over (..., T, head_dim/2)
        work = torch.promote_types(keys.dtype, torch.float32)  # float32, or float64 for float64 keys
        first, second = keys.to(work).chunk(2, dim=-1)  # (..., T, head_dim/2) each
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return (rotated if scale == 1.0 else rotated * scale).to(keys.dtype)
