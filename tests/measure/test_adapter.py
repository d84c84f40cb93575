"""lm-eval's request types through the `kv-transfer` model (`measure.adapter`): generate_until and rolling
log-likelihood honest about the positions and about what was handed off, and each request type's route recorded
in every mode and under a repair."""
from __future__ import annotations

import logging

import pytest
import torch
from helpers import WIKITEXT
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.kv.mapper import identity_mapper, save_mapper
from pipeline.kv.modes import MODES, OWN_MODES
from pipeline.kv.pair import Pair
from pipeline.kv.routes import EMPTY_PREFIX, REPAIRED
from pipeline.lm_eval_model import KVTransferLM
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.params import ParamError

TASK = "task"
PROMPT = "Question: how do you boil water? Put a pot of water on the stove and wait.\nAnswer:"


@pytest.fixture(scope="module")
def identity_map(tiny_pair, tmp_path_factory):
    source, target = (Pair(str(tiny_pair[side])).target for side in ("source", "target"))
    mapper = identity_mapper("s", "t", source.config, target.config)
    mapper.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))
    path = tmp_path_factory.mktemp("adapter") / "identity.safetensors"
    save_mapper(mapper, path)
    return str(path)


def model(tiny_pair, identity_map, mode: str, **args) -> KVTransferLM:
    """The kv-transfer model of `mode` on the tiny pair (a source where the mode reads one, the identity map)."""
    source = {} if mode in ("oracle", "zero") else {"source": str(tiny_pair["source"])}
    mapper = {"mapper": identity_map} if mode in ("mapped", "shuffled") else {}
    return KVTransferLM.from_args(target=str(tiny_pair["target"]), transfer=mode, device="cpu", **source, **mapper,
                                  **args)


def generation(prompt: str = PROMPT, doc: int = 0, **gen_kwargs) -> Instance:
    return Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 8, **gen_kwargs}), 0,
                    (TASK, doc, 1))


def rolling(text: str, doc: int = 0) -> Instance:
    return Instance("loglikelihood_rolling", {}, (text,), 0, (TASK, doc, 1))


def reference_hf(folder, max_length: int) -> HFLM:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(folder), batch_size=1, device="cpu",
                max_length=max_length, softmax_dtype="float32")


@pytest.mark.parametrize("max_gen_toks", [64, 80])
def test_generate_until_refuses_max_gen_toks_that_leave_no_position_for_the_prompt(max_gen_toks, tiny_pair,
                                                                                  identity_map):
    lm = model(tiny_pair, identity_map, "oracle", max_length=64)
    # before: 64 generated past the last position without a word, 80 cut the prompt from the left by 16 tokens
    with pytest.raises(ParamError, match=rf"^kv-transfer: generate_until asks max_gen_toks={max_gen_toks}, which "
                                         rf"leaves no position for the prompt in the 64 positions"):
        lm.generate_until([generation(max_gen_toks=max_gen_toks)])


def test_generate_until_left_truncates_a_long_prompt_to_the_positions_max_gen_toks_leaves_as_stock_hf(
        tiny_pair, identity_map):
    prompt = " ".join([PROMPT.replace("\nAnswer:", "")] * 6) + "\nAnswer:"
    assert len(AutoTokenizer.from_pretrained(tiny_pair["target"]).encode(prompt)) > 64
    request = generation(prompt, max_gen_toks=16)
    ours = model(tiny_pair, identity_map, "oracle", max_length=64).generate_until([request])
    assert ours == reference_hf(tiny_pair["target"], 64).generate_until([request])


def test_generate_until_warns_when_it_left_truncates_a_prompt_and_not_otherwise(tiny_pair, identity_map, caplog):
    lm = model(tiny_pair, identity_map, "oracle", max_length=64)
    tokens = len(AutoTokenizer.from_pretrained(tiny_pair["target"]).encode(PROMPT))
    with caplog.at_level(logging.WARNING, logger="pipeline.measure.adapter"):
        lm.generate_until([generation(max_gen_toks=64 - tokens)])  # the whole prompt fits: said nothing
        assert caplog.messages == []
        lm.generate_until([generation(max_gen_toks=64 - tokens + 6)])  # before: 6 tokens dropped silently
    assert caplog.messages == [f"kv-transfer: generate_until left-truncates a prompt of {tokens} tokens to its last "
                               f"{tokens - 6} (max_length 64 less max_gen_toks {64 - tokens + 6}): the rest of the "
                               f"prompt is not read; lower max_gen_toks to keep it"]


def test_generate_until_refuses_a_sampling_request_rather_than_decoding_it_greedily(tiny_pair, identity_map):
    with pytest.raises(ParamError, match=r"^kv-transfer decodes greedily, and this generate_until asks for sampling"):
        model(tiny_pair, identity_map, "oracle").generate_until([generation(do_sample=True, temperature=0.7)])


def transfer(mode: str) -> str:
    """`transfer=` for a mode: a valued one (speculative prefill) with a share."""
    return f"{mode}:0.5" if MODES[mode].parameter is not None else mode


@pytest.mark.parametrize("mode", MODES)
def test_generate_until_records_each_requests_route_in_every_mode(mode, tiny_pair, identity_map):
    lm = model(tiny_pair, identity_map, transfer(mode))
    assert len(lm.tok_encode("Answer")) == 1  # a one-token prompt: nothing to hand off
    lm.generate_until([generation(doc=0), generation("Answer", doc=1)])
    assert lm.route_counts()[TASK] == {"requests": 2, mode: 1 + (mode in OWN_MODES),
                                       **({} if mode in OWN_MODES else {EMPTY_PREFIX: 1})}


def test_generate_until_under_a_repair_is_repaired_and_records_only_the_documents_that_went_another_way(
        tiny_pair, identity_map):
    lm = model(tiny_pair, identity_map, "mapped", repair="sink:2")
    assert len(lm.tok_encode("Answer")) == 1  # a one-token prompt: nothing handed off, nothing repaired
    lm.generate_until([generation(doc=0), generation("Answer", doc=1)])
    assert lm.route_counts()[TASK] == {"requests": 2, REPAIRED: 1, EMPTY_PREFIX: 1}
    assert lm.handoff.repaired.recomputed == 2
    record = lm.route_record()
    assert record["routes"][TASK][REPAIRED] == 1 and record["requests"] == {TASK: {"1": {"route": [EMPTY_PREFIX]}}}


@pytest.mark.parametrize("mode", OWN_MODES)
def test_rolling_loglikelihood_of_a_model_reading_its_own_prefill_is_recorded_as_its_mode(mode, tiny_pair,
                                                                                        identity_map):
    text = WIKITEXT.read_text()[:2000]
    lm = model(tiny_pair, identity_map, mode, max_length=64)
    ours = lm.loglikelihood_rolling([rolling(text[:300]), rolling(text, doc=1)])
    assert lm.route_counts()[TASK] == {"requests": 2, mode: 2} and lm.route_record()["requests"] == {}
    if mode == "oracle":  # the windows after the first read the tokens before them (up to 63 here), as hf's do
        reference = reference_hf(tiny_pair["target"], 64).loglikelihood_rolling(
            [rolling(text[:300]), rolling(text, doc=1)])
        assert ours == pytest.approx(reference, abs=1e-3)


@pytest.mark.parametrize("mode", [mode for mode in MODES if mode not in OWN_MODES])
def test_rolling_loglikelihood_is_refused_in_a_handoff_mode_whose_first_window_hands_nothing_off(mode, tiny_pair,
                                                                                                identity_map):
    # before, oracle, mapped and zero gave one value on every document shorter than the window, recorded as
    # `empty_prefix+mapped`, a way kv.routes does not define
    lm = model(tiny_pair, identity_map, transfer(mode))
    with pytest.raises(ParamError, match=rf"^kv-transfer transfer={mode}: loglikelihood_rolling .* scores a "
                                         rf"document's first window from a one-token context"):
        lm.loglikelihood_rolling([rolling("A man is sitting on a roof.")])


def test_a_continuation_longer_than_max_length_is_one_line_not_a_value_error(tiny_pair, identity_map):
    lm = model(tiny_pair, identity_map, "oracle", max_length=2)
    request = Instance("loglikelihood", {}, ("Question: why?\nAnswer:", " because it is so"), 0, (TASK, 0, 1))
    with pytest.raises(ParamError, match=r"^kv-transfer max_length=2: a continuation of \d+ tokens .* does not fit; "
                                         r"give max_length >= \d+"):
        lm.loglikelihood([request])
    assert torch.isfinite(torch.tensor(model(tiny_pair, identity_map, "oracle").loglikelihood([request])[0][0]))
