"""Ridge regression from streamed moments: accumulate in float64 over shards, solve once, score from moments. A
regression X (N, F) -> Y (N, O) is summarized by n, sum x, sum y, X^T X, X^T Y and sum y^2 per output: memory is
independent of N, and every sub-problem (a subset of inputs or outputs) is an index selection of the moments. A
problem with fewer rows than input features keeps its rows (`Rows`) instead."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.store.lazy import lazy

torch = lazy("torch")


@dataclass
class Moments:
    n: int
    sum_x: torch.Tensor  # (F,)
    sum_y: torch.Tensor  # (O,)
    xtx: torch.Tensor  # (F, F)
    xty: torch.Tensor  # (F, O)
    sum_yy: torch.Tensor  # (O,)

    @classmethod
    def zeros(cls, in_width: int, out_width: int, device: str | torch.device) -> "Moments":
        """Empty moments on `device`: rows added later are moved there, so the float64 products run there."""
        shapes = [(in_width,), (out_width,), (in_width, in_width), (in_width, out_width), (out_width,)]
        return cls(0, *(torch.zeros(*shape, dtype=torch.float64, device=device) for shape in shapes))

    def update(self, x: torch.Tensor, y: torch.Tensor, inputs: bool = True) -> None:
        """Add rows x (N, F), y (N, O); `inputs` False: only the sums that involve y (the input side comes from an
        earlier pass over the same rows, `with_inputs_of`)."""
        x, y = x.to(self.xtx.device, torch.float64), y.to(self.xtx.device, torch.float64)
        if inputs:
            self.n += x.shape[0]
            self.sum_x += x.sum(0)
            self.xtx += x.T @ x  # (F, F)
        self.sum_y += y.sum(0)
        self.xty += x.T @ y  # (F, O)
        self.sum_yy += (y * y).sum(0)

    def with_inputs_of(self, other: "Moments") -> "Moments":
        """These output-side sums with `other`'s input side (same rows, other outputs)."""
        return Moments(other.n, other.sum_x, self.sum_y, other.xtx, self.xty, self.sum_yy)

    def select(self, inputs: torch.Tensor | None = None, outputs: torch.Tensor | None = None) -> "Moments":
        """The moments of the sub-problem reading input features `inputs` and predicting outputs `outputs`."""
        i = slice(None) if inputs is None else inputs
        o = slice(None) if outputs is None else outputs
        return Moments(self.n, self.sum_x[i], self.sum_y[o], self.xtx[i][:, i], self.xty[i][:, o], self.sum_yy[o])


@dataclass
class Rows:
    """A regression's rows themselves (float64), for a problem with fewer rows than input features: the dual solve
    (N x N instead of F x F) and scoring from the rows are cheaper, and the rows take less memory than X^T X."""

    xs: list[torch.Tensor]  # (rows, F) chunks, in the order added
    ys: list[torch.Tensor]  # (rows, O) chunks
    device: str | torch.device

    def update(self, x: torch.Tensor, y: torch.Tensor, inputs: bool = True) -> None:
        self.xs.append(x.to(self.device, torch.float64))
        self.ys.append(y.to(self.device, torch.float64))

    @property
    def n(self) -> int:
        return sum(x.shape[0] for x in self.xs)

    @property
    def x(self) -> torch.Tensor:
        return self._whole()[0]

    @property
    def y(self) -> torch.Tensor:
        return self._whole()[1]

    def _whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.xs) != 1:
            self.xs, self.ys = [torch.cat(self.xs)], [torch.cat(self.ys)]
        return self.xs[0], self.ys[0]

    def with_inputs_of(self, other: "Rows") -> "Rows":
        return self

    def select(self, inputs: torch.Tensor | None = None, outputs: torch.Tensor | None = None) -> "Rows":
        """The rows of the sub-problem reading input features `inputs` and predicting outputs `outputs`."""
        x, y = self.x, self.y
        return Rows([x if inputs is None else x[:, inputs]], [y if outputs is None else y[:, outputs]], self.device)


def summary(rows: int, in_width: int, out_width: int, device: str | torch.device) -> Moments | Rows:
    """What a regression of `rows` rows accumulates into: the rows while fewer than the input features, else the
    moments (they agree to float64 rounding; the choice depends on the row count alone, the same in every pass)."""
    return Rows([], [], device) if rows < in_width else Moments.zeros(in_width, out_width, device)


def gram_scale(m: Moments | Rows) -> float:
    """Mean of the centered Gram diagonal, trace(Cxx) / F: an average input feature's sum of squares about its mean."""
    if isinstance(m, Rows):
        return ((m.x - m.x.mean(0)) ** 2).sum(0).mean().item()
    return (m.xtx.diagonal() - m.sum_x * m.sum_x / m.n).mean().item()


def effective_lambda(m: Moments | Rows, ridge_lambda: float, scale: str) -> float:
    """The lambda `solve` adds to Cxx's diagonal: `ridge_lambda` itself (`absolute`: on the unnormalized sum of
    squares, as scikit-learn's Ridge alpha) or times `gram_scale(m)` of the sub-problem solved (`relative`: one value
    means the same regularization at every row count, width and activation scale)."""
    if scale == "absolute":
        return ridge_lambda
    return ridge_lambda * gram_scale(m)


def solve(m: Moments | Rows, ridge_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge fit with unpenalized bias: weight (F, O), bias (O,), float64. From moments the centered primal system
    (Cxx + lambda I) W = Cxy, Cxx = X^T X - n mx mx^T, Cxy = X^T Y - n mx my^T, then b = my - mx W; from rows the
    dual W = Xc^T (Xc Xc^T + lambda I)^-1 Yc, the same W (the push-through identity) at N x N cost. All output
    columns share X, so one solve is exactly the separate per-column (per-head) fits."""
    if m.n < 2:
        raise ValueError(f"ridge fit needs at least 2 rows, got {m.n}")
    if isinstance(m, Rows):
        mean_x, mean_y = m.x.mean(0), m.y.mean(0)
        centered = m.x - mean_x  # (N, F)
        gram = centered @ centered.T  # (N, N)
        factor = _cholesky(gram + ridge_lambda * torch.eye(m.n, dtype=torch.float64, device=gram.device), m.n,
                           ridge_lambda)
        weight = centered.T @ torch.cholesky_solve(m.y - mean_y, factor)  # (F, O)
        return weight, mean_y - mean_x @ weight
    mean_x, mean_y = m.sum_x / m.n, m.sum_y / m.n
    cov_xx = m.xtx - m.n * torch.outer(mean_x, mean_x)  # (F, F)
    cov_xy = m.xty - m.n * torch.outer(mean_x, mean_y)  # (F, O)
    system = cov_xx + ridge_lambda * torch.eye(cov_xx.shape[0], dtype=torch.float64, device=cov_xx.device)
    weight = torch.cholesky_solve(cov_xy, _cholesky(system, m.n, ridge_lambda))  # (F, O)
    return weight, mean_y - mean_x @ weight


def _cholesky(system: torch.Tensor, rows: int, ridge_lambda: float) -> torch.Tensor:
    factor, info = torch.linalg.cholesky_ex(system)
    if info.item() != 0:
        raise ValueError(
            f"ridge system ({system.shape[0]} x {system.shape[0]}, {rows} rows, lambda {ridge_lambda}) is not "
            f"positive definite: the inputs are collinear; use a lambda > 0"
        )
    return factor


def residual_ss(m: Moments | Rows, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Sum over the rows `m` holds or summarizes of (y - x W - b)^2, per output column (O,)."""
    if isinstance(m, Rows):
        return ((m.y - m.x @ weight - bias) ** 2).sum(0)
    # sum (y - xW - b)^2 = yy - 2 diag(W^T X^T Y) - 2 b.sy + diag(W^T X^T X W) + 2 b (sx W) + n b^2
    xw_cross = (weight * m.xty).sum(0)  # (O,) diag(W^T X^T Y)
    xw_square = ((m.xtx @ weight) * weight).sum(0)  # (O,) diag(W^T X^T X W)
    xw_sum = m.sum_x @ weight  # (O,)
    return m.sum_yy - 2 * xw_cross - 2 * bias * m.sum_y + xw_square + 2 * bias * xw_sum + m.n * bias * bias


def fitted_residual_ss(m: Moments | Rows, weight: torch.Tensor, bias: torch.Tensor,
                       ridge_lambda: float) -> torch.Tensor:
    """`residual_ss` on the rows `solve(m, ridge_lambda)` was fitted to; from moments in O(F*O) instead of O(F^2*O):
    the solution satisfies Cxx W = Cxy - lambda W, so diag(W^T Cxx W) = diag(W^T Cxy) - lambda diag(W^T W) and the
    centered SSE = Syy - 2 diag(W^T Cxy) + diag(W^T Cxx W) = Syy - diag(W^T Cxy) - lambda diag(W^T W) (the fitted bias
    makes the residual the centered one). Equal to `residual_ss` up to rounding."""
    if isinstance(m, Rows):
        return residual_ss(m, weight, bias)
    cov_xy = m.xty - torch.outer(m.sum_x, m.sum_y) / m.n  # (F, O)
    return total_ss(m) - (weight * cov_xy).sum(0) - ridge_lambda * (weight * weight).sum(0)


def input_scatter(m: Moments | Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs' centered Gram (F, F), sum of (x - mean x)^T (x - mean x), and their mean (F,)."""
    if isinstance(m, Rows):
        mean_x = m.x.mean(0)
        centered = m.x - mean_x  # (N, F)
        return centered.T @ centered, mean_x
    mean_x = m.sum_x / m.n
    return m.xtx - m.n * torch.outer(mean_x, mean_x), mean_x


def total_ss(m: Moments | Rows) -> torch.Tensor:
    """Sum of (y - mean y)^2 per output column (O,)."""
    if isinstance(m, Rows):
        return ((m.y - m.y.mean(0)) ** 2).sum(0)
    return m.sum_yy - m.sum_y * m.sum_y / m.n


def pooled_r2(sse: torch.Tensor, sst: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """R² of each of `groups` equal column groups (e.g. heads): 1 - pooled SSE / pooled SST, (groups,)."""
    return 1.0 - sse.reshape(groups, -1).sum(1) / sst.reshape(groups, -1).sum(1)
