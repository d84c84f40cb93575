"""The mapper families: the forms of a map from the source's content-space cache to the target's, per target layer
and kind (keys, values). Shapes of one layer and kind: F = k x kv_heads_s x head_dim_s inputs (the k chosen source
layers, every source head), H = kv_heads_t target heads of D = head_dim_t; `width` is a family's inner size.
"""
from __future__ import annotations

from typing import NamedTuple

from pipeline.kv import entries
from pipeline.store.lazy import lazy

torch = lazy("torch")


class Geometry(NamedTuple):
    """KV heads and head_dim of source (s) and target (t)."""

    heads_s: int
    dim_s: int
    heads_t: int
    dim_t: int

    @classmethod
    def of(cls, source: dict, target: dict) -> "Geometry":
        return cls(source["kv_heads"], source["head_dim"], target["kv_heads"], target["head_dim"])


class Solved(NamedTuple):
    """One target layer and kind solved in closed form."""

    tensors: tuple
    sse_fit: torch.Tensor  # (H*D,)
    sse_select: torch.Tensor  # (H*D,)
    lambdas: list[float]  # per head
    parameters_per_output: float  # the parameter-to-sample ratio's numerator


class Family:
    """A mapper family; a subclass names it, declares its tensors and shapes, and maps a layer."""

    name: str = ""
    tensor_names: tuple[str, ...] = ()  # one layer and kind's tensors, in file and `project` order
    name_fields: tuple[str, ...] = ("k",)  # the `kv.mapnames.MapName` fields its names carry, besides the family
    width_name: str | None = None  # what its inner size is called (hidden, rank), None for a family without one
    width_param: str | None = None  # the params.yaml key of that size (one value or a list of them)
    fitting: str = "none"  # closed_form (from the fit's moments) | trained (its own trainer) | none
    trainable: bool = True  # distillation can train it through the frozen target
    scale_check: bool = False  # fit also scores it with its lambda read on the other scale (fit_lambda_scale.csv)

    def requirement(self, source: dict, target: dict) -> str | None:
        """Why a pair of these KV geometries cannot have a map of this family, or None."""
        return None

    def shapes(self, geometry: Geometry, k: int, width: int | None) -> tuple[tuple[int, ...], ...]:
        """The shapes of one target layer and kind's tensors, in `tensor_names` order."""
        raise NotImplementedError

    def width(self, tensors: tuple) -> int | None:
        return tensors[0].shape[1] if self.width_name else None

    def inputs(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The k chosen source layers' (B, H_s, T, D_s) content -> input rows (B, T, k*H_s*D_s), layer-major."""
        batch, heads, tokens, dim = tensors[0].shape
        flat = [t.transpose(1, 2).reshape(batch, tokens, heads * dim) for t in tensors]  # (B, T, H_s*D_s) each
        return flat[0] if len(flat) == 1 else torch.cat(flat, dim=-1)  # (B, T, k*H_s*D_s); k=1 skips a copy

    def project(self, inputs: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        """One target layer's keys or values from its inputs and its tensors: -> (B, H_t, T, D_t)."""
        raise NotImplementedError

    def solve(self, fit, select, blocks: list[int], ridge_lambda: float, geometry: Geometry, scale: str,
              ridge, device, width: int | None) -> Solved:
        """The closed-form fit of one layer and kind; `blocks`: the positions of the k source layers read among those
        accumulated; `ridge`: the fitting wing's solver (kv comes before it)."""
        raise NotImplementedError(f"the {self.name} family is not fitted in closed form")


def columns(blocks: list[int], geometry: Geometry, device, head: int | None = None) -> torch.Tensor:
    """The input columns of the chosen `blocks` in the fit's rows, layer-major: every source head's (k*H_s*D_s,), or
    only source head `head`'s (k*D_s,)."""
    width = geometry.heads_s * geometry.dim_s
    start, end = (0, width) if head is None else (head * geometry.dim_s, (head + 1) * geometry.dim_s)
    return torch.cat([torch.arange(b * width + start, b * width + end, device=device) for b in blocks])


class Identity(Family):
    """The source cache as it is (what direct injection passes): a map of no tensors."""

    name = "identity"
    name_fields = ()
    trainable = False

    def requirement(self, source: dict, target: dict) -> str | None:
        if source == target:
            return None
        return f"the identity map needs equal KV geometry, but the source has {source} and the target {target}"

    def shapes(self, geometry, k, width):
        return ()


class Linear(Family):
    """Each target head from the k chosen source layers, all source KV heads concatenated, with a bias (k=1: V0's map).
    weight (H, F, D), bias (H, D); out[b, h, t] = inputs[b, t] @ weight[h] + bias[h]. All heads read the same inputs,
    so one ridge solve with every head's columns is exactly the per-head fit."""

    name = "linear"
    tensor_names = ("weight", "bias")
    name_fields = ("k", "lambda")
    fitting = "closed_form"
    scale_check = True

    def shapes(self, geometry: Geometry, k: int, width: int | None):
        return (geometry.heads_t, k * geometry.heads_s * geometry.dim_s, geometry.dim_t), (geometry.heads_t,
                                                                                       geometry.dim_t)

    def project(self, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("btf,hfd->bhtd", inputs.to(weight.dtype), weight)  # (B, H_t, T, D_t)
        return out + bias[None, :, None, :]

    def solve(self, fit, select, blocks, ridge_lambda, geometry, scale, ridge, device, width) -> Solved:
        inputs = columns(blocks, geometry, device)  # (k*H_s*D_s,)
        own, own_select = fit.select(inputs), select.select(inputs)
        solved = ridge.effective_lambda(own, ridge_lambda, scale)
        weight, bias = ridge.solve(own, solved)  # (F, H*D), (H*D,): all heads, one solve
        per_head = (weight.reshape(-1, geometry.heads_t, geometry.dim_t).permute(1, 0, 2),  # (H, F, D)
                    bias.reshape(geometry.heads_t, geometry.dim_t))  # (H, D)
        return Solved(per_head, ridge.fitted_residual_ss(own, weight, bias, solved),
                      ridge.residual_ss(own_select, weight, bias), [solved] * geometry.heads_t, inputs.numel() + 1)


class HeadMatched(Family):
    """Like `linear`, but target head h reads only source head h of the k chosen layers (kv_heads_s times fewer
    parameters; needs equal KV head counts). weight (H, k*D_s, D), bias (H, D); one ridge solve per head (the heads
    read different inputs): out[b, h, t] = inputs[b, h, t] @ weight[h] + bias[h]."""

    name = "head_matched"
    tensor_names = ("weight", "bias")
    name_fields = ("k", "lambda")
    fitting = "closed_form"

    def requirement(self, source: dict, target: dict) -> str | None:
        if source["kv_heads"] == target["kv_heads"]:
            return None
        return (f"head_matched needs equal KV head counts, but the source has {source['kv_heads']} and the target "
                f"{target['kv_heads']}")

    def shapes(self, geometry: Geometry, k: int, width: int | None):
        return (geometry.heads_t, k * geometry.dim_s, geometry.dim_t), (geometry.heads_t, geometry.dim_t)

    def inputs(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-1)  # (B, H, T, k*D_s): own head only

    def project(self, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("bhtf,hfd->bhtd", inputs.to(weight.dtype), weight)  # one batched matmul for all heads
        return out + bias[None, :, None, :]

    def solve(self, fit, select, blocks, ridge_lambda, geometry, scale, ridge, device, width) -> Solved:
        weights, biases, sse_fit, sse_select, lambdas = [], [], [], [], []
        for head in range(geometry.heads_t):
            inputs = columns(blocks, geometry, device, head)  # (k*D_s,)
            outputs = torch.arange(head * geometry.dim_t, (head + 1) * geometry.dim_t, device=device)
            own = fit.select(inputs, outputs)
            lambdas.append(ridge.effective_lambda(own, ridge_lambda, scale))
            weight, bias = ridge.solve(own, lambdas[-1])  # (k*D_s, D), (D,)
            sse_fit.append(ridge.fitted_residual_ss(own, weight, bias, lambdas[-1]))
            sse_select.append(ridge.residual_ss(select.select(inputs, outputs), weight, bias))
            weights.append(weight)
            biases.append(bias)
        return Solved((torch.stack(weights), torch.stack(biases)), torch.cat(sse_fit), torch.cat(sse_select),
                      lambdas, inputs.numel() + 1)


def hidden_layer(inputs: torch.Tensor, in_weight: torch.Tensor, in_bias: torch.Tensor) -> torch.Tensor:
    """(..., F) -> (..., hidden): the same op when training and when mapping."""
    return torch.nn.functional.gelu(inputs @ in_weight + in_bias)


class Mlp(Family):
    """Like `linear`, through one hidden layer shared by a layer's target heads; trained, not solved (Adam, early
    stopping on held-out fit sequences). in_weight (F, hidden), in_bias (hidden,), weight (H, hidden, D), bias (H, D);
    hidden = gelu(inputs @ in_weight + in_bias), out[b, h, t] = hidden[b, t] @ weight[h] + bias[h]."""

    name = "mlp"
    tensor_names = ("in_weight", "in_bias", "weight", "bias")
    width_name = "hidden"
    width_param = "fit.mlp.hidden"
    fitting = "trained"

    def shapes(self, geometry: Geometry, k: int, width: int | None):
        if not width:
            raise ValueError("the mlp family's size needs its hidden width")
        inputs = k * geometry.heads_s * geometry.dim_s
        return (inputs, width), (width,), (geometry.heads_t, width, geometry.dim_t), (geometry.heads_t,
                                                                                    geometry.dim_t)

    def project(self, inputs: torch.Tensor, in_weight: torch.Tensor, in_bias: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
        hidden = hidden_layer(inputs.to(weight.dtype), in_weight, in_bias)  # (B, T, hidden)
        out = torch.einsum("btf,hfd->bhtd", hidden, weight)  # (B, H_t, T, D_t)
        return out + bias[None, :, None, :]


class LowRank(Family):
    """A reduced-rank ridge map: the ridge solution of `linear` projected on the top-r principal directions of its
    fitted values, as two factors. down (F, r), up (H, r, D), bias (H, D); out[b, h, t] = (inputs[b, t] @ down)
    @ up[h] + bias[h]: r (F + H*D) multiply-adds per token and kind instead of F*H*D. With W the ridge weight
    (F, H*D) and C the inputs' centered Gram (F, F), the fitted values' scatter is W^T C W; V (H*D, r) its top-r
    eigenvectors; W_r = W V V^T, so down = W V and up = V^T; the bias keeps the fitted means (b_r = mean_y -
    mean_x W_r). At r = H*D it is `linear` exactly."""

    name = "low_rank"
    tensor_names = ("down", "up", "bias")
    name_fields = ("k", "rank", "lambda")
    width_name = "rank"
    width_param = "fit.low_rank.ranks"
    fitting = "closed_form"

    def shapes(self, geometry: Geometry, k: int, width: int | None):
        if not width:
            raise ValueError("the low_rank family's size needs its rank")
        return ((k * geometry.heads_s * geometry.dim_s, width), (geometry.heads_t, width, geometry.dim_t),
                (geometry.heads_t, geometry.dim_t))

    def project(self, inputs: torch.Tensor, down: torch.Tensor, up: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        reduced = inputs.to(down.dtype) @ down  # (B, T, r)
        out = torch.einsum("btr,hrd->bhtd", reduced, up)  # (B, H_t, T, D_t)
        return out + bias[None, :, None, :]

    def solve(self, fit, select, blocks, ridge_lambda, geometry, scale, ridge, device, width) -> Solved:
        inputs = columns(blocks, geometry, device)  # (F,)
        own, own_select = fit.select(inputs), select.select(inputs)
        solved = ridge.effective_lambda(own, ridge_lambda, scale)
        weight, bias = ridge.solve(own, solved)  # (F, H*D), (H*D,)
        covariance, mean_x = ridge.input_scatter(own)  # (F, F), (F,)
        scatter = weight.T @ covariance @ weight  # (H*D, H*D): the fitted values' scatter
        _, vectors = torch.linalg.eigh(scatter)  # ascending eigenvalues
        top = vectors[:, -width:].flip(-1)  # (H*D, r): the r largest first
        down, up = weight @ top, top.T  # (F, r), (r, H*D)
        reduced = down @ up  # (F, H*D): W V V^T
        bias = bias + mean_x @ (weight - reduced)  # the fitted means kept: mean_y - mean_x W_r
        up = up.reshape(width, geometry.heads_t, geometry.dim_t).permute(1, 0, 2)  # (H, r, D)
        outputs = geometry.heads_t * geometry.dim_t
        return Solved((down, up, bias.reshape(geometry.heads_t, geometry.dim_t)),
                      ridge.residual_ss(own, reduced, bias), ridge.residual_ss(own_select, reduced, bias),
                      [solved] * geometry.heads_t, width * (inputs.numel() + outputs) / outputs + 1)


FAMILIES: dict[str, Family] = entries.register(Family, "families", (Identity(), Linear(), HeadMatched(), Mlp(),
                                                                    LowRank()))
CLOSED_FORM = tuple(name for name, spec in FAMILIES.items() if spec.fitting == "closed_form")
TRAINED = tuple(name for name, spec in FAMILIES.items() if spec.fitting == "trained")
FITTED_FAMILIES = CLOSED_FORM + TRAINED  # the families a fit makes maps of
TRAINABLE = tuple(name for name, spec in FAMILIES.items() if spec.trainable)


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown mapper family {name!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]
