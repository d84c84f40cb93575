"""The maths of `mlp` (`kv/families/mlp.py`): one hidden layer shared by a layer's target heads (trained by
`fitting.mlpfit`, which reads `hidden_layer` from here)."""
from __future__ import annotations

from pipeline.kv.families import mlp
from pipeline.kv.families.maths.base import FamilyMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


def hidden_layer(inputs: torch.Tensor, in_weight: torch.Tensor, in_bias: torch.Tensor) -> torch.Tensor:
    """The hidden layer, (..., F) -> (..., hidden): the same op when training and when mapping."""
    return torch.nn.functional.gelu(inputs @ in_weight + in_bias)


class MlpMaths(FamilyMaths):
    declaration = mlp.FAMILY

    def project(self, inputs: torch.Tensor, in_weight: torch.Tensor, in_bias: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
        hidden = hidden_layer(inputs.to(weight.dtype), in_weight, in_bias)  # (B, T, hidden)
        out = torch.einsum("btf,hfd->bhtd", hidden, weight)  # (B, H_t, T, D_t)
        return out + bias[None, :, None, :]


MATHS = MlpMaths()
