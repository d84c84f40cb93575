"""Fit stage: every candidate written with its metadata and the umask's mode, a family the contract leaves undefined
skipped with its reason, determinism across processes and threads, corruption stopped; its params' families."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pandas as pd
import pytest
import yaml
from helpers import ROOT as REPO
from helpers import committed
from helpers.kvworld import make_world

from pipeline import fit as fit_module
from pipeline.extract import run as extract
from pipeline.fit import run as fit
from pipeline.kv.families import CLOSED_FORM, FITTED_FAMILIES
from pipeline.kv.flops import mapper_macs_per_token, mapper_parameter_count
from pipeline.kv.mapnames import MapName
from pipeline.kv.mapper import load_mapper
from pipeline.schema.extract import ExtractParams
from pipeline.schema.fit import FitParams
from pipeline.store.artifacts import ArtifactError
from pipeline.store.cli import run_stage
from pipeline.store.models import load_config
from pipeline.store.params import ParamError, parse, read_params

FIT = committed("fit", ks=[1, 2], lambdas=[0.01, 1.0], families=["linear", "head_matched"], timing_repeats=1,
                mlp={"ks": [1], "hidden": 16, "max_epochs": 5})


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    root = make_world(tmp_path_factory.mktemp("fit"), fit=10, select=4, length=24)
    for name in ("source", "target"):
        extract(root / "models" / name, name, root / "data", root / "caches" / name,
                parse(ExtractParams, committed("extract", shard_sequences=4, repeats=1), "extract"))
    sections = {"fit": FIT, "models": committed("models"), "machine": committed("machine")}
    (root / "params.yaml").write_text(yaml.safe_dump(sections))
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


def test_fit_params_take_every_closed_form_family_and_refuse_another():
    fit = read_params()["fit"]
    parsed = parse(FitParams, dict(fit, families=list(CLOSED_FORM)), "fit")
    assert {MapName.parse(name).family for name in parsed.candidates()} == set(FITTED_FAMILIES)
    with pytest.raises(ParamError, match="fit.families"):
        parse(FitParams, dict(fit, families=["mlp"]), "fit")


def test_an_empty_mlp_section_names_its_first_key():
    with pytest.raises(ParamError, match=r"fit\.mlp\.ks: missing parameter"):
        parse(FitParams, committed("fit", mlp={}) | {"mlp": {}}, "fit")
