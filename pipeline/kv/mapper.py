"""Maps from the source model's content-space KV cache to the target's, and their file format.

A mapper takes the source cache with RoPE stripped (a list over source layers of (keys, values), each
(batch, kv_heads_s, tokens, head_dim_s)) and returns the target's content-space cache (a list over target
layers, each (batch, kv_heads_t, tokens, head_dim_t)). Families:

- `identity`: the source cache as it is (defined only when the KV geometry matches);
- `linear`: per target layer l, keys and values each predicted from the k chosen source layers, all source
  KV heads concatenated: input width k * kv_heads_s * head_dim_s, one (input -> head_dim_t) map per target
  head, with bias. k=1 is V0's per-head linear map.
- `head_matched`: like `linear`, but target head h reads only source head h of the chosen layers
  (input width k * head_dim_s); needs equal KV head counts.
- `mlp`: like `linear`, but through one hidden layer shared by the target heads of a layer:
  hidden = gelu(x @ in_weight + in_bias), then the per-head output projection of `linear` from the hidden
  width. Per target layer and kind: (in_weight (in_width, hidden), in_bias (hidden,), weight
  (kv_heads_t, hidden, head_dim_t), bias (kv_heads_t, head_dim_t)).

File: a checksummed artifact (see `artifacts`) with tensors `{keys,values}.{layer}.{name}` (names in
TENSOR_NAMES) and metadata naming the source and target, k, lambda, the chosen source layers per target layer and both
models' rotary settings and KV geometry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.kv.kvcache import Layers, kv_geometry
from pipeline.kv.rope import RotarySpec
from pipeline.store.artifacts import ArtifactError, load_artifact, stream_artifact
from pipeline.store.lazy import lazy

torch = lazy("torch")

FORMAT = "kv-handoff/mapper/v1"
FAMILIES = ("identity", "linear", "head_matched", "mlp")
TENSOR_NAMES = {"identity": (), "linear": ("weight", "bias"), "head_matched": ("weight", "bias"),
                "mlp": ("in_weight", "in_bias", "weight", "bias")}


@dataclass
class Mapper:
    family: str
    source: str
    target: str
    source_geometry: dict
    target_geometry: dict
    rotary_source: dict
    rotary_target: dict
    k: int = 0
    ridge_lambda: float = 0.0
    source_layers: list[list[int]] = field(default_factory=list)  # per target layer: the k source layers
    # per target layer: the family's tensors in TENSOR_NAMES order; for linear and head_matched
    # (weight (kv_heads_t, in_width, head_dim_t), bias (kv_heads_t, head_dim_t))
    keys: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    values: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown mapper family {self.family!r} (known: {', '.join(FAMILIES)})")
        if self.family == "identity" and self.source_geometry != self.target_geometry:
            raise ValueError(
                f"identity map needs equal KV geometry: {self.source} {self.source_geometry} vs "
                f"{self.target} {self.target_geometry}"
            )
        if self.family == "head_matched" and self.source_geometry["kv_heads"] != self.target_geometry["kv_heads"]:
            raise ValueError("head-matched map needs equal KV head counts")

    def metadata(self) -> dict:
        return {
            "format": FORMAT,
            "family": self.family,
            "source": self.source,
            "target": self.target,
            "source_geometry": self.source_geometry,
            "target_geometry": self.target_geometry,
            "rotary_source": self.rotary_source,
            "rotary_target": self.rotary_target,
            "k": self.k,
            "lambda": self.ridge_lambda,
            "source_layers": self.source_layers,
            "extra": self.extra,
        }

    def parameter_count(self) -> int:
        return sum(t.numel() for tensors in self.keys + self.values for t in tensors)

    def macs_per_token(self) -> int:
        """Multiply-adds to map one token's cache: one per weight entry (biases are adds)."""
        names = TENSOR_NAMES[self.family]
        return sum(t.numel() for tensors in self.keys + self.values
                   for name, t in zip(names, tensors) if not name.endswith("bias"))

    def apply(self, source_layers: Layers, positions: torch.Tensor) -> Layers:
        """Content-space source cache -> content-space target cache. `positions` (T,) are the tokens'
        positions; the maps here are position-free, richer families may use them."""
        layers = range(self.target_layers(source_layers))
        return [self.apply_layer(source_layers, layer, positions) for layer in layers]

    def target_layers(self, source_layers: Layers) -> int:
        return len(source_layers) if self.family == "identity" else len(self.source_layers)

    def apply_layer(self, source_layers: Layers, layer: int,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target layer `layer` of `apply`: one at a time, so a caller can finish each layer before the next."""
        del positions
        if self.family == "identity":
            return source_layers[layer]
        chosen = self.source_layers[layer]
        key_in = self._inputs([source_layers[s][0] for s in chosen])
        value_in = self._inputs([source_layers[s][1] for s in chosen])
        return self._project(key_in, *self.keys[layer]), self._project(value_in, *self.values[layer])

    def _inputs(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.family == "head_matched":
            return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-1)  # (B, H, T, k*D_s): own head only
        batch, heads, tokens, dim = tensors[0].shape
        flat = [t.transpose(1, 2).reshape(batch, tokens, heads * dim) for t in tensors]  # (B, T, H_s*D_s) each
        return flat[0] if len(flat) == 1 else torch.cat(flat, dim=-1)  # (B, T, k*H_s*D_s); k=1 skips a copy

    def _project(self, inputs: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        return project(self.family, inputs, *tensors)

    def to(self, device=None, dtype=None) -> "Mapper":
        move = lambda layers: [tuple(t.to(device=device, dtype=dtype) for t in ts) for ts in layers]  # noqa: E731
        self.keys, self.values = move(self.keys), move(self.values)
        return self


def mlp_hidden(inputs: torch.Tensor, in_weight: torch.Tensor, in_bias: torch.Tensor) -> torch.Tensor:
    """The mlp family's hidden layer, (..., F) -> (..., hidden): the same op when fitting and when mapping."""
    return torch.nn.functional.gelu(inputs @ in_weight + in_bias)


def project(family: str, inputs: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """One target layer's keys or values from its inputs: (B, T, F) -> (B, H_t, T, D_t); for head_matched
    the inputs are per head, (B, H, T, k*D_s). `tensors` are the family's, in TENSOR_NAMES order."""
    weight, bias = tensors[-2:]
    inputs = inputs.to(weight.dtype)
    if family == "mlp":
        inputs = mlp_hidden(inputs, *tensors[:2])  # (B, T, hidden)
    if family == "head_matched":
        out = torch.einsum("bhtf,hfd->bhtd", inputs, weight)  # one batched matmul for all heads
    else:
        out = torch.einsum("btf,hfd->bhtd", inputs, weight)  # (B, H_t, T, D_t)
    return out + bias[None, :, None, :]


def identity_mapper(source: str, target: str, source_config, target_config) -> Mapper:
    return Mapper(
        family="identity",
        source=source,
        target=target,
        source_geometry=kv_geometry(source_config),
        target_geometry=kv_geometry(target_config),
        rotary_source=RotarySpec.from_config(source_config).to_dict(),
        rotary_target=RotarySpec.from_config(target_config).to_dict(),
    )


def save_mapper(mapper: Mapper, path) -> str:
    tensors = {}
    names = TENSOR_NAMES[mapper.family]
    for kind, layers in (("keys", mapper.keys), ("values", mapper.values)):
        for layer, layer_tensors in enumerate(layers):
            for name, tensor in zip(names, layer_tensors, strict=True):
                tensors[f"{kind}.{layer}.{name}"] = tensor
    return stream_artifact(path, tensors, mapper.metadata())  # streamed: a k=8 mapper at Qwen3 shapes is ~2 GB


def load_mapper(path, device="cpu") -> Mapper:
    tensors, meta = load_artifact(path, device=device)
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a mapper file (format {meta.get('format')!r}, expected {FORMAT!r})")
    layers = len(meta["source_layers"])
    names = TENSOR_NAMES.get(meta.get("family"), ())
    try:
        keys = [tuple(tensors[f"keys.{layer}.{name}"] for name in names) for layer in range(layers)]
        values = [tuple(tensors[f"values.{layer}.{name}"] for name in names) for layer in range(layers)]
    except KeyError as err:
        raise ArtifactError(f"{path}: mapper is missing tensor {err}") from None
    return Mapper(
        family=meta["family"],
        source=meta["source"],
        target=meta["target"],
        source_geometry=meta["source_geometry"],
        target_geometry=meta["target_geometry"],
        rotary_source=meta["rotary_source"],
        rotary_target=meta["rotary_target"],
        k=meta["k"],
        ridge_lambda=meta["lambda"],
        source_layers=meta["source_layers"],
        keys=keys,
        values=values,
        extra=meta.get("extra", {}),
    )


def random_mapper(source_config, target_config, k: int = 1, family: str = "linear", seed: int = 0) -> Mapper:
    """A mapper of the right shape for the pair, with random weights: times like a fitted one of the same k.

    Target layer l reads the k source layers starting at the one of the same relative depth.
    """
    source_geometry, target_geometry = kv_geometry(source_config), kv_geometry(target_config)
    if not 1 <= k <= source_geometry["layers"]:
        raise ValueError(f"k={k}: expected 1 <= k <= {source_geometry['layers']} (the source's layer count)")
    if family not in ("linear", "head_matched"):
        raise ValueError(f"random mapper family {family!r}: expected 'linear' or 'head_matched'")
    heads_in = 1 if family == "head_matched" else source_geometry["kv_heads"]
    width = k * heads_in * source_geometry["head_dim"]
    heads, head_dim = target_geometry["kv_heads"], target_geometry["head_dim"]
    generator = torch.Generator().manual_seed(seed)

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.randn(heads, width, head_dim, generator=generator) / math.sqrt(width)  # (H_t, F, D_t)
        return weight, torch.zeros(heads, head_dim)

    source_layers = []
    for layer in range(target_geometry["layers"]):
        first = min(layer * source_geometry["layers"] // target_geometry["layers"], source_geometry["layers"] - k)
        source_layers.append(list(range(first, first + k)))
    return Mapper(
        family=family,
        source=source_config._name_or_path,
        target=target_config._name_or_path,
        source_geometry=source_geometry,
        target_geometry=target_geometry,
        rotary_source=RotarySpec.from_config(source_config).to_dict(),
        rotary_target=RotarySpec.from_config(target_config).to_dict(),
        k=k,
        source_layers=source_layers,
        keys=[pair() for _ in source_layers],
        values=[pair() for _ in source_layers],
        extra={"random": True, "seed": seed},
    )
