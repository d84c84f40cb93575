"""What a mapper family is: the one interface every family module fills in, its declaration.

A family is the form of a map from the source's content-space cache to the target's, per target layer and kind
(keys, values). It is two modules, and nothing outside `kv/families/` lists families:

    kv/families/<name>.py        its declaration: the tensors a layer holds and their shapes (so parameter counts
                                 and multiply-adds are counted from them), which pair geometry it needs (the
                                 architecture contract asks), how it is fitted (closed form from the fit's streamed
                                 moments, or trained, or not at all), whether distillation can train it, and which
                                 fields its map names carry (`registry.MapName`)
    kv/families/maths/<name>.py  its maths: how one layer is mapped and how it is solved in closed form (torch),
                                 `maths.base.FamilyMaths`

The contract, the FLOP model, the params' checks and the report read the declarations alone; only the mapper
(`kv.mapper`) and the fitting wing import the maths.

Shapes of one layer and kind: F = k x kv_heads_s x head_dim_s inputs (the k chosen source layers, every source
head), H = kv_heads_t target heads of D = head_dim_t; `width` is a family's inner size (the MLP's hidden width,
the low-rank map's rank), None where it has none.
"""
from __future__ import annotations

from typing import NamedTuple


class Geometry(NamedTuple):
    """KV heads and head_dim of source (s) and target (t): what a layer's shapes depend on."""

    heads_s: int
    dim_s: int
    heads_t: int
    dim_t: int

    @classmethod
    def of(cls, source: dict, target: dict) -> "Geometry":
        """From two `kv.geometry.kv_geometry` dicts."""
        return cls(source["kv_heads"], source["head_dim"], target["kv_heads"], target["head_dim"])


class Family:
    """The declaration of a mapper family; a family module defines one subclass and one instance, `FAMILY`."""

    name: str = ""
    tensor_names: tuple[str, ...] = ()  # one layer and kind's tensors, in file and its maths' `project` order
    name_fields: tuple[str, ...] = ("k",)  # the `MapName` fields its names carry, besides the family
    width_name: str | None = None  # what its inner size is called (hidden, rank), None for a family without one
    width_param: str | None = None  # the params.yaml key of that size (one value or a list of them)
    fitting: str = "none"  # closed_form (from the fit's moments) | trained (its own trainer) | none
    trainable: bool = True  # distillation can train it through the frozen target
    scale_check: bool = False  # fit also scores it with its lambda read on the other scale (fit_lambda_scale.csv)

    def requirement(self, source: dict, target: dict) -> str | None:
        """Why a pair of these KV geometries (`kv_geometry` dicts) cannot have a map of this family, or None."""
        return None

    def shapes(self, geometry: Geometry, k: int, width: int | None) -> tuple[tuple[int, ...], ...]:
        """The shapes of one target layer and kind's tensors, in `tensor_names` order."""
        raise NotImplementedError

    def width(self, tensors: tuple) -> int | None:
        """The inner size read off one layer's tensors (None for a family without one)."""
        return None
