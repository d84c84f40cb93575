"""What a mapper family's maths is: how the family declared in `kv/families/<name>.py` maps one layer and, for a
closed-form family, how it is solved from the fit's moments.

Its module (`kv/families/maths/<name>.py`) names its declaration and fills in `project` (and `inputs`, `solve` where
it differs); the declaration says the rest (tensor names and shapes, the geometry it needs, how it is fitted, its
map names). Shapes as in `kv.families.base`: F inputs, H target heads of D.
"""
from __future__ import annotations

from typing import NamedTuple

from pipeline.kv.entries import Maths
from pipeline.kv.families.base import Family, Geometry
from pipeline.store.lazy import lazy

torch = lazy("torch")


class Solved(NamedTuple):
    """One target layer and kind solved in closed form: the family's tensors, the residual sums of squares on
    the fit and select rows per output column, the lambda each head was solved with, parameters per output column."""

    tensors: tuple
    sse_fit: torch.Tensor  # (H*D,)
    sse_select: torch.Tensor  # (H*D,)
    lambdas: list[float]
    parameters_per_output: float  # the parameter-to-sample ratio's numerator


class FamilyMaths(Maths):
    """The interface of a family's maths; a maths module defines one subclass, naming its declaration
    (`declaration`, the module's `FAMILY`), and one instance, `MATHS`."""

    declaration: Family | None = None

    def inputs(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The k chosen source layers' (B, H_s, T, D_s) content -> this family's input rows, (B, T, k*H_s*D_s):
        every source head, layer-major as the fit reads them."""
        batch, heads, tokens, dim = tensors[0].shape
        flat = [t.transpose(1, 2).reshape(batch, tokens, heads * dim) for t in tensors]  # (B, T, H_s*D_s) each
        return flat[0] if len(flat) == 1 else torch.cat(flat, dim=-1)  # (B, T, k*H_s*D_s); k=1 skips a copy

    def project(self, inputs: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        """One target layer's keys or values from its inputs and its tensors (the declaration's `tensor_names`
        order): -> (B, H_t, T, D_t)."""
        raise NotImplementedError

    def solve(self, fit, select, blocks: list[int], ridge_lambda: float, geometry: Geometry, scale: str,
              ridge, device, width: int | None) -> Solved:
        """The closed-form fit of one layer and kind from the `fit` and `select` summaries (`fitting.ridge`'s
        `Moments` or `Rows`) of the accumulated source layers' inputs; `blocks` are the positions, among those
        layers, of the k this map reads; `width` its inner size; `ridge` is the fitting wing's solver module,
        handed in (the kv wing comes before the fitting wing in the import order: a family imports none of it)."""
        raise NotImplementedError(f"the {self.name} family is not fitted in closed form")


def columns(blocks: list[int], geometry: Geometry, device, head: int | None = None) -> torch.Tensor:
    """The input columns of the chosen `blocks` (source layers) in the fit's rows, layer-major: every source
    head's, or only source head `head`'s, (k*H_s*D_s,) or (k*D_s,)."""
    width = geometry.heads_s * geometry.dim_s
    start, end = (0, width) if head is None else (head * geometry.dim_s, (head + 1) * geometry.dim_s)
    return torch.cat([torch.arange(b * width + start, b * width + end, device=device) for b in blocks])


def per_head(weight: torch.Tensor, bias: torch.Tensor, geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """A solve's weight (F, H*D) and bias (H*D,) as the file holds them: (H, F, D) and (H, D)."""
    return weight.reshape(-1, geometry.heads_t, geometry.dim_t).permute(1, 0, 2), bias.reshape(geometry.heads_t,
                                                                                            geometry.dim_t)
