"""The pair checker: a verdict never rests on a tokenizer that is not there, a bad model folder is one line naming
it (in the stages' loaders too), the window is checked against the run length params give, every refusal names all
it refuses, and the contract is printed from stored configs."""
import json
import shutil
import sys

import pytest
import yaml
from helpers import ROOT, train_tokenizer
from helpers.architectures import config_of
from importgraph import stage_module
from transformers import AutoConfig, AutoTokenizer

from pipeline import check_pair
from pipeline.kv.contract import UnsupportedModelError, run_length
from pipeline.kv.flops import mapper_parameter_count
from pipeline.store.cli import entry
from pipeline.store.models import (
    ModelFolderError,
    ModelNotAvailableError,
    NoTokenizerError,
    load_config,
    load_model,
    load_tokenizer,
)
from pipeline.store.shapes import pair_configs

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
# the model types for which transformers 5 builds a stand-in tokenizer from a folder holding only config.json
STAND_IN_TYPES = ("qwen2", "qwen3", "gemma", "gpt2", "phi", "qwen2_moe", "qwen3_moe")
FLAGS = ["--ks", "1", "--lengths", "512", "--mlp-hidden", "64"]


def config_folder(folder, model_type="qwen3", **fields):
    """A model folder holding its config.json alone (no weights, no tokenizer files)."""
    AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
    return str(folder)


def run_check_pair(capsys, *argv):
    """check_pair as its command line runs it: (exit status, stdout, stderr)."""
    status = 0
    try:
        entry_argv, sys.argv = sys.argv, ["check_pair", *argv]
        entry(check_pair.main)
    except SystemExit as stop:
        status = stop.code
    finally:
        sys.argv = entry_argv
    out = capsys.readouterr()
    return status, out.out, out.err


# ---- item: tokenizers that are not there ----------------------------------------------------------------------


@pytest.mark.parametrize("model_type", STAND_IN_TYPES)
def test_a_folder_with_only_a_config_has_no_tokenizer_though_transformers_builds_a_stand_in(tmp_path, model_type):
    folder = config_folder(tmp_path, model_type)
    assert len(AutoTokenizer.from_pretrained(folder).get_vocab()) <= 5  # the stand-in the contract must never see
    with pytest.raises(NoTokenizerError, match=f"model folder {folder} holds no tokenizer files"):
        load_tokenizer(folder)
    assert check_pair.read(folder)[1] is None


def test_two_qwen25_sizes_without_tokenizer_files_are_unchecked_naming_the_vocabulary_sizes(tmp_path, capsys):
    source = config_folder(tmp_path / "qwen2.5-1.5b", "qwen2", **{**SMALL, "vocab_size": 151936})
    target = config_folder(tmp_path / "qwen2.5-7b", "qwen2", **{**SMALL, "vocab_size": 152064})
    status, out, _ = run_check_pair(capsys, source, target, *FLAGS)
    assert status == 0 and "| mapped | yes |" in out
    assert (f"tokenizers: unchecked (no tokenizer for source {source!r} and target {target!r}; the configs differ "
            f"in vocabulary sizes 151936 vs 152064)") in out


def test_one_tokenizer_under_a_padded_embedding_is_identical_and_accepted(tmp_path, capsys, tokenizer):
    folders = [config_folder(tmp_path / name, "qwen2", **{**SMALL, "vocab_size": size})
               for name, size in (("small", 1024), ("padded", 1152))]
    for folder in folders:
        tokenizer.save_pretrained(folder)
    status, out, _ = run_check_pair(capsys, *folders, *FLAGS)
    assert status == 0 and "tokenizers: identical\n" in out and "| mapped | yes |" in out


def test_the_tiny_pair_with_a_target_folder_of_only_its_config_is_unchecked_not_different(tmp_path, capsys,
                                                                                           tiny_pair):
    (tmp_path / "target").mkdir()
    shutil.copy(tiny_pair["target"] / "config.json", tmp_path / "target")
    status, out, _ = run_check_pair(capsys, str(tiny_pair["source"]), str(tmp_path / "target"), *FLAGS)
    assert status == 0 and "| mapped | yes |" in out
    assert f"tokenizers: unchecked (no tokenizer for target {str(tmp_path / 'target')!r}; the configs agree" in out


def test_two_different_tokenizers_present_refuse_the_pair(tmp_path, capsys, tiny_pair):
    other = tmp_path / "other"
    shutil.copytree(tiny_pair["target"], other)
    train_tokenizer(["some other words entirely"] * 5, vocab_size=280).save_pretrained(other)
    status, out, err = run_check_pair(capsys, str(tiny_pair["source"]), str(other), *FLAGS)
    assert status == 2 and "tokenizers: different" in out
    assert err.startswith("error: ") and "different tokenizers" in err


def test_a_broken_tokenizer_file_is_one_error_line_not_a_missing_tokenizer(tmp_path, capsys, tiny_pair):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pair["target"], broken)
    (broken / "tokenizer.json").write_text((broken / "tokenizer.json").read_text()[:-200])
    status, _, err = run_check_pair(capsys, str(tiny_pair["source"]), str(broken), *FLAGS)
    assert status == 2 and err.startswith(f"error: model folder {broken}: its tokenizer cannot be loaded")
    assert err.count("\n") == 1


# ---- item: a bad model folder is one line -----------------------------------------------------------------------


BAD_FOLDERS = {  # config.json's text (None: an empty folder), and what the one line must say
    "malformed": ('{"model_type": "qwen3",', "not valid JSON"),
    "empty": (None, "holds no config.json (it is empty)"),
    "no-model-type": ('{"hidden_size": 64}', "without a model_type"),
    "json-list": ("[1, 2]", "holding a JSON list"),
    "internlm2.5": (json.dumps({"model_type": "internlm2", "architectures": ["InternLM2ForCausalLM"]}),
                    "model_type 'internlm2', an architecture transformers"),
    "phi-3-small": (json.dumps({"model_type": "phi3small", "auto_map": {
        "AutoConfig": "configuration_phi3_small.Phi3SmallConfig",
        "AutoModelForCausalLM": "modeling_phi3_small.Phi3SmallForCausalLM"}}), "runs no remote code"),
}


@pytest.mark.parametrize("name", sorted(BAD_FOLDERS))
def test_a_bad_model_folder_is_one_error_line_naming_it_in_check_pair_and_in_the_stages_loader(tmp_path, capsys,
                                                                                               name, monkeypatch):
    text, message = BAD_FOLDERS[name]
    folder = tmp_path / name
    folder.mkdir()
    if text is not None:
        (folder / "config.json").write_text(text)
    monkeypatch.setattr("sys.stdin", None)  # a prompt for remote code would be a failure, not a wait
    status, out, err = run_check_pair(capsys, "shape:qwen3-0.6b", str(folder), *FLAGS)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: model folder {folder} ") and message in err
    for load in (load_config, load_model):  # every stage loads through these
        with pytest.raises(ModelFolderError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load(str(folder))


def test_a_missing_path_is_no_such_folder_and_a_missing_hub_id_gets_the_download_command(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, _, err = run_check_pair(capsys, "shape:qwen3-0.6b", str(tmp_path / "nowhere" / "qwen3"), *FLAGS)
    assert status == 2 and err == f"error: model folder {tmp_path / 'nowhere' / 'qwen3'}: no such folder\n"
    with pytest.raises(ModelNotAvailableError, match="huggingface-cli download someone/missing-model"):
        load_config("someone/missing-model")
    status, _, err = run_check_pair(capsys, "shape:qwen3-0.6b", "shape:qwen3-17b", *FLAGS)
    assert status == 2 and err.startswith("error: unknown model shape 'qwen3-17b' (known: ") and err.count("\n") == 1


# ---- item: the run length ---------------------------------------------------------------------------------------


def test_no_stage_but_the_pair_checker_reads_the_run_length_so_no_stage_reruns_when_an_unrelated_length_changes():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    readers = [name for name, stage in stages.items()
               if "run_length(" in (ROOT / (stage_module(stage).replace(".", "/") + ".py")).read_text()]
    assert readers == []  # a window is checked where sequences are fed: extract, and every handoff per sequence


def test_check_pair_checks_a_sliding_window_against_max_tokens_or_the_profiles_run_length(tmp_path, capsys,
                                                                                          monkeypatch):
    mistral = config_folder(tmp_path / "mistral-7b-v0.1", "mistral", **{**SMALL, "sliding_window": 4096,
                                                                          "max_position_embeddings": 32768})
    status, out, _ = run_check_pair(capsys, mistral, mistral, *FLAGS, "--max-tokens", "4096")
    assert status == 0 and "| mapped | yes |" in out
    status, _, err = run_check_pair(capsys, mistral, mistral, *FLAGS, "--max-tokens", "4097")
    assert status == 2 and "sliding window of 4096 tokens, active at 4097 tokens" in err
    monkeypatch.chdir(ROOT)
    assert run_length() < 4096  # the tiny profile's longest sequence
    assert run_check_pair(capsys, mistral, mistral, *FLAGS)[0] == 0
    monkeypatch.chdir(tmp_path)  # no params.yaml: the model's own position range
    status, _, err = run_check_pair(capsys, mistral, mistral, *FLAGS)
    assert status == 2 and "active at 32768 tokens" in err


# ---- item: advice that can be followed --------------------------------------------------------------------------


def test_phi3_mini_4k_is_told_every_rule_that_refuses_it_and_no_window_advice_once_the_run_is_short(tmp_path,
                                                                                                   capsys):
    phi3 = config_folder(tmp_path / "phi-3-mini-4k", "phi3", **{**SMALL, "sliding_window": 2047, "pad_token_id": 0,
                                                                 "max_position_embeddings": 4096})
    status, _, err = run_check_pair(capsys, phi3, phi3, *FLAGS, "--max-tokens", "4096")
    assert status == 2 and err.count("\n") == 1
    family, window = err.index("not a family"), err.index("it also has a sliding window of 2047 tokens")
    assert family < window  # what no run can work around comes first
    status, _, err = run_check_pair(capsys, phi3, phi3, *FLAGS, "--max-tokens", "1000")
    assert status == 2 and "not a family" in err and "sliding window" not in err


def test_a_mixture_of_experts_pair_is_accepted_without_a_flop_bound_from_a_dense_model(tmp_path, capsys):
    moe = config_folder(tmp_path / "qwen3-moe", "qwen3_moe", **SMALL, head_dim=16, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32)
    status, out, _ = run_check_pair(capsys, moe, moe, *FLAGS)
    assert status == 0 and "| mapped | yes |" in out
    assert "No FLOP bound" in out and "speedup bound" not in out


def test_check_pair_prints_the_contract_from_stored_configs_and_exits_non_zero_on_a_refused_pair(capsys, tmp_path):
    check_pair.main(["shape:llama-3.2-1b", "shape:llama-3.2-3b", "--ks", "1", "--lengths", "512", "--mlp-hidden",
                     "64"])
    out = capsys.readouterr().out
    assert "| layers / KV heads / head_dim | 16 / 8 / 64 | 28 / 8 / 128 |" in out
    assert "| direct | direct injection needs equal KV geometry" in out
    assert f"| linear | 1 | {mapper_parameter_count(*pair_configs('llama-3.2-1b-3b'), 1, 'linear'):,} |" in out
    assert "llama3, theta 500000" in out and "speedup bound" in out
    check_pair.main(["shape:qwen3-0.6b", "shape:llama-3.2-3b", "--ks", "1", "--lengths", "512"])
    assert "tokenizers: unchecked (no tokenizer for source 'shape:qwen3-0.6b' and target 'shape:llama-3.2-3b'; " \
        "the configs differ in vocabulary sizes 151936 vs 128256" in capsys.readouterr().out
    config_of("gemma", head_dim=16).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="not a family"):
        check_pair.main(["shape:qwen3-0.6b", str(tmp_path), "--ks", "1", "--lengths", "512"])
