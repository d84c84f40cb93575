"""Fit stage: the ridge math against direct solves, probes that find a planted layer, determinism, corruption."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from helpers import ROOT as REPO
from helpers import committed
from helpers.kvworld import make_world

from pipeline import fit as fit_module
from pipeline.extract import run as extract
from pipeline.fit import run as fit
from pipeline.fitting import ridge
from pipeline.fitting.probes import holdout_sequences, probe_r2, ranking, stored_bytes
from pipeline.kv.flops import mapper_macs_per_token, mapper_parameter_count
from pipeline.kv.mapper import load_mapper
from pipeline.schema.extract import ExtractParams
from pipeline.schema.fit import FitParams
from pipeline.store.artifacts import ArtifactError
from pipeline.store.cachefiles import MANIFEST, ShardWriter, paired_split
from pipeline.store.cli import run_stage
from pipeline.store.models import load_config
from pipeline.store.params import ParamError, parse

FIT = committed("fit", ks=[1, 2], lambdas=[0.01, 1.0], families=["linear", "head_matched"], timing_repeats=1, threads=1,
                mlp={"ks": [1], "hidden": 16, "max_epochs": 5})


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
    with pytest.raises(ValueError, match="not absolute or relative"):
        ridge.effective_lambda(_moments(x, y), 0.5, "percent")


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


def _fake_caches(root: Path, planted: dict[int, int], source_layers=4, sequences=8, length=30) -> None:
    """Random source caches; target layer l is an exact linear map of source layer planted[l] (keys and values)."""
    generator = torch.Generator().manual_seed(0)
    heads, dim = 2, 4
    maps = {layer: torch.randn(heads * dim, heads * dim, generator=generator) for layer in planted}
    for name in ("source", "target"):
        meta = {"model": name, "model_path": name,
                "geometry": {"layers": source_layers if name == "source" else len(planted),
                             "kv_heads": heads, "head_dim": dim}, "rotary": {}, "dtype": "float32"}
        writer = ShardWriter(root / name, meta, 3, torch.float32)
        gen = torch.Generator().manual_seed(1)
        writer.begin("fit", [length] * sequences)
        for seq in range(sequences):
            source = [torch.randn(length, heads, dim, generator=gen) for _ in range(2 * source_layers)]
            layers = source if name == "source" else [
                (source[2 * p + kind].reshape(length, -1) @ maps[layer]).reshape(length, heads, dim)
                for layer, p in planted.items() for kind in (0, 1)]
            writer.add(f"d{seq}", f"h{seq}", torch.stack(layers[0::2]), torch.stack(layers[1::2]))
        records = writer.close()
        (root / name / MANIFEST).write_text(json.dumps(dict(meta, splits={"fit": {"shards": records["fit"]}})))


def test_probes_in_many_passes_equal_one_pass_and_compute_each_inputs_gram_once(tmp_path, monkeypatch):
    _fake_caches(tmp_path, {0: 2, 1: 0, 2: 3})
    pairs = paired_split(tmp_path / "source", tmp_path / "target", "fit")
    held = holdout_sequences(pairs, 0.25, seed=0)
    one_pass = probe_r2(pairs, held, 4, 3, 8, 8, 1e-6, budget_bytes=1e9, device="cpu")
    grams = []
    original = ridge.Moments.update
    monkeypatch.setattr(ridge.Moments, "update",
                        lambda self, x, y, inputs=True: (grams.append(inputs), original(self, x, y, inputs))[1])
    three_passes = probe_r2(pairs, held, 4, 3, 8, 8, 1e-6, budget_bytes=1, device="cpu")
    # the same R² (to float64 rounding: the solves see right-hand sides of other widths)
    assert all(torch.allclose(one_pass[kind], three_passes[kind], rtol=1e-12, atol=1e-12) for kind in one_pass)
    shards = len(pairs)
    assert grams.count(True) == shards * 2 * 2 * 4  # shards x kinds x (train, held) x source layers, once
    assert grams.count(False) == 2 * grams.count(True)  # the two later passes add only X^T Y


def test_probes_on_fewer_rows_than_features_equal_probes_from_moments(tmp_path, monkeypatch):
    _fake_caches(tmp_path, {0: 2, 1: 0, 2: 3}, sequences=3, length=2)  # 4 train, 2 held-out rows < 8 features
    pairs = paired_split(tmp_path / "source", tmp_path / "target", "fit")
    held = holdout_sequences(pairs, 0.25, seed=0)
    kinds, original = [], ridge.summary

    def recorded(rows, in_width, out_width, device, force_moments=False):
        made = original(in_width if force_moments else rows, in_width, out_width, device)
        kinds.append(type(made).__name__)
        return made

    monkeypatch.setattr(ridge, "summary", recorded)
    from_rows = probe_r2(pairs, held, 4, 3, 8, 8, 1e-3, budget_bytes=1, device="cpu")
    assert set(kinds) == {"Rows"}
    monkeypatch.setattr(ridge, "summary", lambda *args: recorded(*args, force_moments=True))
    from_moments = probe_r2(pairs, held, 4, 3, 8, 8, 1e-3, budget_bytes=1, device="cpu")
    assert set(kinds) == {"Rows", "Moments"}
    assert all(torch.allclose(from_rows[kind], from_moments[kind], rtol=1e-7, atol=1e-7) for kind in from_rows)


def test_probes_read_the_source_once_when_its_rows_fit_the_budget_with_the_same_scores(tmp_path):
    _fake_caches(tmp_path, {0: 2, 1: 0, 2: 3})

    def probe(rows_budget_bytes):
        pairs = paired_split(tmp_path / "source", tmp_path / "target", "fit")  # fresh read counters
        scores = probe_r2(pairs, holdout_sequences(pairs, 0.25, seed=0), 4, 3, 8, 8, 1e-6, budget_bytes=1,
                          device="cpu", rows_budget_bytes=rows_budget_bytes)  # three passes
        return scores, sum(s.bytes_read for s, _ in pairs) / stored_bytes(pairs, 4, 8)

    (kept, kept_reads), (reread, reread_reads) = probe(1e9), probe(0)
    assert all(torch.equal(kept[kind], reread[kind]) for kind in kept)
    assert (kept_reads, reread_reads) == (1.0, 3.0)  # learning the stored dtype reads no tensor


def test_probe_picks_the_planted_source_layer(tmp_path):
    planted = {0: 2, 1: 0, 2: 3}
    _fake_caches(tmp_path, planted)
    pairs = paired_split(tmp_path / "source", tmp_path / "target", "fit")
    held = holdout_sequences(pairs, 0.25, seed=0)
    # the budget forces one target layer per pass
    scores = probe_r2(pairs, held, 4, 3, 8, 8, 1e-6, budget_bytes=1, device="cpu")
    assert [order[0] for order in ranking(scores)] == [planted[layer] for layer in range(3)]
    for layer, p in planted.items():
        assert scores["keys"][layer, p] > 0.999 and scores["values"][layer, p] > 0.999


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    root = make_world(tmp_path_factory.mktemp("fit"), fit=10, select=4, length=24)
    for name in ("source", "target"):
        extract(root / "models" / name, name, root / "data", root / "caches" / name,
                parse(ExtractParams, committed("extract", shard_sequences=4, repeats=1), "extract"))
    (root / "params.yaml").write_text(yaml.safe_dump({"fit": FIT, "models": committed("models")}))
    return root


def _fit_params():
    return parse(FitParams, FIT, "fit")


def test_fit_writes_every_candidate_with_its_metadata(extracted, tmp_path):
    metrics = fit(extracted / "caches/source", extracted / "caches/target", extracted / "models/source",
                  extracted / "data/select.parquet", tmp_path / "mappers", tmp_path / "metrics", _fit_params(), {},
                  "cpu", "float32")
    names = sorted(p.stem for p in (tmp_path / "mappers").glob("*.safetensors"))
    assert names == sorted([f"{f}_k{k}_lam{lam}" for f in ("linear", "head_matched") for k in (1, 2)
                            for lam in ("0.01", "1")] + ["mlp_k1"])
    mapper = load_mapper(tmp_path / "mappers" / "linear_k2_lam0.01.safetensors")
    assert mapper.k == 2 and all(len(chosen) == 2 for chosen in mapper.source_layers)
    assert metrics["maps/linear_k2_lam0.01/params"] == mapper.parameter_count()
    configs = [load_config(str(extracted / "models" / name)) for name in ("source", "target")]
    for name, family, k in (("linear_k2_lam0.01", "linear", 2), ("head_matched_k1_lam1", "head_matched", 1),
                            ("mlp_k1", "mlp", 1)):  # the sizes check_pair predicts from configs alone
        hidden = FIT["mlp"]["hidden"]
        assert metrics[f"maps/{name}/params"] == mapper_parameter_count(*configs, k, family, hidden), name
        assert metrics[f"maps/{name}/macs_per_token"] == mapper_macs_per_token(*configs, k, family, hidden)
    layers_csv = (tmp_path / "metrics" / "fit_layers.csv").read_text().splitlines()
    assert layers_csv[0] == "candidate,layer,head,kind,r2_in_sample,r2_heldout,param_to_sample_ratio,ridge_lambda"
    assert len(layers_csv) == 1 + 9 * 2 * 2 * 2  # candidates x layers x heads x kinds
    assert metrics["lambda_scale"] == "relative" and mapper.extra["lambda_scale"] == "relative"
    for family in ("linear", "head_matched"):
        for k in (1, 2):
            assert metrics[f"chosen/{family}_k{k}/lambda"] in FIT["lambdas"]
            assert all(-1 < metrics[f"chosen/{family}_k{k}/r2_{kind}_layer{layer}"] <= 1
                       for kind in ("keys", "values") for layer in (0, 1))
    scales = pd.read_csv(tmp_path / "metrics" / "fit_lambda_scale.csv")
    assert len(scales) == 4 * 2 * 2 * 2  # linear candidates x layers x kinds x (relative, absolute)
    both = scales.pivot_table(index=["candidate", "layer", "kind"], columns="lambda_scale", values="ridge_lambda")
    assert (both.relative > both.absolute).all()  # the mean centered Gram diagonal of these caches is above 1
    assert {f"lambda_scale_check/linear_k2/{scale}/values_worst_layer_r2" for scale in ("relative", "absolute")} \
        <= set(metrics)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_every_file_fit_writes_takes_the_mode_the_umask_gives(extracted, tmp_path, mask, mode):
    """safetensors' `save_file` writes 0600: a map, a layer's spilled tensors or a metrics file must not."""
    params = parse(FitParams, {**FIT, "ks": [1], "families": ["linear"], "mlp": {**FIT["mlp"], "ks": [1]}}, "fit")
    before = os.umask(mask)
    try:
        fit(extracted / "caches/source", extracted / "caches/target", extracted / "models/source",
            extracted / "data/select.parquet", tmp_path / "mappers", tmp_path / "metrics", params, {}, "cpu",
            "float32")
    finally:
        os.umask(before)
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(path.suffix == ".safetensors" for path in written) and any(path.suffix == ".csv" for path in written)
    assert {path.name: oct(path.stat().st_mode & 0o777) for path in written} == {path.name: oct(mode)
                                                                                 for path in written}


def test_a_family_the_contract_leaves_undefined_is_skipped_with_its_reason(extracted, tmp_path):
    reason = "head_matched needs equal KV head counts, but ..."
    metrics = fit(extracted / "caches/source", extracted / "caches/target", extracted / "models/source",
                  extracted / "data/select.parquet", tmp_path / "mappers", tmp_path / "metrics", _fit_params(),
                  {"head_matched": reason}, "cpu", "float32")
    names = sorted(p.stem for p in (tmp_path / "mappers").glob("*.safetensors"))
    assert not [n for n in names if n.startswith("head_matched")] and "linear_k1_lam1" in names
    assert metrics["skipped/head_matched"] == reason


def test_fitting_twice_in_two_processes_gives_identical_files_and_a_narrow_refit_the_same_bytes(extracted,
                                                                                                 monkeypatch):
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    for run_dir in ("run1", "run2"):
        subprocess.run([sys.executable, "-c", "import pipeline.fit as f; f.main()"], cwd=extracted, check=True,
                       env=env, capture_output=True)
        (extracted / "models" / "mappers").rename(extracted / run_dir)
    first = sorted((extracted / "run1").glob("*.safetensors"))
    assert len(first) == 9
    for path in first:
        assert path.read_bytes() == (extracted / "run2" / path.name).read_bytes(), path.name
    # the determinism control's narrow refit: one candidate alone, the same bytes as from the whole grid (here in
    # this process, as store.cli.run_stage runs it; the two processes above are the cross-process check)
    monkeypatch.chdir(extracted)
    for name in ("linear_k1_lam0.01", "head_matched_k2_lam1", "mlp_k1"):
        run_stage("pipeline.fit", "--out", "narrow", "--only", name)
        assert [p.name for p in (extracted / "narrow").glob("*.safetensors")] == [f"{name}.safetensors"]
        assert (extracted / "narrow" / f"{name}.safetensors").read_bytes() == \
               (extracted / "run1" / f"{name}.safetensors").read_bytes(), name
        shutil.rmtree(extracted / "narrow")
    with pytest.raises(ParamError, match="fit --only linear_k9_lam1: not a candidate"):
        run_stage("pipeline.fit", "--out", "narrow", "--only", "linear_k9_lam1")


def test_mlp_maps_trained_side_by_side_in_threads_are_the_bytes_of_one_thread(extracted, tmp_path):
    written = {}
    for workers in (1, 3):
        params = parse(FitParams, {**FIT, "mlp": {**FIT["mlp"], "ks": [1, 2], "workers": workers}}, "fit")
        out = tmp_path / str(workers)
        fit(extracted / "caches/source", extracted / "caches/target", extracted / "models/source",
            extracted / "data/select.parquet", out / "mappers", out / "metrics", params, {}, "cpu", "float32")
        written[workers] = {path.relative_to(out): path.read_bytes() for path in sorted(out.rglob("*.*"))
                            if path.suffix in (".safetensors", ".csv")}
    assert [p.name for p in written[1] if p.name.startswith("mlp")] == ["mlp_k1.safetensors", "mlp_k2.safetensors"]
    assert written[3] == written[1]  # every map, and the R² tables in the order one thread records them


def test_a_failing_layer_cancels_the_mlp_trainings_not_yet_started(extracted, tmp_path, monkeypatch):
    started, real = [], fit_module.fit_mlp_unit

    def slow_unit(*args, **kwargs):
        started.append(args[:4])
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(fit_module, "fit_mlp_unit", slow_unit)
    monkeypatch.setattr(fit_module, "fit_ridge_layer", lambda *args: 1 / 0)
    params = parse(FitParams, {**FIT, "mlp": {**FIT["mlp"], "ks": [1, 2], "workers": 1}}, "fit")
    with pytest.raises(ZeroDivisionError):
        fit(extracted / "caches/source", extracted / "caches/target", extracted / "models/source",
            extracted / "data/select.parquet", tmp_path / "mappers", tmp_path / "metrics", params, {}, "cpu",
            "float32")
    assert 1 <= len(started) <= 2  # of 8 queued: the one in flight finishes, the others never start


def test_caches_of_two_key_spaces_are_refused_before_any_fit(extracted, tmp_path):
    extract(extracted / "models/source", "source", extracted / "data", tmp_path / "rotated",
            parse(ExtractParams, committed("extract", shard_sequences=4, repeats=1), "extract"), keep_rope=True)
    with pytest.raises(ArtifactError, match=r"holds rotated .* keys, .*content .*; extract both the same way"):
        fit(tmp_path / "rotated", extracted / "caches/target", extracted / "models/source",
            extracted / "data/select.parquet", tmp_path / "mappers", tmp_path / "metrics", _fit_params(), {}, "cpu",
            "float32")
    assert not (tmp_path / "mappers").exists()


def test_corrupted_cache_shard_stops_fit_naming_it(extracted, tmp_path):
    import shutil

    caches = tmp_path / "caches"
    shutil.copytree(extracted / "caches", caches)
    shard = caches / "target" / "fit" / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="shard-00001.safetensors: checksum mismatch"):
        fit(caches / "source", caches / "target", extracted / "models/source", extracted / "data/select.parquet",
            tmp_path / "mappers", tmp_path / "metrics", _fit_params(), {}, "cpu", "float32")
