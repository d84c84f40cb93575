"""The mapped pair: names, tokenizers and contract read at once, each model's weights loaded once and shared by
every handoff, and a refused mode stopped before any weight is loaded."""
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers.architectures import SUPPORTED, random_of
from transformers import AutoConfig

import pipeline.kv.pair as pair_module
from pipeline.kv.mapper import identity_mapper, random_mapper, save_mapper
from pipeline.kv.pair import OtherModelsError, Pair
from pipeline.kv.scoring import score_continuations
from pipeline.store.fingerprints import pair_fingerprints
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
    mapper = identity_mapper("source", "target", configs["source"], configs["target"])
    mapper.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))
    save_mapper(mapper, path)
    return path


def perturbed(folder, out, noise: float = 0.05):
    """A copy of the model in `folder` with 5% relative weight noise: same geometry, same tokenizer."""
    from transformers import AutoModelForCausalLM
    shutil.copytree(folder, out)
    model = AutoModelForCausalLM.from_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(noise * parameter.std() * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(out)
    return out


def other_tokenizer(folder, out):
    """A copy of the model in `folder` whose tokenizer files differ (one more special token)."""
    from transformers import AutoTokenizer
    shutil.copytree(folder, out)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<other>"]})
    tokenizer.save_pretrained(out)
    return out


def other_models(case: str, tiny_pair, tmp_path) -> tuple[str, str]:
    """(target, source) of each way to use a map with models it was not fitted on."""
    target, source = str(tiny_pair["target"]), str(tiny_pair["source"])
    if case == "same-geometry other model":  # the source is the target's geometry: another model in its place
        return source, source
    if case == "swapped pair":
        return source, target
    if case == "perturbed target":
        return str(perturbed(tiny_pair["target"], tmp_path / "noisy")), source
    # both sides retokenized alike: the contract's one-tokenizer rule holds, the map's fingerprints do not
    return (str(other_tokenizer(tiny_pair["target"], tmp_path / "target")),
            str(other_tokenizer(tiny_pair["source"], tmp_path / "source")))


@pytest.mark.parametrize("case, message", [
    ("same-geometry other model", "the target's weights differ"),
    ("swapped pair", "source and target swapped"),
    ("perturbed target", "the target's weights differ"),
    ("other tokenizer", "the target's tokenizer differs"),
])
def test_a_map_is_refused_with_models_it_was_not_fitted_on_before_any_weight_is_loaded(
        tiny_pair, mapper_file, tmp_path, loads, case, message):
    target, source = other_models(case, tiny_pair, tmp_path)
    pair = Pair(target, source, device="cpu")
    with pytest.raises(OtherModelsError, match=message) as refused:
        pair.handoff("mapped", mapper_file)
    assert "allow_other_models=true" in str(refused.value) and "\n" not in str(refused.value)
    assert loads == []


def test_a_map_without_fingerprints_is_refused_naming_the_refit(tiny_pair, tmp_path):
    configs = {name: AutoConfig.from_pretrained(tiny_pair[name]) for name in ("source", "target")}
    save_mapper(identity_mapper("source", "target", configs["source"], configs["target"]), tmp_path / "old.safetensors")
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), device="cpu")
    with pytest.raises(OtherModelsError, match="records no fingerprints.*refit it"):
        pair.handoff("mapped", tmp_path / "old.safetensors")


def test_allowing_other_models_runs_the_map_and_keeps_what_differs(tiny_pair, mapper_file, tmp_path):
    target, source = other_models("perturbed target", tiny_pair, tmp_path)
    pair = Pair(target, source, device="cpu", allow_other_models=True)
    handoff = pair.handoff("mapped", mapper_file)
    assert score_continuations(handoff, [([5, 9, 14], [7])], progress=False)
    assert len(pair.other_models) == 1 and "the target's weights differ" in pair.other_models[0]


def test_a_map_fitted_on_the_pair_is_bound_to_its_content_not_its_path(tiny_pair, mapper_file, tmp_path):
    shutil.copytree(tiny_pair["target"], tmp_path / "moved")
    pair = Pair(str(tmp_path / "moved"), str(tiny_pair["source"]), device="cpu")
    pair.handoff("mapped", mapper_file)
    assert pair.other_models == []


def test_every_handoff_of_a_pair_shares_its_models_loaded_once(tiny_pair, mapper_file, loads):
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), device="cpu")
    assert loads == []  # the tokenizers and the contract need no weights
    oracle, mapped, again = pair.handoff("oracle"), pair.handoff("mapped", mapper_file), pair.handoff("direct")
    assert loads == [str(tiny_pair["target"]), str(tiny_pair["source"])]  # the target first, as the stages did
    assert oracle.decoder is mapped.decoder is again.decoder and mapped.source is again.source
    assert oracle.source is None and mapped.mapper.family == "identity" and again.mapper is None


def test_the_identity_map_from_a_file_scores_as_direct_injection(tiny_pair, mapper_file):
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), device="cpu")
    requests = [([5, 9, 14, 3, 8], [7, 2]), ([5, 9, 14, 3, 8], [11]), ([4, 4, 6], [1, 2, 3])]
    direct = score_continuations(pair.handoff("direct"), requests, progress=False)
    mapped = score_continuations(pair.handoff("mapped", mapper_file), requests, progress=False)
    assert [score for score, _ in mapped] == pytest.approx([score for score, _ in direct], abs=1e-5)


def test_a_mode_the_contract_leaves_undefined_loads_no_weights(tiny_pair, loads):
    pair = Pair(str(tiny_pair["target"]), None, device="cpu")
    with pytest.raises(ValueError, match="transfer mode 'direct' is not defined: .*source"):
        pair.handoff("direct")
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


@pytest.mark.parametrize("as_file", [True, False])
def test_a_map_fitted_for_another_kv_geometry_is_refused_by_the_pair_before_any_weight_loads(tiny_pair, tmp_path,
                                                                                             loads, as_file):
    configs = {name: AutoConfig.from_pretrained(tiny_pair[name]) for name in ("source", "target")}
    other = AutoConfig.from_pretrained(tiny_pair["source"])
    other.head_dim *= 2  # a map of another source's geometry
    mapper = random_mapper(other, configs["target"])
    mapper.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))  # its models: these
    path = tmp_path / "other.safetensors"
    save_mapper(mapper, path)
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), device="cpu")
    with pytest.raises(IncompatiblePairError, match=r"^mapper was fitted for KV geometry .* but source '.*' and "
                                                    r"target '.*' have "):
        pair.handoff("mapped", path if as_file else mapper)
    assert loads == []
    right = random_mapper(configs["source"], configs["target"])  # the pair's geometry: the same check lets it by
    right.models = mapper.models
    assert pair.handoff("mapped", right).mapper is right


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_every_accepted_architecture_has_its_map_geometry_checked_by_the_pair(name):
    model = random_of(SUPPORTED[name]())
    deeper = SUPPORTED[name]()
    deeper.num_hidden_layers += 1  # another source geometry
    pair = Pair.of(model, model)
    with pytest.raises(IncompatiblePairError, match=r"^mapper was fitted for KV geometry "):
        pair.handoff("mapped", random_mapper(deeper, model.config))
    right = random_mapper(model.config, model.config)
    assert pair.handoff("mapped", right).mapper is right


def test_the_pipelines_pair_is_models_target_and_source_with_its_settings(tiny_pair, tmp_path, monkeypatch):
    for name in ("source", "target"):
        shutil.copytree(tiny_pair[name], tmp_path / "models" / name)
    monkeypatch.chdir(tmp_path)
    pair = Pair.load(SimpleNamespace(dtype="bfloat16", device_map=None), "cpu")
    handoff = pair.handoff("zero")
    assert handoff.decoder.dtype == torch.bfloat16 and handoff.decoder.config._name_or_path == "models/target"
    assert pair.contract.tokenizers == "identical"
    assert {task: str(path) for task, path in pair.eval_tasks.items()} == {
        "hellaswag": "data/hellaswag_eval.parquet", "piqa": "data/piqa_eval.parquet"}
