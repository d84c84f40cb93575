"""The Python API (`pipeline.api`): a pair from two folders or `self:<n>`, a handoff in any mode with a map and a
repair, and the handed-off cache as a transformers `Cache` that `target.generate(...)` continues. On the tiny
pair and a random tiny Llama: the target's own cache injected directly continues token for token as
`target.generate` does alone and reproduces its native next-token logits; and the README's block runs as written."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, build_model, llama_config, tiny_config
from transformers import AutoModelForCausalLM

from pipeline.api import handed_off, handoff, pair
from pipeline.kv.decode import decode
from pipeline.kv.mapper import identity_mapper, save_mapper
from pipeline.kv.repair import RepairError
from pipeline.kv.routes import REPAIRED
from pipeline.store import devices
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.params import ParamError

PROMPT = "Question: How do I open a jar? Answer: twist the lid while holding the jar"
NEW_TOKENS = 12
LOGITS_ABS = 1e-4  # |delta logit| of the injected own cache against the plain forward, float32


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer) -> Path:
    """A random Llama (SmolLM2's architecture in miniature, weights drawn wide so greedy tokens vary)."""
    folder = tmp_path_factory.mktemp("api") / "llama"
    build_model(llama_config(len(tokenizer), 64, initializer_range=0.5), seed=3).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def identity_map(tiny_pair, tmp_path_factory) -> str:
    configs = [AutoModelForCausalLM.from_pretrained(tiny_pair[side]).config for side in ("source", "target")]
    mapper = identity_mapper("source", "target", *configs)
    mapper.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))
    path = tmp_path_factory.mktemp("api-map") / "identity.safetensors"
    save_mapper(mapper, path)
    return str(path)


def plain_generate(model, prompt: list[int], cache=None) -> list[int]:
    out = model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False,
                         min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("model", ["tiny target", "tiny llama"])
def test_direct_injection_of_the_targets_own_cache_continues_token_for_token_as_generate_alone(model, tiny_pair,
                                                                                             tiny_llama):
    folder = str(tiny_pair["target"] if model == "tiny target" else tiny_llama)
    models = pair(folder, folder, device="cpu")  # the target as its own source: its cache handed over as it is
    prompt = models.target_tokenizer.encode(PROMPT)
    handed = handed_off(handoff(models, "direct"), prompt)
    assert handed.route.way == "direct" and handed.cache.get_seq_length() == len(prompt) - 1
    assert plain_generate(models.target, prompt, handed.cache) == plain_generate(models.target, prompt)


@pytest.mark.parametrize("model", ["tiny target", "tiny llama"])
def test_the_injected_own_cache_reproduces_the_targets_native_next_token_logits(model, tiny_pair, tiny_llama):
    folder = str(tiny_pair["target"] if model == "tiny target" else tiny_llama)
    models = pair(folder, folder, device="cpu")
    prompt = models.target_tokenizer.encode(PROMPT)
    with torch.no_grad():
        native = models.target(torch.tensor([prompt])).logits[0, -1]  # (V,)
    for mode in ("direct", "oracle"):
        injected = handed_off(handoff(models, mode), prompt).next_token_logits()
        assert (injected - native).abs().max().item() < LOGITS_ABS, mode
    broken = handed_off(handoff(models, "zero"), prompt).next_token_logits()  # the check sees a wrong cache
    assert (broken - native).abs().max().item() > LOGITS_ABS


def test_a_mapped_repaired_handoff_hands_over_the_cache_the_pipelines_decoding_reads(tiny_pair, identity_map):
    models = pair(tiny_pair["target"], tiny_pair["source"], device="cpu")
    prompt = models.target_tokenizer.encode(PROMPT)
    repaired = handoff(models, "mapped", identity_map, repair="layers:1")
    handed = handed_off(repaired, prompt)
    assert handed.route.way == REPAIRED and handed.cache.get_seq_length() == len(prompt) - 1
    assert plain_generate(models.target, prompt, handed.cache) == decode(repaired.handoff, prompt, NEW_TOKENS)


def test_a_self_source_is_the_targets_first_layers_and_the_source_mode_decodes_with_it(tiny_pair):
    models = pair(tiny_pair["target"], "self:1", device="cpu")
    assert models.source.config.num_hidden_layers == 1 and models.source.model.layers[0] is \
           models.target.model.layers[0]
    prompt = models.target_tokenizer.encode(PROMPT)
    handed = handed_off(handoff(models, "source"), prompt)
    assert handed.model is models.source and handed.route.way == "source"
    assert plain_generate(handed.model, prompt, handed.cache) == plain_generate(models.source, prompt)


def test_a_one_token_prompt_hands_nothing_off(tiny_pair):
    models = pair(tiny_pair["target"], tiny_pair["target"], device="cpu")
    handed = handed_off(handoff(models, "direct"), models.target_tokenizer.encode(PROMPT)[:1])
    assert handed.cache is None and handed.route.way == "empty_prefix"


@pytest.mark.parametrize("args, error, message", [
    ({"mode": "mapped"}, ParamError, r"^pipeline\.api mode=mapped needs a mapper: give mapper=<mapper file>$"),
    ({"mode": "oracle", "repair": "sink:2"}, ParamError, r"^pipeline\.api mode=oracle does not use repair=: leave "),
    ({"mode": "direct", "repair": "layers:99"}, ParamError, r"^pipeline\.api repair layers:99: layers:99 exceeds the "
                                                            r"target's 2 layers; give at most layers:2$"),
    ({"mode": "direct", "repair": "layers:x"}, RepairError, r"layers:x"),
])
def test_a_bad_handoff_is_refused_in_one_line_before_any_weight_loads(args, error, message, tiny_pair,
                                                                     monkeypatch):
    models = pair(tiny_pair["target"], tiny_pair["source"], device="cpu")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(error, match=message):
        handoff(models, **args)


def readme_block() -> str:
    """The README's Python API example: the python block under its "Python API" heading."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("**The Python API.**"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readmes_python_block_runs_as_written(tmp_path, tiny_pair, identity_map):
    # the block names the real pair's converted folders and its committed map: the tiny pair stands in for them
    for side, folder in (("source", "converted-source"), ("target", "converted")):
        shutil.copytree(tiny_pair[side], tmp_path / "models" / folder)
    (tmp_path / "report/qwen25-coder/maps").mkdir(parents=True)
    shutil.copy(identity_map, tmp_path / "report/qwen25-coder/maps/selected.safetensors")  # bound by content
    done = subprocess.run([sys.executable, "-c", readme_block()], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the block prints its route and continuation"


@pytest.fixture(scope="module")
def short_target(tmp_path_factory, tokenizer) -> str:
    """A tiny target with 256 positions, as the tiny profile's."""
    folder = tmp_path_factory.mktemp("api-short") / "target"
    build_model(tiny_config(len(tokenizer), 32, max_position_embeddings=256), seed=5).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_a_prompt_past_the_targets_positions_with_its_new_tokens_is_refused_as_generate_refuses_it(short_target):
    router = handoff(pair(short_target, short_target, device="cpu"), "direct")
    with pytest.raises(ParamError, match=r"^handed_off\(\) prompt: the prompt is 300 tokens and 1 new ones are asked, "
                                         r"past the models' 256 positions; give a shorter prompt or fewer new tokens$"):
        handed_off(router, [5] * 300)
    with pytest.raises(ParamError, match=r"the prompt is 250 tokens and 8 new ones are asked, past the models' 256"):
        handed_off(router, [5] * 250, max_new_tokens=8)
    with pytest.raises(ParamError, match=r"^handed_off\(\) max_new_tokens: expected an integer >= 1, got 0$"):
        handed_off(router, [5] * 4, max_new_tokens=0)
    assert handed_off(router, [5] * 255).cache.get_seq_length() == 254  # the last prompt that leaves a new token


@pytest.mark.parametrize("prompt, error, message", [
    ([5, 2.7, 9], TypeError, r"^handed_off\(\) prompt: token 1 is float 2\.7, not an integer id; give ints"),
    (torch.tensor([5.0, 6.0]), TypeError, r"^handed_off\(\) prompt: token 0 is Tensor tensor\(5\.\), not an integer"),
    ([[5, 6]], TypeError, r"^handed_off\(\) prompt: token 0 is list \[5, 6\], not an integer id"),
    ([5, True], TypeError, r"^handed_off\(\) prompt: token 1 is bool True, not an integer id"),
    ("story: ray teal toy", TypeError, r"^handed_off\(\) prompt: expected token ids \(a list of ints\), got str "
                                       r"'story: ray teal toy'; encode text with the target's tokenizer first$"),
    (7, TypeError, r"^handed_off\(\) prompt: expected token ids \(a list of ints\), got int 7;"),
    ([5, -1], ValueError, r"^handed_off\(\) prompt: token id -1 is outside the vocabulary \(ids 0\.\.1023\); give ids "
                          r"the target's tokenizer makes$"),
    ([5, 1024], ValueError, r"^handed_off\(\) prompt: token id 1024 is outside the vocabulary \(ids 0\.\.1023\)"),
    ([], ValueError, r"^handed_off\(\) prompt: empty; give at least one token$"),
])
def test_a_prompt_that_is_not_token_ids_of_the_vocabulary_is_refused_in_one_line_naming_it(prompt, error, message,
                                                                                          short_target):
    router = handoff(pair(short_target, short_target, device="cpu"), "direct")
    with pytest.raises(error, match=message) as refused:
        handed_off(router, prompt)
    assert isinstance(refused.value, ParamError)  # a refusal: one line, never a traceback from inside the models


def test_token_ids_of_any_integer_kind_are_read_as_the_same_prompt(short_target):
    router = handoff(pair(short_target, short_target, device="cpu"), "direct")
    plain = handed_off(router, [5, 6, 7]).next_token_logits()
    for prompt in (torch.tensor([5, 6, 7]), np.array([5, 6, 7]), (5, 6, 7)):
        assert torch.equal(handed_off(router, prompt).next_token_logits(), plain)


def test_a_path_where_a_pair_or_a_router_goes_is_refused_naming_the_argument(short_target):
    with pytest.raises(TypeError, match=r"^handoff\(\) models: expected the pair pipeline\.api\.pair\(target, source\) "
                                        r"makes, got str '.*target'$"):
        handoff(short_target, "direct")
    with pytest.raises(TypeError, match=r"^handed_off\(\) router: expected what pipeline\.api\.handoff\(\.\.\.\) "
                                        r"returns, got Pair"):
        handed_off(pair(short_target, device="cpu"), [5, 6])


@pytest.mark.parametrize("max_tokens", [-1, 0])
def test_a_pair_for_no_token_at_all_is_refused(max_tokens, short_target):
    with pytest.raises(ParamError, match=rf"^pair\(\) max_tokens: expected an integer >= 1, got {max_tokens}$"):
        pair(short_target, max_tokens=max_tokens)


def test_next_token_logits_read_twice_are_the_same_and_leave_the_cache_to_continue_the_prompt(tiny_pair):
    models = pair(tiny_pair["target"], tiny_pair["target"], device="cpu")
    prompt = models.target_tokenizer.encode(PROMPT)
    handed = handed_off(handoff(models, "direct"), prompt, max_new_tokens=NEW_TOKENS)
    first, second = handed.next_token_logits(), handed.next_token_logits()
    assert torch.equal(first, second)  # before, the second read saw prompt[-1] twice: logits 0.59 apart
    assert handed.cache.get_seq_length() == len(prompt) - 1
    assert plain_generate(models.target, prompt, handed.cache) == plain_generate(models.target, prompt)


def test_dtype_auto_loads_the_pair_in_the_dtype_this_machine_runs_faster(tiny_pair, monkeypatch):
    for choice in ("bfloat16", "float32"):
        monkeypatch.setattr(devices, "machine_dtype", lambda choice=choice: (choice, {}))
        models = pair(tiny_pair["target"], tiny_pair["source"], dtype="auto", device="cpu")
        assert models.target.dtype == getattr(torch, choice)
