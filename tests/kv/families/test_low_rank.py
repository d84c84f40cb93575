"""The low-rank family's closed form (`kv/families/low_rank.py`): at full rank it is the linear map, and a
reduced-rank map is the ridge map projected on the top principal directions of its fitted values."""
from __future__ import annotations

import pytest
import torch

from pipeline.fitting import ridge
from pipeline.kv.families.base import Geometry
from pipeline.kv.families.maths.registry import FAMILY_MATHS

GEOMETRY = Geometry(heads_s=2, dim_s=3, heads_t=2, dim_t=4)  # F = 6 inputs per source layer, 8 outputs


def _moments(rows: int = 200, seed: int = 0):
    """Moments of correlated rows: x (N, 6) and y = x W + noise (N, 8), W of full rank."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 6, generator=generator, dtype=torch.float64) @ torch.randn(6, 6, generator=generator,
                                                                                     dtype=torch.float64)
    y = x @ torch.randn(6, 8, generator=generator, dtype=torch.float64) + 0.1 * torch.randn(
        rows, 8, generator=generator, dtype=torch.float64) + 3.0
    moments = ridge.Moments.zeros(6, 8, "cpu")
    moments.update(x, y)
    return x, y, moments


def _predict(family: str, tensors: tuple, x: torch.Tensor) -> torch.Tensor:
    return FAMILY_MATHS[family].project(x[None], *tensors)[0].permute(1, 0, 2).reshape(len(x), -1)  # (N, H*D)


def _solve(family: str, moments, width):
    return FAMILY_MATHS[family].solve(moments, moments, [0], 1e-3, GEOMETRY, "relative", ridge, "cpu", width)


def test_the_low_rank_map_at_full_rank_is_the_linear_map():
    x, _, moments = _moments()
    linear, low_rank = _solve("linear", moments, None), _solve("low_rank", moments, 8)
    assert torch.allclose(_predict("linear", linear.tensors, x), _predict("low_rank", low_rank.tensors, x),
                          atol=1e-8)
    assert torch.allclose(linear.sse_fit, low_rank.sse_fit, rtol=1e-6)


@pytest.mark.parametrize("rank", [1, 3])
def test_the_low_rank_map_keeps_the_top_principal_directions_of_the_fitted_values(rank):
    x, y, moments = _moments()
    fitted = _predict("linear", _solve("linear", moments, None).tensors, x)  # (N, 8)
    centered = fitted - fitted.mean(0)
    _, _, directions = torch.linalg.svd(centered, full_matrices=False)  # rows: principal directions
    top = directions[:rank].T  # (8, r)
    expected = centered @ top @ top.T + fitted.mean(0)  # the fitted values projected, their means kept
    solved = _solve("low_rank", moments, rank)
    assert torch.allclose(_predict("low_rank", solved.tensors, x), expected, atol=1e-8)
    assert solved.tensors[0].shape == (6, rank) and solved.tensors[1].shape == (2, rank, 4)
    sse = ((y - expected) ** 2).sum(0)  # the residuals the solve reports, from moments alone
    assert torch.allclose(solved.sse_fit, sse, rtol=1e-6)
