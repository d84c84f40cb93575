"""The `sibling` section of params.yaml, read by stage `sibling`: what a smaller sibling keeps of the target (its
shape: layers, MLP channels, query heads) and how it is healed by distillation from the target's logits.

`sibling.shape` is a string of parts joined by `+`, each `name:count`; a part left out keeps the target's own:

    layers:<n>      decoder layers kept (depth; which ones: `sibling.keep`)
    mlp:<n>         MLP channels kept in every layer (width)
    heads:<n>       query heads kept in every layer, the same number per KV group (width; a multiple of the KV heads)

`layers:12` is depth pruning alone, `mlp:256+heads:6` width alone (the KV geometry kept: direct injection is
defined for the pair), `layers:20+mlp:768+heads:6` both.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, NamedTuple

from pydantic import AfterValidator, Field, model_validator

from pipeline.fitting.heal import Healing
from pipeline.kv.geometry import kv_geometry
from pipeline.store import paths
from pipeline.store.params import Count, ParamError, Positive

INFLUENCE = "influence"  # sibling.keep: the layers of highest block influence on the calibration rows
SHAPE_PARTS = {"layers": "decoder layers", "mlp": "MLP channels per layer", "heads": "query heads per layer"}
SHAPE_FORM = "parts joined by +, each layers:<n>, mlp:<n> or heads:<n>, e.g. mlp:256+heads:6"


def names_sibling(source: str) -> bool:
    """Whether `models.source` names the sibling's folder (then stage `sibling` builds it)."""
    return Path(source) == paths.SIBLING


class Counts(NamedTuple):
    """A shape resolved against the target: the counts the sibling keeps."""

    layers: int
    mlp: int
    heads: int


class Shape(NamedTuple):
    """`sibling.shape` read: each count, or None where the target's own is kept."""

    layers: int | None
    mlp: int | None
    heads: int | None

    @classmethod
    def parse(cls, text: str) -> Shape:
        counts: dict[str, int] = {}
        for part in str(text).split("+"):
            name, colon, count = part.strip().partition(":")
            if name not in SHAPE_PARTS or name in counts or not colon or not count.isdigit() or int(count) < 1:
                raise ValueError(f"{text!r}: bad part {part!r} ({SHAPE_FORM})")
            counts[name] = int(count)
        if counts.get("layers", 2) < 2:
            raise ValueError(f"{text!r}: a sibling keeps at least 2 decoder layers")
        return cls(**{name: counts.get(name) for name in SHAPE_PARTS})

    def within(self, config, target: str) -> Counts:
        """The counts against the target's `config`, or the one-line refusal of a count it cannot keep."""
        own = Counts(config.num_hidden_layers, config.intermediate_size, config.num_attention_heads)
        kept = Counts(*(mine or theirs for mine, theirs in zip(self, own)))
        for name, mine, theirs in zip(SHAPE_PARTS, kept, own):
            if mine > theirs:
                raise ParamError(f"sibling.shape: {name}:{mine}, but the target has {theirs} {SHAPE_PARTS[name]} "
                                 f"({target}); give at most {theirs}")
        kv_heads = kv_geometry(config)["kv_heads"]
        if kept.heads % kv_heads:
            raise ParamError(f"sibling.shape: heads:{kept.heads} is not a multiple of the target's {kv_heads} KV heads "
                             f"({target}); every KV group keeps as many query heads (e.g. heads:{2 * kv_heads})")
        if kept == own:
            raise ParamError(f"sibling.shape: {self.text()} keeps the whole target ({target}); drop layers, MLP "
                             f"channels or query heads")
        return kept

    def text(self) -> str:
        return "+".join(f"{name}:{count}" for name, count in zip(SHAPE_PARTS, self) if count is not None)


def _shape(text: str) -> str:
    Shape.parse(text)
    return text


class SiblingParams(Healing):
    shape: Annotated[str, AfterValidator(_shape)]  # what the sibling keeps (the module's docstring)
    keep: Literal["influence"] | list[Count]  # with layers:<n>: the rule, or the kept layers (ascending target indices)
    ranking_sequences: Positive  # calibration rows (the fit stream's first) block influence and importance read
    prefill_length: Annotated[int, Field(ge=2)]  # prompt tokens at which the prefill cost ratio is counted

    @property
    def cut(self) -> Shape:
        return Shape.parse(self.shape)

    def within(self, config, target: str) -> Counts:
        """The shape's counts against the target's `config` (`Shape.within`), or the one-line refusal of a count
        it cannot keep, a listed layer it does not have or a top_k that leaves no token over."""
        if self.top_k >= config.vocab_size:
            raise ParamError(f"sibling.top_k: {self.top_k}, but the target's vocabulary has {config.vocab_size} "
                             f"tokens ({target}); keep fewer than {config.vocab_size}")
        total = config.num_hidden_layers
        if self.keep != INFLUENCE and any(index >= total for index in self.keep):
            raise ParamError(f"sibling.keep: {self.keep} names a layer outside the target's {total} decoder layers "
                             f"({target}); give indices 0..{total - 1}")
        return self.cut.within(config, target)

    @model_validator(mode="after")
    def _kept_layers_are_a_list_of_layers(self) -> SiblingParams:
        if self.keep == INFLUENCE:
            return self
        if self.cut.layers is None:
            raise ParamError(f"sibling.keep: {self.keep} lists layers, but sibling.shape {self.shape!r} keeps them "
                             f"all; add layers:{len(self.keep)} to the shape or write keep: influence")
        if len(self.keep) != self.cut.layers:
            raise ParamError(f"sibling.keep: {len(self.keep)} layers listed but sibling.shape keeps "
                             f"layers:{self.cut.layers}; list {self.cut.layers} layers or write keep: influence")
        if any(later <= earlier for earlier, later in zip(self.keep, self.keep[1:])):
            raise ParamError(f"sibling.keep: {self.keep} is not strictly ascending; list each kept target layer "
                             f"once, in order")
        return self
