"""The mapped pair: names, tokenizers and contract read at once, each model's weights loaded once and shared by
every handoff, and a refused mode stopped before any weight is loaded."""
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

import pipeline.kv.pair as pair_module
from pipeline.kv.mapper import identity_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.scoring import score_continuations
from pipeline.store.models import IncompatiblePairError


@pytest.fixture
def loads(monkeypatch):
    """The names `Pair` loads weights of, in order."""
    seen = []
    real = pair_module.load_model

    def counted(name, *args, **kwargs):
        seen.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(pair_module, "load_model", counted)
    return seen


@pytest.fixture
def mapper_file(tiny_pair, tmp_path):
    configs = {name: AutoConfig.from_pretrained(tiny_pair[name]) for name in ("source", "target")}
    path = tmp_path / "identity.safetensors"
    save_mapper(identity_mapper("source", "target", configs["source"], configs["target"]), path)
    return path


def test_every_handoff_of_a_pair_shares_its_models_loaded_once(tiny_pair, mapper_file, loads):
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), device="cpu")
    assert loads == []  # the tokenizers and the contract need no weights
    oracle, mapped, again = pair.handoff("oracle"), pair.handoff("mapped", mapper_file), pair.handoff("direct")
    assert loads == [str(tiny_pair["target"]), str(tiny_pair["source"])]  # the target first, as the stages did
    assert oracle.target is mapped.target is again.target and mapped.source is again.source
    assert oracle.source is None and mapped.mapper.family == "identity" and again.mapper is None


def test_the_identity_map_from_a_file_scores_as_direct_injection(tiny_pair, mapper_file):
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), device="cpu")
    requests = [([5, 9, 14, 3, 8], [7, 2]), ([5, 9, 14, 3, 8], [11]), ([4, 4, 6], [1, 2, 3])]
    direct = score_continuations(pair.handoff("direct"), requests, progress=False)
    mapped = score_continuations(pair.handoff("mapped", mapper_file), requests, progress=False)
    assert [score for score, _ in mapped] == pytest.approx([score for score, _ in direct], abs=1e-5)


@pytest.mark.parametrize("source, mode, message", [
    (False, "direct", "needs a source model"),
    (True, "mapped", "needs a mapper"),
    (True, "telepathy", "unknown transfer mode"),
])
def test_a_refused_mode_loads_no_weights(tiny_pair, loads, source, mode, message):
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]) if source else None, device="cpu")
    with pytest.raises(ValueError, match=message):
        pair.handoff(mode)
    assert loads == []


def test_a_pair_its_contract_refuses_loads_no_weights(tiny_pair, tmp_path, loads):
    source = tmp_path / "other-geometry"
    config = AutoConfig.from_pretrained(tiny_pair["source"])
    config.head_dim *= 2  # another KV geometry, read from the config alone: never loaded
    shutil.copytree(tiny_pair["source"], source)
    config.save_pretrained(source)
    pair = Pair(str(tiny_pair["target"]), str(source), device="cpu")
    with pytest.raises(IncompatiblePairError, match="equal KV geometry"):
        pair.handoff("direct")
    assert loads == []


def test_the_pipelines_pair_is_models_target_and_source_with_its_settings(tiny_pair, tmp_path, monkeypatch):
    for name in ("source", "target"):
        shutil.copytree(tiny_pair[name], tmp_path / "models" / name)
    monkeypatch.chdir(tmp_path)
    pair = Pair.load(SimpleNamespace(dtype="bfloat16", device_map=None), "cpu")
    handoff = pair.handoff("zero")
    assert handoff.target.dtype == torch.bfloat16 and handoff.target.config._name_or_path == "models/target"
    assert pair.contract.tokenizers == "identical"
    assert {task: str(path) for task, path in pair.eval_tasks.items()} == {
        "hellaswag": "data/hellaswag_eval.parquet", "piqa": "data/piqa_eval.parquet"}
