"""Ridge from streamed moments (`fitting.ridge`) against direct solves: streamed and one-shot fits, per-head
solves, residuals, the relative lambda, and the dual solve from rows."""
from __future__ import annotations

import pytest
import torch

from pipeline.fitting import ridge


def _data(rows=200, features=6, outputs=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=generator, dtype=torch.float64) * 3 + 1
    y = x @ torch.randn(features, outputs, generator=generator, dtype=torch.float64) + 5
    return x, y + 0.5 * torch.randn(rows, outputs, generator=generator, dtype=torch.float64)


def _moments(x, y, chunks=1):
    m = ridge.Moments.zeros(x.shape[1], y.shape[1], "cpu")
    for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
        m.update(xs, ys)
    return m


def test_ridge_equals_least_squares_on_the_augmented_system():
    x, y = _data()
    lam = 3.0
    weight, bias = ridge.solve(_moments(x, y), lam)
    # [X - mean, 1; sqrt(lam) I, 0] [W; b'] = [Y; 0]: penalty on W only, bias free
    xc = x - x.mean(0)
    a = torch.cat([torch.cat([xc, torch.ones(len(x), 1, dtype=x.dtype)], 1),
                   torch.cat([lam**0.5 * torch.eye(x.shape[1], dtype=x.dtype),
                              torch.zeros(x.shape[1], 1, dtype=x.dtype)], 1)])
    b = torch.cat([y, torch.zeros(x.shape[1], y.shape[1], dtype=x.dtype)])
    solution = torch.linalg.lstsq(a, b).solution
    assert torch.allclose(weight, solution[:-1], atol=1e-9)
    assert torch.allclose(bias, solution[-1] - x.mean(0) @ solution[:-1], atol=1e-9)


def test_streamed_accumulation_equals_one_shot_fit():
    x, y = _data()
    one = ridge.solve(_moments(x, y), 0.1)
    streamed = ridge.solve(_moments(x, y, chunks=7), 0.1)
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(one, streamed))


def test_one_layer_solve_equals_separate_per_head_solves():
    x, y = _data(outputs=6)  # 3 heads of width 2
    m = _moments(x, y)
    weight, bias = ridge.solve(m, 1.0)
    for head in range(3):
        cols = torch.arange(2 * head, 2 * head + 2)
        w_head, b_head = ridge.solve(m.select(outputs=cols), 1.0)
        assert torch.allclose(weight[:, cols], w_head, atol=1e-12) and torch.allclose(bias[cols], b_head, atol=1e-12)


def test_residuals_from_moments_equal_direct_residuals():
    x, y = _data()
    weight, bias = ridge.solve(_moments(x, y), 1.0)
    x2, y2 = _data(seed=1)
    direct = ((y2 - x2 @ weight - bias) ** 2).sum(0)
    assert torch.allclose(ridge.residual_ss(_moments(x2, y2), weight, bias), direct, rtol=1e-9)
    assert torch.allclose(ridge.total_ss(_moments(x2, y2)), ((y2 - y2.mean(0)) ** 2).sum(0), rtol=1e-9)


def test_in_sample_residuals_from_the_normal_equations_equal_residuals_from_moments():
    x, y = _data()
    m = _moments(x, y)
    for lam in (0.0, 0.1, 10.0):
        weight, bias = ridge.solve(m, lam)
        assert torch.allclose(ridge.fitted_residual_ss(m, weight, bias, lam), ridge.residual_ss(m, weight, bias),
                              rtol=1e-9)
    weight, bias = ridge.solve(m, 10.0)  # the shortcut holds for the lambda it was solved with only
    assert not torch.allclose(ridge.fitted_residual_ss(m, weight, bias, 0.1), ridge.residual_ss(m, weight, bias),
                              rtol=1e-3)


def _rows(x, y, chunk=3):
    rows = ridge.Rows([], [], "cpu")
    for start in range(0, x.shape[0], chunk):
        rows.update(x[start : start + chunk], y[start : start + chunk])
    return rows


def test_a_relative_lambda_is_the_absolute_lambda_times_the_mean_centered_gram_diagonal():
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [1.0, 2.0], [-1.0, -2.0]], dtype=torch.float64) + 3
    y = torch.tensor([[1.0], [2.0], [0.0], [5.0]], dtype=torch.float64)
    # centered columns: (1, -1, 1, -1) and (0, 0, 2, -2): sums of squares 4 and 8, mean 6
    for summary in (_moments(x, y), _rows(x, y)):
        assert ridge.gram_scale(summary) == pytest.approx(6.0)
        assert ridge.effective_lambda(summary, 0.5, "relative") == pytest.approx(3.0)
        assert ridge.effective_lambda(summary, 0.5, "absolute") == 0.5


def test_a_relative_lambda_gives_the_same_predictions_whatever_the_inputs_scale_and_an_absolute_one_does_not():
    x, y = _data()
    predictions = {}
    for scale in ("relative", "absolute"):
        for factor in (1.0, 0.01):  # the same features in other units
            m = _moments(x * factor, y)
            weight, bias = ridge.solve(m, ridge.effective_lambda(m, 0.05, scale))
            predictions[scale, factor] = x * factor @ weight + bias
    assert torch.allclose(predictions["relative", 1.0], predictions["relative", 0.01], atol=1e-8)
    assert not torch.allclose(predictions["absolute", 1.0], predictions["absolute", 0.01], atol=1e-3)


def test_fewer_rows_than_features_are_kept_as_rows_and_more_as_moments():
    assert isinstance(ridge.summary(5, 6, 4, "cpu"), ridge.Rows)
    assert isinstance(ridge.summary(6, 6, 4, "cpu"), ridge.Moments)


def test_the_dual_solve_from_rows_equals_the_primal_solve_from_moments():
    x, y = _data(rows=12, features=30)  # fewer rows than features: the small-calibration regime at real widths
    for lam in (0.01, 1.0, 100.0):
        from_rows, from_moments = ridge.solve(_rows(x, y), lam), ridge.solve(_moments(x, y), lam)
        assert all(torch.allclose(a, b, rtol=1e-8, atol=1e-10) for a, b in zip(from_rows, from_moments))
    with pytest.raises(ValueError, match="not positive definite"):
        ridge.solve(_rows(x, y), 0.0)  # centered rows of rank < N: no exact fit without a penalty, as from moments
    assert not torch.allclose(ridge.solve(_rows(x, y), 1.0)[0], ridge.solve(_rows(x, y), 100.0)[0], rtol=1e-3)


def test_scores_from_rows_equal_scores_from_moments():
    x, y = _data()
    weight, bias = ridge.solve(_moments(x, y), 1.0)
    few_x, few_y = x[:5], y[:5]
    rows, moments = _rows(few_x, few_y), _moments(few_x, few_y)
    assert torch.allclose(ridge.residual_ss(rows, weight, bias), ridge.residual_ss(moments, weight, bias), rtol=1e-9)
    assert torch.allclose(ridge.total_ss(rows), ridge.total_ss(moments), rtol=1e-9)
    cols, outs = torch.tensor([0, 2, 3]), torch.tensor([1, 0])
    w_sub, b_sub = ridge.solve(_moments(x, y).select(cols, outs), 1.0)
    assert torch.allclose(ridge.residual_ss(rows.select(cols, outs), w_sub, b_sub),
                          ridge.residual_ss(moments.select(cols, outs), w_sub, b_sub), rtol=1e-9)
    lam = 0.5
    weight, bias = ridge.solve(_rows(few_x, few_y), lam)
    assert torch.allclose(ridge.fitted_residual_ss(rows, weight, bias, lam),
                          ridge.residual_ss(moments, weight, bias), rtol=1e-6, atol=1e-9)
    assert not torch.allclose(ridge.residual_ss(rows, weight, bias), ridge.residual_ss(rows, weight, bias + 0.1))
