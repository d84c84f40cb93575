"""The latency stage on tiny random models: outputs, each handoff's parts summing to its total and counted in
multiply-adds, refusals.

No test asserts a speed: timings on a shared CPU are noise at these sizes.
"""
import json
import math

import pytest
import torch
import yaml
from helpers import build_model, tiny_config

from pipeline import latency
from pipeline.kv.mapper import random_mapper, save_mapper
from pipeline.store.artifacts import ArtifactError
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.params import ParamError

VOCAB = 97
LENGTHS = [8, 40]
PER_LENGTH = ("target_ms", "target_iqr_ms", "handoff_ms", "handoff_iqr_ms", "source_ms", "map_ms", "step_ms",
              "map_share", "speedup", "bound", "fraction_of_bound", "cache_mib", "target_peak_mib", "handoff_peak_mib")


@pytest.fixture(scope="module")
def pair():
    return build_model(tiny_config(VOCAB, 64), seed=1), build_model(tiny_config(VOCAB, 32), seed=2)


@pytest.fixture
def stage_dir(tmp_path, monkeypatch, pair, tokenizer):
    target, source = pair
    for side, model in (("target", target), ("source", source)):  # a model folder as prepare_models leaves it
        model.save_pretrained(tmp_path / "models" / side)
        tokenizer.save_pretrained(tmp_path / "models" / side)
    mapper = random_mapper(source.config, target.config, k=1)
    # bound to the pair it is used with, as a fitted map is (kv.pair refuses a map of other models)
    mapper.models = pair_fingerprints(str(tmp_path / "models" / "source"), str(tmp_path / "models" / "target"))
    save_mapper(mapper, tmp_path / "models" / "mapper.safetensors")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)  # the stage sets the process's thread count


REPAIR = "tokens:0.25:source_attention"
LOOKAHEAD = {"last": 2, "sinks": 1, "layers": "all", "pooling": "max"}


def _write_params(root, **section):
    settings = {"lengths": LENGTHS, "warmup": 1, "repeats": 2, "dtype": "float32",
                "mapper": "models/mapper.safetensors", "repairs": [REPAIR], "speculative": [0.5]}
    machine = {"device": "cpu", "threads": 1}
    (root / "params.yaml").write_text(yaml.safe_dump({"latency": {**settings, **section}, "machine": machine}))
    (root / "models" / "lookahead.json").write_text(json.dumps(LOOKAHEAD))  # the settings select chose


def test_the_stage_reads_the_look_ahead_settings_select_chose_and_names_select_where_they_are_missing(stage_dir):
    _write_params(stage_dir)
    (stage_dir / "models" / "lookahead.json").unlink()
    with pytest.raises(ArtifactError, match=r"^models/lookahead\.json not found; run the select stage$"):
        latency.main([])


def test_stage_writes_every_expected_key_finite_and_positive(stage_dir):
    _write_params(stage_dir)
    latency.main([])
    metrics = json.loads((stage_dir / "metrics" / "latency.json").read_text())
    assert sorted(metrics["by_length"]) == sorted(map(str, LENGTHS))
    for length in LENGTHS:
        for name in PER_LENGTH:
            value = metrics["by_length"][str(length)][name]
            assert math.isfinite(value) and value > 0, f"by_length/{length}/{name} = {value}"
    assert metrics["threads"] == 1 and metrics["device"] == "cpu" and metrics["dtype"] == "float32"
    assert metrics["torch_version"] == torch.__version__
    table = (stage_dir / "plots" / "latency.csv").read_text().splitlines()
    assert table[0].startswith("length,target_ms,") and len(table) == 1 + len(LENGTHS)
    assert (stage_dir / "plots" / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_handoff_parts_sum_to_its_total(stage_dir):
    _write_params(stage_dir)
    latency.main([])
    metrics = json.loads((stage_dir / "metrics" / "latency.json").read_text())
    for length in LENGTHS:
        row = metrics["by_length"][str(length)]
        parts = sum(row[f"{part}_ms"] for part in ("source", "map", "step"))
        # with two repeats the median is the mean, and the parts of each repeat tile its total exactly
        assert parts == pytest.approx(row["handoff_ms"], rel=1e-9)
        for name, each in row["parts"].items():
            assert sum(part["ms"] for part in each["parts"].values()) == pytest.approx(each["handoff_ms"], rel=1e-9)
        assert row["parts"]["mapped"]["handoff_ms"] == row["handoff_ms"]


def test_each_handoff_is_decomposed_into_the_parts_its_kind_has_each_with_its_share_of_the_multiply_adds(stage_dir):
    _write_params(stage_dir)
    latency.main([])
    for length in LENGTHS:
        row = json.loads((stage_dir / "metrics" / "latency.json").read_text())["by_length"][str(length)]
        kinds = {name: set(each["parts"]) for name, each in row["parts"].items()}
        assert kinds == {"mapped": {"prefill", "map", "step"},
                         f"mapped+{REPAIR}": {"prefill", "scores", "map", "repair", "step"},
                         "speculative:0.5": {"prefill", "scores", "sparse", "step"}}
        for each in row["parts"].values():
            shares = [part["macs_share"] for part in each["parts"].values()]
            assert all(share > 0 for share in shares)
            assert each["bound"] == pytest.approx(1 / sum(shares), rel=1e-9)  # the parts are the whole count
            for part in each["parts"].values():
                assert part["ratio"] == pytest.approx(part["time_share"] / part["macs_share"], rel=1e-9)


@pytest.mark.parametrize("lengths, message", [
    ([1, 128], r"latency.lengths\[0\]: expected a number >= 2"),
    ([], "latency.lengths: expected at least one prompt length"),
    ([128, 128], "repeated prompt length"),
    (["128"], r"latency.lengths\[0\]: expected an integer"),
])
def test_bad_length_param_is_refused_naming_the_key(stage_dir, lengths, message):
    _write_params(stage_dir, lengths=lengths)
    with pytest.raises(ParamError, match=message):
        latency.main([])


@pytest.mark.parametrize("section, message", [
    ({"repairs": ["none"]}, "latency.repairs: drop `none`"),
    ({"repairs": ["tokens:2:recency"]}, "latency.repairs: "),
    ({"speculative": [0.5, 0.5]}, "a setting is listed twice"),
    ({"speculative": [0]}, r"latency.speculative\[0\]"),
])
def test_a_bad_rival_is_refused_naming_the_key(stage_dir, section, message):
    _write_params(stage_dir, **section)
    with pytest.raises(ParamError, match=message):
        latency.main([])


def test_bad_cli_length_is_refused(capsys):
    with pytest.raises(SystemExit):
        latency.main(["--config-shapes", "qwen3-v0", "--device", "cpu", "--lengths", "512,1"])
    assert "--lengths[1]: expected an integer >= 2" in capsys.readouterr().err
