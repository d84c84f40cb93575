"""Speculative prefill's declared settings (params' `speculative` section) and its index arithmetic; no torch.
The share p is the request's (`speculative:0.1`); m, s, the layers read and the pooling are declared in params.
A prefix c[0..P-1] keeps:

    c[0 .. s-1]            the sinks (s = min(sinks, P))
    c[s .. P-m-1]          round(p x (P - s - m)) of them, those the scores rank first
    c[P-m .. P-1]          the last m (m = min(last, P - s)), whose attention scored the rest
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from pipeline.store.artifacts import ArtifactError
from pipeline.store.params import Count, Params, Positive

SECTION = "speculative"  # the params section faces read the declared settings from


class Lookahead(Params):
    """What the scores read: the source layers and the pooling."""
    layers: Literal["all"] | Annotated[list[int], Field(min_length=1)]  # the source layers read (negative: from
    # the end, so one list fits sources of any depth)
    pooling: Literal["max", "mean"]  # over the layers read, the query heads and the m queries

    @property
    def label(self) -> str:
        """`all:max`, `-1:mean`."""
        layers = self.layers if self.layers == "all" else ",".join(map(str, self.layers))
        return f"{layers}:{self.pooling}"

    def layer_indices(self, depth: int) -> list[int]:
        """The source layers read, as indices 0..depth-1 in ascending order, each once."""
        if self.layers == "all":
            return list(range(depth))
        problem = self.layer_refusal(depth)
        if problem:
            raise ValueError(problem)
        return sorted({index % depth for index in self.layers})

    def layer_refusal(self, depth: int) -> str | None:
        """Why `layers` cannot be read from a source of `depth` decoder layers, or None."""
        outside = [index for index in ([] if self.layers == "all" else self.layers) if not -depth <= index < depth]
        if outside:
            return (f"speculative.layers: layer {outside[0]} is outside the source's {depth} layers; give indices in "
                    f"{-depth}..{depth - 1} or `all`")
        return None


class SpeculativeParams(Lookahead):
    last: Positive  # m: the prefix's last tokens whose attention scores the rest, always kept
    sinks: Count  # the prefix's first tokens, always kept by the mode (a repair has its own `sink:S`)

    def reading(self, lookahead: Lookahead) -> SpeculativeParams:
        return self.model_copy(update=lookahead.model_dump())

    def spans(self, length: int) -> tuple[int, int]:
        """(s, m) for a prefix of `length` tokens, each cut to what is left."""
        sinks = min(self.sinks, length)
        return sinks, min(self.last, length - sinks)

    def kept(self, share: float, length: int) -> int:
        sinks, last = self.spans(length)
        return sinks + last + chosen(share, length - sinks - last)


def chosen(share: float, candidates: int) -> int:
    """round(p x candidates), halves up (the repair's rounding)."""
    return math.floor(share * candidates + 0.5)


def chosen_lookahead(path: Path) -> SpeculativeParams:
    """The settings stage select chose, written at `path`."""
    if not path.is_file():
        raise ArtifactError(f"{path} not found; run the select stage")
    return SpeculativeParams.model_validate(json.loads(path.read_text()))
