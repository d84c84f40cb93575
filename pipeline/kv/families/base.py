"""What a mapper family is: the one interface every family module fills in, and the name of a map.

A family is the form of a map from the source's content-space cache to the target's, per target layer and kind
(keys, values). Its module (`kv/families/<name>.py`) says everything the pipeline needs of it, and nothing
outside `kv/families/` lists families: the tensors a layer holds and their shapes (so parameter counts and
multiply-adds are counted from them), how one layer is mapped, which pair geometry it needs (the architecture
contract asks), how it is fitted (closed form from the fit's streamed moments, or trained, or not at all),
whether distillation can train it, and which fields its map names carry (`registry.MapName`).

Shapes of one layer and kind: F = k x kv_heads_s x head_dim_s inputs (the k chosen source layers, every source
head), H = kv_heads_t target heads of D = head_dim_t; `width` is a family's inner size (the MLP's hidden width,
the low-rank map's rank), None where it has none.
"""
from __future__ import annotations

from typing import NamedTuple

from pipeline.store.lazy import lazy

torch = lazy("torch")

class Geometry(NamedTuple):
    """KV heads and head_dim of source (s) and target (t): what a layer's shapes depend on."""

    heads_s: int
    dim_s: int
    heads_t: int
    dim_t: int

    @classmethod
    def of(cls, source: dict, target: dict) -> "Geometry":
        """From two `kv.kvcache.kv_geometry` dicts."""
        return cls(source["kv_heads"], source["head_dim"], target["kv_heads"], target["head_dim"])


class Solved(NamedTuple):
    """One target layer and kind solved in closed form: the family's tensors, the residual sums of squares on
    the fit and select rows per output column, the lambda each head was solved with, parameters per output column."""

    tensors: tuple
    sse_fit: torch.Tensor  # (H*D,)
    sse_select: torch.Tensor  # (H*D,)
    lambdas: list[float]
    parameters_per_output: float  # the parameter-to-sample ratio's numerator


class Family:
    """The interface of a mapper family; a family module defines one subclass and one instance, `FAMILY`."""

    name: str = ""
    tensor_names: tuple[str, ...] = ()  # one layer and kind's tensors, in file and `project` order
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

    def inputs(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The k chosen source layers' (B, H_s, T, D_s) content -> this family's input rows, (B, T, k*H_s*D_s):
        every source head, layer-major as the fit reads them."""
        batch, heads, tokens, dim = tensors[0].shape
        flat = [t.transpose(1, 2).reshape(batch, tokens, heads * dim) for t in tensors]  # (B, T, H_s*D_s) each
        return flat[0] if len(flat) == 1 else torch.cat(flat, dim=-1)  # (B, T, k*H_s*D_s); k=1 skips a copy

    def project(self, inputs: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        """One target layer's keys or values from its inputs: -> (B, H_t, T, D_t)."""
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
