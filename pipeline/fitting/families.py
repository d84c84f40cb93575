"""Every candidate map for one target layer: the closed-form families from shared moments, the MLP by training
(`train_mlp`). The moments of the `max(k)` chosen source layers' inputs are accumulated once per split: every k, lambda
and family is an index selection of them. Each candidate's per-layer tensors go to disk as solved (`Parts`)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.fitting import ridge
from pipeline.fitting.probes import Pairs, held_rows
from pipeline.kv.families import FAMILIES, Geometry, columns, hidden_layer
from pipeline.kv.mapnames import MapName
from pipeline.store.artifacts import take_umask
from pipeline.store.cachefiles import KINDS
from pipeline.store.lazy import lazy

torch = lazy("torch")
F = lazy("torch.nn.functional")
safetensors_torch = lazy("safetensors.torch")


def closed_form_candidates(families: list[str], ks: list[int], lambdas: list[float],
                           widths: dict[str, list[int]]) -> list[MapName]:
    """The closed-form grid: per family, k, width (a family with a rank in its name: each of its `widths`), lambda."""
    return [MapName(family, k, lam, width) for family in families for k in ks
            for width in (widths[family] if "rank" in FAMILIES[family].name_fields else [None]) for lam in lambdas]


def mlp_candidates(ks: list[int]) -> list[MapName]:
    return [MapName("mlp", k) for k in ks]


@dataclass
class R2Table:
    """R² per (candidate, layer, kind, head), in and out of sample, in the order recorded."""

    # (layer, candidate, kind, r2 in sample per head, held-out per head, ratio, lambda solved with per head)
    entries: list[tuple] = field(default_factory=list)
    # (layer, candidate, kind, lambda scale, lambda solved with, held-out R² over all heads): a ridge candidate
    # solved with its lambda read both ways, the other only to score it
    scales: list[tuple] = field(default_factory=list)

    def record(self, name: str, layer: int, kind: str, r2_fit: torch.Tensor, r2_sel: torch.Tensor,
               ratio: float, lambdas: list[float] | None = None) -> None:
        self.entries.append((layer, name, kind, r2_fit.tolist(), r2_sel.tolist(), ratio,
                             lambdas or [float("nan")] * len(r2_sel)))

    def extend(self, other: "R2Table") -> None:
        self.entries.extend(other.entries)
        self.scales.extend(other.scales)

    @classmethod
    def merged(cls, tables: list["R2Table"]) -> "R2Table":
        """One table from tables of disjoint layers: layer by layer, each layer's entries in their own order."""
        return cls(sorted((e for table in tables for e in table.entries), key=lambda e: e[0]),
                   sorted((e for table in tables for e in table.scales), key=lambda e: e[0]))

    @property
    def rows(self) -> list[dict]:
        return [{"candidate": name, "layer": layer, "head": head, "kind": kind, "r2_in_sample": round(r_in, 6),
                 "r2_heldout": round(r_out, 6), "param_to_sample_ratio": round(ratio, 6),
                 "ridge_lambda": float(f"{lam:.6g}")}
                for layer, name, kind, r2_fit, r2_sel, ratio, lambdas in self.entries
                for head, (r_in, r_out, lam) in enumerate(zip(r2_fit, r2_sel, lambdas))]

    SCALE_FIELDS = ["candidate", "layer", "kind", "lambda_scale", "ridge_lambda", "r2_heldout"]

    @property
    def scale_rows(self) -> list[dict]:
        return [dict(zip(self.SCALE_FIELDS, (name, layer, kind, scale, float(f"{lam:.6g}"), round(r2, 6))))
                for layer, name, kind, scale, lam, r2 in self.scales]

    @property
    def heldout(self) -> dict[tuple[str, str], list[float]]:
        out: dict[tuple[str, str], list[float]] = {}
        for _, name, kind, _, r2_sel, _, _ in self.entries:
            out.setdefault((name, kind), []).extend(r2_sel)
        return out

    def heldout_by_layer(self, name: str, kind: str) -> list[float]:
        """Held-out R² of candidate `name` per target layer (all heads pooled by their mean), in layer order."""
        return [sum(r2_sel) / len(r2_sel) for _, n, k, _, r2_sel, _, _ in self.entries if (n, k) == (name, kind)]


class Parts:
    """Per-candidate, per-layer tensors spilled to disk, so memory never holds every candidate at once. `fresh`: this
    process owns the folder: starts it empty and removes it at the end of the `with` block, done or interrupted."""

    def __init__(self, folder: Path, fresh: bool = True):
        self.folder, self.fresh = folder, fresh
        if fresh:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)

    def __enter__(self) -> "Parts":
        return self

    def __exit__(self, *exception) -> None:
        if self.fresh:
            shutil.rmtree(self.folder, ignore_errors=True)

    def put(self, candidate: str, layer: int, kind: str, tensors: tuple[torch.Tensor, ...]) -> None:
        named = {str(i): t.to("cpu", torch.float32).contiguous() for i, t in enumerate(tensors)}
        path = self.folder / f"{candidate}.{kind}.{layer:03d}.safetensors"
        safetensors_torch.save_file(named, str(path))
        take_umask(path)  # save_file writes 0600

    def take(self, candidate: str, layers: int, kind: str) -> list[tuple[torch.Tensor, ...]]:
        out = []
        for layer in range(layers):
            path = self.folder / f"{candidate}.{kind}.{layer:03d}.safetensors"
            named = safetensors_torch.load_file(str(path))
            out.append(tuple(named[str(i)] for i in range(len(named))))
            path.unlink()
        return out


def accumulate(summary, pairs: Pairs, layer: int, chosen: list[int], kind: str):
    """Add a split's rows to `summary` (`ridge.Moments` or `ridge.Rows`)."""
    for source, target in pairs:
        x = torch.cat(source.read(kind, chosen), dim=1)  # (tokens, k * Hs*Ds), layer-major as the mapper reads them
        (y,) = target.read(kind, [layer])  # (tokens, Ht*Dt)
        summary.update(x, y)
    return summary


def fit_ridge_layer(layer: int, order: list[int], fit_pairs: Pairs, select_pairs: Pairs,
                    candidates: list[MapName], depth: int, geometry: Geometry, parts: Parts, table: R2Table,
                    device: str | torch.device, lambda_scale: str) -> None:
    """One accumulation over the top `depth` source layers (the largest k of the whole grid, so a narrow refit of one
    candidate sums exactly what the full fit summed), then each candidate's family solves its sub-blocks in float64,
    its lambda read on `lambda_scale`."""
    g = geometry
    chosen_max = sorted(order[:depth])
    in_width, out_width = len(chosen_max) * g.heads_s * g.dim_s, g.heads_t * g.dim_t
    fit_rows, select_rows = (sum(source.tokens for source, _ in pairs) for pairs in (fit_pairs, select_pairs))
    for kind in KINDS:
        fit_m = accumulate(ridge.summary(fit_rows, in_width, out_width, device), fit_pairs, layer, chosen_max, kind)
        select_m = accumulate(ridge.summary(select_rows, in_width, out_width, device), select_pairs, layer,
                              chosen_max, kind)
        for candidate in candidates:
            name, spec = str(candidate), FAMILIES[candidate.family]
            blocks = [chosen_max.index(p) for p in sorted(order[:candidate.k])]
            solved = spec.solve(fit_m, select_m, blocks, candidate.ridge_lambda, g, lambda_scale, ridge, device,
                                candidate.rank)
            if spec.scale_check:  # held-out R² with the lambda as fitted and read the other way: what the scale changes
                inputs, sst_sel = columns(blocks, g, device), ridge.total_ss(select_m)
                own, own_select = fit_m.select(inputs), select_m.select(inputs)
                table.scales.append((layer, name, kind, lambda_scale, solved.lambdas[0],
                                     ridge.pooled_r2(solved.sse_select, sst_sel).item()))
                other = "absolute" if lambda_scale == "relative" else "relative"
                other_lambda = ridge.effective_lambda(own, candidate.ridge_lambda, other)
                try:
                    weight, bias = ridge.solve(own, other_lambda)
                    r2 = ridge.pooled_r2(ridge.residual_ss(own_select, weight, bias), sst_sel).item()
                except ValueError:  # the other reading leaves the system singular (e.g. lambda 0): no map to score
                    r2 = float("nan")
                table.scales.append((layer, name, kind, other, other_lambda, r2))
            parts.put(name, layer, kind, solved.tensors)
            r2_fit = ridge.pooled_r2(solved.sse_fit, ridge.total_ss(fit_m), g.heads_t)
            r2_sel = ridge.pooled_r2(solved.sse_select, ridge.total_ss(select_m), g.heads_t)
            table.record(name, layer, kind, r2_fit, r2_sel, solved.parameters_per_output / fit_m.n, solved.lambdas)


@dataclass
class MlpSettings:
    hidden: int
    lr: float
    batch_rows: int
    max_epochs: int
    patience: int
    seed: int


def train_mlp(x_train: torch.Tensor, y_train: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
              heads: int, settings: MlpSettings) -> tuple[tuple[torch.Tensor, ...], dict]:
    """Fit rows x (N, F) -> y (N, heads * head_dim) on the rows' device: one hidden layer, Adam, early stopping on the
    held-out rows. Inputs are standardized per feature and outputs scaled by one pooled standard deviation (so the loss
    is proportional to the residual sum of squares R² pools), both folded into the weights after training. Returns the
    mapper tensors (in_weight (F, hidden), in_bias (hidden,), weight (heads, hidden, head_dim), bias (heads,
    head_dim)) and training facts. Deterministic given the seed and the thread count."""
    generator = torch.Generator().manual_seed(settings.seed)  # on the CPU: the same draws on every device
    device = x_train.device
    x_mean, x_std = x_train.mean(0), x_train.std(0).clamp_min(1e-6)  # (F,)
    y_mean, y_scale = y_train.mean(0), (y_train - y_train.mean(0)).pow(2).mean().sqrt().clamp_min(1e-6)
    x_train_s, y_train_s = (x_train - x_mean) / x_std, (y_train - y_mean) / y_scale
    x_val_s, y_val_s = (x_val - x_mean) / x_std, (y_val - y_mean) / y_scale

    in_width, out_width = x_train.shape[1], y_train.shape[1]
    w1 = (torch.randn(in_width, settings.hidden, generator=generator) / in_width**0.5).to(device).requires_grad_()
    b1 = torch.zeros(settings.hidden, device=device, requires_grad=True)
    w2 = (torch.randn(settings.hidden, out_width, generator=generator) / settings.hidden**0.5).to(device)
    w2.requires_grad_()
    b2 = torch.zeros(out_width, device=device, requires_grad=True)
    params = [w1, b1, w2, b2]
    optimizer = torch.optim.Adam(params, lr=settings.lr)

    def predict(x: torch.Tensor) -> torch.Tensor:  # (N, out_width)
        return hidden_layer(x, w1, b1) @ w2 + b2

    best_loss, best_epoch, best = float("inf"), -1, [p.detach().clone() for p in params]
    for epoch in range(settings.max_epochs):
        order = torch.randperm(x_train_s.shape[0], generator=generator).to(device)
        for start in range(0, len(order), settings.batch_rows):
            rows = order[start : start + settings.batch_rows]
            loss = F.mse_loss(predict(x_train_s[rows]), y_train_s[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            val_loss = F.mse_loss(predict(x_val_s), y_val_s).item()
        if val_loss < best_loss:
            best_loss, best_epoch, best = val_loss, epoch, [p.detach().clone() for p in params]
        elif epoch - best_epoch >= settings.patience:
            break

    w1, b1, w2, b2 = best
    # fold the standardization: gelu(((x - m) / s) W1 + b1) = gelu(x (W1 / s) + (b1 - (m / s) W1))
    in_weight = w1 / x_std[:, None]  # (F, hidden)
    in_bias = b1 - (x_mean / x_std) @ w1  # (hidden,)
    head_dim = out_width // heads
    weight = (w2 * y_scale).reshape(settings.hidden, heads, head_dim).permute(1, 0, 2).contiguous()  # (H, hidden, D)
    bias = (b2 * y_scale + y_mean).reshape(heads, head_dim)  # (H, D)
    facts = {"best_epoch": best_epoch, "epochs": epoch + 1, "val_loss": best_loss}
    return (in_weight, in_bias, weight, bias), facts


def gather_rows(pairs: Pairs, layer: int, chosen: list[int], kind: str, held: set[str]):
    """x (N, k*Hs*Ds), y (N, Ht*Dt) float32 rows of a split and (N,) bool: rows of `held` sequences."""
    xs, ys, masks = [], [], []
    for source, target in pairs:
        xs.append(torch.cat(source.read(kind, chosen), dim=1))
        ys.append(target.read(kind, [layer])[0])
        masks.append(held_rows(source, held))
    return torch.cat(xs), torch.cat(ys), torch.cat(masks)


def squares(x: torch.Tensor, y: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual and the total sum of squares (float64, per output column) of the mlp map `tensors` on x, y."""
    out = FAMILIES["mlp"].project(x[None], *tensors)[0]  # (Ht, N, Dt)
    predicted = out.permute(1, 0, 2).reshape(x.shape[0], -1)  # (N, Ht*Dt)
    return ((y - predicted) ** 2).double().sum(0), ((y - y.mean(0)) ** 2).double().sum(0)


def fit_mlp_unit(layer: int, order: list[int], k: int, kind: str, fit_pairs: Pairs, select_pairs: Pairs,
                 held: set[str], settings: MlpSettings, heads_t: int, parts: Parts, device) -> tuple[dict, R2Table]:
    """The `mlp_k<k>` map for one target layer and kind, trained with its own seed, put in `parts`; its training facts
    and R² entry. Units share only the caches they read, so several may train side by side in threads."""
    name = str(MapName("mlp", k))
    chosen = sorted(order[:k])
    table = R2Table()
    x, y, mask = (t.to(device) for t in gather_rows(fit_pairs, layer, chosen, kind, held))
    own = replace(settings, seed=settings.seed * 100003 + layer * 2 + KINDS.index(kind))
    tensors, facts = train_mlp(x[~mask], y[~mask], x[mask], y[mask], heads_t, own)
    parts.put(name, layer, kind, tensors)
    x_sel, y_sel = (t.to(device) for t in gather_rows(select_pairs, layer, chosen, kind, set())[:2])
    with torch.no_grad():
        r2_fit = ridge.pooled_r2(*squares(x[~mask], y[~mask], tensors), heads_t)
        r2_sel = ridge.pooled_r2(*squares(x_sel, y_sel, tensors), heads_t)
    n_params = sum(t.numel() for t in tensors)
    table.record(name, layer, kind, r2_fit, r2_sel, n_params / (int((~mask).sum()) * y.shape[1]))
    return facts, table
