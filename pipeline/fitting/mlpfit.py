"""Training the `mlp` mapper family for one target layer and kind: one hidden layer, Adam, early stopping on held-out
fit sequences. Inputs are standardized per feature and outputs scaled by one pooled standard deviation (so the loss is
proportional to the residual sum of squares R² pools), both folded into the weights after training. Deterministic
given the seed and the thread count."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.kv.families import hidden_layer
from pipeline.store.lazy import lazy

torch = lazy("torch")
F = lazy("torch.nn.functional")


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
    """Fit rows x (N, F) -> y (N, heads * head_dim) on the rows' device. Returns the mapper tensors (in_weight
    (F, hidden), in_bias (hidden,), weight (heads, hidden, head_dim), bias (heads, head_dim)) and training facts."""
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
