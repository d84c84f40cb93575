"""Maps from the source model's content-space KV cache, (batch, kv_heads_s, tokens, head_dim_s) per source layer, to
the target's, (batch, kv_heads_t, tokens, head_dim_t) per target layer, and their file: a checksummed artifact of
tensors `{keys,values}.{layer}.{name}` with metadata naming the pair, its geometry, rotary settings and fingerprints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from pipeline.kv.families import FAMILIES, Geometry
from pipeline.kv.families import family as family_spec
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.kvcache import Layers
from pipeline.kv.rope import RotarySpec, Rotation
from pipeline.store.artifacts import ArtifactError, load_artifact, stream_artifact
from pipeline.store.lazy import lazy
from pipeline.store.models import IncompatiblePairError

torch = lazy("torch")

FORMAT = "kv-handoff/mapper/v1"
TYPED_EXTRA = ("key_space", "distilled")  # the extra entries other stages read, typed fields of `Mapper`
# metadata key -> Mapper field, in the file's order
META_FIELDS = {**{name: name for name in ("family", "source", "target", "source_geometry", "target_geometry",
                                         "rotary_source", "rotary_target", "k")},
               "lambda": "ridge_lambda", "source_layers": "source_layers"}


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
    # per target layer: the family's tensors in its `tensor_names` order
    keys: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    values: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # the fit's facts, for the record
    key_space: str = "content"  # rotated: fitted on keys with RoPE kept (the length study's ablation)
    distilled: dict | None = None  # a distilled map's facts (start digest, loss weights, best epoch, ...)
    # the pair's fingerprints (store.fingerprints.pair_fingerprints); None: an old map's or one made in memory
    models: dict | None = None

    def __post_init__(self) -> None:
        reason = family_spec(self.family).requirement(self.source_geometry, self.target_geometry)
        if reason:
            raise ValueError(f"{self.source} -> {self.target}: {reason}")

    @property
    def spec(self):
        return FAMILIES[self.family]

    @property
    def width(self) -> int | None:
        """The family's inner size (the MLP's hidden width, the low-rank map's rank)."""
        return self.spec.width(self.keys[0]) if self.keys else None

    def metadata(self) -> dict:
        typed = {"key_space": self.key_space} if self.key_space != "content" else {}
        if self.distilled is not None:
            typed["distilled"] = self.distilled
        bound = {"models": self.models} if self.models is not None else {}
        return {"format": FORMAT, **{key: getattr(self, field) for key, field in META_FIELDS.items()},
                "extra": {**self.extra, **typed}, **bound}

    def parameter_count(self) -> int:
        return sum(t.numel() for tensors in self.keys + self.values for t in tensors)

    def macs_per_token(self) -> int:
        """Multiply-adds to map one token's cache: one per weight entry (biases are adds)."""
        names = self.spec.tensor_names
        return sum(t.numel() for tensors in self.keys + self.values
                   for name, t in zip(names, tensors) if not name.endswith("bias"))

    def apply(self, source_layers: Layers) -> Layers:
        """Content-space source cache -> content-space target cache."""
        return [self.apply_layer(source_layers, layer) for layer in range(self.target_layers(source_layers))]

    def target_layers(self, source_layers: Layers) -> int:
        return len(source_layers) if not self.spec.tensor_names else len(self.source_layers)

    def apply_layer(self, source_layers: Layers, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Target layer `layer` of `apply`, so a caller can finish each layer before the next."""
        if not self.spec.tensor_names:  # identity: the source's layer as it is
            return source_layers[layer]
        chosen = self.source_layers[layer]
        key_in = self.spec.inputs([source_layers[s][0] for s in chosen])
        value_in = self.spec.inputs([source_layers[s][1] for s in chosen])
        return self.spec.project(key_in, *self.keys[layer]), self.spec.project(value_in, *self.values[layer])

    def to(self, device=None, dtype=None) -> "Mapper":
        self.keys, self.values = ([tuple(t.to(device=device, dtype=dtype) for t in ts) for ts in layers]
                                  for layers in (self.keys, self.values))
        return self


def map_cache(mapper: Mapper | None, content: Layers, rotation: Rotation, dtype, device,
              order: torch.Tensor | None = None) -> Iterator[tuple[tuple, tuple]]:
    """The source's content cache (float32) through `mapper` (None: as it is), one layer at a time: (the content the
    map made, after the shuffle `order` (B, T); the cache the target reads, rotated, on `device` in `dtype`). The one
    way a cache is mapped, with autograd on or off: a map is trained on what it injects."""
    rotated = mapper is not None and mapper.key_space == "rotated"
    for layer in range(mapper.target_layers(content) if mapper else len(content)):
        keys, values = mapper.apply_layer(content, layer) if mapper else content[layer]
        if order is not None:  # permute each row's tokens, (B, H, T, D)
            index = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3]).to(keys.device)
            keys, values = keys.gather(2, index), values.gather(2, index.to(values.device))
        # the linear map leaves values in (B, T, H, D) memory order: lay them out while only this layer is live
        cached_values = values.to(device, dtype, memory_format=torch.contiguous_format)
        keys = keys.to(device)
        yield (keys, values), ((keys if rotated else rotation.apply(keys)).to(dtype), cached_values)


def pair_fields(source_config, target_config) -> dict:
    return {"source_geometry": kv_geometry(source_config), "target_geometry": kv_geometry(target_config),
            "rotary_source": RotarySpec.from_config(source_config).to_dict(),
            "rotary_target": RotarySpec.from_config(target_config).to_dict()}


def check_map_geometry(mapper: Mapper, source_config, target_config, names: str) -> None:
    """Refuse a map fitted for other KV geometries than the pair's (`names` names its models)."""
    geometries = kv_geometry(source_config), kv_geometry(target_config)
    if (mapper.source_geometry, mapper.target_geometry) != geometries:
        raise IncompatiblePairError(f"mapper was fitted for KV geometry {mapper.source_geometry} -> "
                                    f"{mapper.target_geometry}, but {names} have {geometries[0]} -> {geometries[1]}")


def identity_mapper(source: str, target: str, source_config, target_config) -> Mapper:
    return Mapper("identity", source, target, **pair_fields(source_config, target_config))


def save_mapper(mapper: Mapper, path) -> str:
    tensors = {}
    names = mapper.spec.tensor_names
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
    names = FAMILIES[meta["family"]].tensor_names if meta.get("family") in FAMILIES else ()
    try:
        keys = [tuple(tensors[f"keys.{layer}.{name}"] for name in names) for layer in range(layers)]
        values = [tuple(tensors[f"values.{layer}.{name}"] for name in names) for layer in range(layers)]
    except KeyError as err:
        raise ArtifactError(f"{path}: mapper is missing tensor {err}") from None
    extra = meta.get("extra", {})
    return Mapper(**{field: meta[key] for key, field in META_FIELDS.items()}, keys=keys, values=values,
                  extra={key: value for key, value in extra.items() if key not in TYPED_EXTRA},
                  key_space=extra.get("key_space", "content"), distilled=extra.get("distilled"),
                  models=meta.get("models"))


def random_mapper(source_config, target_config, k: int = 1, family: str = "linear", seed: int = 0,
                  width: int | None = None) -> Mapper:
    """A mapper of the right shape for the pair with random weights: times like a fitted one. Target layer l reads k
    source layers from the one at its relative depth."""
    source_geometry, target_geometry = kv_geometry(source_config), kv_geometry(target_config)
    if not 1 <= k <= source_geometry["layers"]:
        raise ValueError(f"k={k}: expected 1 <= k <= {source_geometry['layers']} (the source's layer count)")
    spec = family_spec(family)
    shapes = spec.shapes(Geometry.of(source_geometry, target_geometry), k, width)
    generator = torch.Generator().manual_seed(seed)

    def draw() -> tuple[torch.Tensor, ...]:  # weights scaled by their fan-in (the second-to-last axis), zero biases
        return tuple(torch.zeros(shape) if name.endswith("bias") else
                     torch.randn(*shape, generator=generator) / math.sqrt(shape[-2])
                     for name, shape in zip(spec.tensor_names, shapes))

    source_layers = []
    for layer in range(target_geometry["layers"]):
        first = min(layer * source_geometry["layers"] // target_geometry["layers"], source_geometry["layers"] - k)
        source_layers.append(list(range(first, first + k)))
    return Mapper(family, source_config._name_or_path, target_config._name_or_path,
                  **pair_fields(source_config, target_config), k=k,
                  source_layers=source_layers, keys=[draw() for _ in source_layers],
                  values=[draw() for _ in source_layers], extra={"random": True, "seed": seed})
