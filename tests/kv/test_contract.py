"""The architecture contract: each supported family is handled exactly (through `Pair.handoff` in every mode and
repair policy too), each other model is refused up front, and the run length is the longest sequence a stage feeds."""
import pytest
import torch
from helpers import ROOT, build_model, committed, tiny_config
from helpers.architectures import SUPPORTED, VOCAB, _full_forward_scores, _requests, config_of, random_of
from lm_eval.api.instance import Instance

from pipeline.fitting import ridge
from pipeline.kv.contract import (
    MODES,
    TESTED_FAMILIES,
    LongerThanWindowError,
    UnsupportedModelError,
    pair_contract,
    run_length,
    which_pairs_work,
)
from pipeline.kv.decode import greedy_rollout
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import cache_to_layers
from pipeline.kv.mapper import Mapper, identity_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.rope import RotarySpec, Rotation
from pipeline.kv.router import Router
from pipeline.kv.scoring import score_continuations
from pipeline.kv.selectors import POLICIES, SELECTORS
from pipeline.kv.speculative import SpeculativeParams
from pipeline.lm_eval_model import KVTransferLM
from pipeline.store.models import IncompatiblePairError
from pipeline.store.params import parse

REFUSED = {  # the model, and what its refusal must name
    "qwen3-sliding-layers": (lambda: config_of("qwen3", head_dim=16, use_sliding_window=True, sliding_window=32,
                                               max_window_layers=1), "attention types per layer"),
    "gemma2": (lambda: config_of("gemma2", head_dim=16), "attention types per layer"),
    "gemma3": (lambda: config_of("gemma3_text", head_dim=16), "per-layer-type RoPE parameters"),
    "phi-partial-rotary": (lambda: config_of("phi"), "partial_rotary_factor 0.5"),
    "stablelm-partial-rotary": (lambda: config_of("stablelm"), "partial_rotary_factor 0.25"),
    "gpt-neox": (lambda: config_of("gpt_neox"), "no num_key_value_heads"),
    "deepseek-v3-mla": (lambda: config_of("deepseek_v3", kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                          qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=2),
                        "multi-head latent attention"),
    "dynamic-ntk": (lambda: config_of("llama", head_dim=16, rope_parameters={"rope_type": "dynamic",
                                                                             "rope_theta": 10000.0, "factor": 2.0}),
                    "length-dependent RoPE ('dynamic')"),
    "phi3-longrope": (lambda: config_of("phi3", pad_token_id=0, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 128}), "length-dependent RoPE ('longrope')"),
    "untested-family": (lambda: config_of("gemma", head_dim=16), "not a family"),
}


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_family_defines_every_mode_and_its_oracle_handoff_is_exact(name):
    config = SUPPORTED[name]()
    contract = pair_contract(config, config)
    assert all(contract.defined(mode) for mode in contract.modes), contract.modes
    model = random_of(config)
    requests = _requests(n_contexts=3, endings=2)
    results = score_continuations(Handoff(model), requests, progress=False)
    for (score, _), reference in zip(results, _full_forward_scores(model, requests)):
        assert score == pytest.approx(reference, abs=1e-4)
    direct = score_continuations(Handoff(model, model, "direct"), requests, progress=False)
    assert [s for s, _ in direct] == pytest.approx([s for s, _ in results], abs=1e-4)


def test_every_tested_family_is_exercised_here():
    assert {SUPPORTED[name]().model_type for name in SUPPORTED} == set(TESTED_FAMILIES)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_model_is_refused_in_one_sentence_naming_it_before_any_forward(name):
    build, feature = REFUSED[name]
    config = build()
    contract = pair_contract(config, config)
    assert not any(contract.defined(mode) for mode in contract.modes)
    model = random_of(config)

    def no_forward(*args, **kwargs):
        raise AssertionError("a refused model must not run")

    model.forward = no_forward
    getattr(model, "model", model).forward = no_forward
    for mode in ("oracle", "mapped"):
        with pytest.raises(UnsupportedModelError) as info:
            Pair.of(model, model).handoff(mode, None if mode == "oracle" else object())
        message = str(info.value)
        assert feature in message and f"tiny-{config.model_type}" in message and "\n" not in message


def test_sliding_window_shorter_than_the_run_is_refused_and_a_longer_one_is_exact():
    config = config_of("mistral", head_dim=16, sliding_window=48)
    assert not pair_contract(config, max_tokens=100).defined("oracle")
    model = random_of(config)
    with pytest.raises(UnsupportedModelError, match="sliding window of 48 tokens, active at 100"):
        Pair.of(model, max_tokens=100).handoff()
    requests = _requests(n_contexts=3, endings=2, seed=3)  # at most 39 + 5 = 44 tokens: the window never masks
    results = score_continuations(Pair.of(model, max_tokens=44).handoff(), requests, progress=False)
    for (score, _), reference in zip(results, _full_forward_scores(model, requests)):
        assert score == pytest.approx(reference, abs=1e-4)


def test_without_a_run_length_a_windowed_model_is_accepted_and_each_longer_sequence_refused_when_it_comes():
    model = random_of(config_of("mistral", head_dim=16, sliding_window=40))
    handoff = Handoff(model)  # no run length: the window is checked sequence by sequence
    short = [([5, 6, 7, 8], [9, 10])]
    (score, _), = score_continuations(handoff, short, progress=False)
    assert score == pytest.approx(_full_forward_scores(model, short)[0], abs=1e-4)
    long = [(list(range(3, 41)), [4, 5, 6, 7])]  # the model reads 38 + 4 - 1 = 41 tokens: one past the window
    with pytest.raises(LongerThanWindowError, match="41 tokens is longer than the sliding window \\(40 tokens\\)"):
        score_continuations(handoff, long, progress=False)
    with pytest.raises(LongerThanWindowError, match="longer than the sliding window"):
        greedy_rollout(handoff, [list(range(3, 30))], steps=20)
    assert Handoff(random_of(SUPPORTED["llama"]())).window is None  # no window, no limit


def test_pair_verdicts_name_what_differs():
    source, target = config_of("qwen3", head_dim=16), config_of("qwen3", head_dim=32, num_key_value_heads=4)
    contract = pair_contract(target, source)
    assert contract.defined("mapped") and contract.family_defined("linear") and contract.family_defined("mlp")
    assert "equal KV geometry" in contract.modes["direct"]
    assert "equal KV head counts" in contract.families["head_matched"]
    assert contract.tokenizers == "unchecked"
    with pytest.raises(IncompatiblePairError, match="equal KV geometry"):
        contract.require("direct")


def test_a_folder_inside_the_repository_is_named_relative_to_it_and_one_elsewhere_by_its_absolute_path(tmp_path):
    source, target = config_of("qwen3", head_dim=16), config_of("qwen3", head_dim=32)
    source._name_or_path = str(ROOT.resolve() / "models" / "converted")
    target._name_or_path = str(tmp_path / "elsewhere")
    reason = pair_contract(target, source).modes["direct"]
    assert "source 'models/converted'" in reason and f"target '{tmp_path / 'elsewhere'}'" in reason


def test_configs_without_tokenizers_leave_the_tokenizers_unchecked_and_say_what_the_configs_differ_in():
    target = config_of("qwen3", head_dim=16, eos_token_id=2)
    padded = config_of("qwen3", head_dim=16, vocab_size=VOCAB + 31, eos_token_id=3)
    contract = pair_contract(target, padded)
    assert contract.defined("mapped") and contract.tokenizers == "unchecked"
    assert contract.tokenizer_note == ("no tokenizer for source 'tiny-qwen3' and target 'tiny-qwen3'; the configs "
                                       f"differ in vocabulary sizes {VOCAB + 31} vs {VOCAB}, eos token ids 3 vs 2")


def test_a_model_refused_by_several_rules_is_told_all_of_them_the_sliding_window_last():
    config = config_of("gemma", head_dim=16, sliding_window=32)  # an untested family with an active window
    message = pair_contract(config, max_tokens=100).modes["oracle"]
    assert message.index("not a family") < message.index("it also has a sliding window of 32 tokens")
    assert "sliding window" not in pair_contract(config, max_tokens=32).modes["oracle"]


# ---- unequal geometry, mapped exactly ------------------------------------------------------------------------


def _duplicated_heads_pair(layers=3, vocab=VOCAB):
    """A source, and a target that computes the same keys and values with every KV head duplicated (2 -> 4 heads)
    and another rope theta. Every layer but the last writes nothing to the residual stream (o_proj = 0), so each
    layer's content keys and values are the same function of the tokens in both models and the last layer's
    attention, which reads the whole cache, decides the logits: a linear map exists and is exact."""
    source = build_model(tiny_config(vocab, 64, layers=layers), seed=7)
    target_config = tiny_config(vocab, 64, layers=layers, num_key_value_heads=4)
    target_config.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
    target = build_model(target_config, seed=8)
    source_state = source.state_dict()
    with torch.no_grad():
        for name, tensor in target.state_dict().items():
            if "rotary" in name:
                continue
            value = source_state[name]
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                value = value.view(2, 16, -1).repeat_interleave(2, dim=0).reshape(tensor.shape)  # (H_kv*D, hidden)
            tensor.copy_(value)
        for layer in list(source.model.layers[:-1]) + list(target.model.layers[:-1]):
            layer.self_attn.o_proj.weight.zero_()
    return source, target


def _content_cache(model, ids):
    with torch.no_grad():
        layers = cache_to_layers(model.model(input_ids=ids, use_cache=True).cache)
    rotation = Rotation(RotarySpec.from_model(model), torch.arange(ids.shape[1]))
    return [(rotation.strip(k), v) for k, v in layers]  # (B, H, T, D) each


def _fit_linear_map(source, target, sequences):
    """The k=1 linear map, layer l -> layer l, by ridge from the two models' content caches."""
    geometry_s, geometry_t = kv_geometry(source.config), kv_geometry(target.config)
    heads, dim = geometry_t["kv_heads"], geometry_t["head_dim"]
    keys, values = [], []
    for layer in range(geometry_t["layers"]):
        fitted = []
        for kind in (0, 1):
            moments = ridge.Moments.zeros(geometry_s["kv_heads"] * geometry_s["head_dim"], heads * dim, "cpu")
            for ids in sequences:
                x = _content_cache(source, ids)[layer][kind][0].transpose(0, 1).flatten(1)  # (T, H_s*D_s)
                y = _content_cache(target, ids)[layer][kind][0].transpose(0, 1).flatten(1)  # (T, H_t*D_t)
                moments.update(x, y)
            weight, bias = ridge.solve(moments, 1e-6)  # (F, H_t*D_t), (H_t*D_t,)
            fitted.append((weight.view(-1, heads, dim).transpose(0, 1).float(), bias.view(heads, dim).float()))
        keys.append(fitted[0])
        values.append(fitted[1])
    return Mapper("linear", "source", "target", geometry_s, geometry_t,
                  RotarySpec.from_config(source.config).to_dict(), RotarySpec.from_config(target.config).to_dict(),
                  k=1, ridge_lambda=1e-6, source_layers=[[layer] for layer in range(geometry_t["layers"])],
                  keys=keys, values=values)


def test_a_fitted_map_between_unequal_geometries_reproduces_the_oracle_through_the_handoff():
    source, target = _duplicated_heads_pair()
    contract = pair_contract(target.config, source.config)
    assert contract.defined("mapped") and not contract.defined("direct")
    generator = torch.Generator().manual_seed(11)
    mapper = _fit_linear_map(source, target, [torch.randint(0, VOCAB, (1, 60), generator=generator) for _ in range(4)])
    requests = _requests(n_contexts=3, endings=2, seed=5)
    oracle = score_continuations(Handoff(target), requests, progress=False)
    mapped = score_continuations(Handoff(target, source, "mapped", mapper), requests, progress=False)
    zero = score_continuations(Handoff(target, mode="zero"), requests, progress=False)
    assert [s for s, _ in mapped] == pytest.approx([s for s, _ in oracle], abs=1e-4)
    assert [g for _, g in mapped] == [g for _, g in oracle]
    assert max(abs(a - b) for (a, _), (b, _) in zip(zero, oracle)) > 1e-2  # the cache matters to the logits


def test_the_fitted_map_between_unequal_geometries_reproduces_the_oracle_through_lm_eval(tokenizer):
    source, target = _duplicated_heads_pair(vocab=len(tokenizer))
    generator = torch.Generator().manual_seed(12)
    mapper = _fit_linear_map(source, target,
                             [torch.randint(0, len(tokenizer), (1, 60), generator=generator) for _ in range(4)])
    texts = [("the cat sat on the", " mat"), ("a b c d e f", " g h"), ("once upon a time there", " was a king")]
    requests = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(texts)]
    oracle = KVTransferLM(Router(Handoff(target)), tokenizer).loglikelihood(requests, disable_tqdm=True)
    handoff = Handoff(target, source, "mapped", mapper)
    mapped = KVTransferLM(Router(handoff), tokenizer).loglikelihood(requests, disable_tqdm=True)
    assert [ll for ll, _ in mapped] == pytest.approx([ll for ll, _ in oracle], abs=1e-4)
    assert [greedy for _, greedy in mapped] == [greedy for _, greedy in oracle]


def test_the_which_pairs_work_section_is_the_one_the_contract_generates():
    assert which_pairs_work() in (ROOT / "docs/real-weights.md").read_text()


# ---- every family through Pair.handoff --------------------------------------------------------------------------
# Every family the architecture contract accepts, through `Pair.handoff` in every mode it defines and with every
# repair policy of the registry: each runs a forward and scores continuations, and a full repair by any policy, or
# of every layer, gives the oracle's scores (so the exact layers and each policy's query and key paths are the
# model's own, whatever its norms and rotary settings); decoding after the handoff is the model's own greedy decoding.


REPAIRED_MODES = ("direct", "mapped", "shuffled", "zero")  # the modes that hand the target a cache to repair


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def pair(request):
    target = random_of(SUPPORTED[request.param]())
    torch.manual_seed(1)
    source = type(target)(target.config).eval()  # same geometry, other weights: every mode is defined
    return Pair.of(target, source), identity_mapper("source", "target", source.config, target.config)


LOOKAHEAD = parse(SpeculativeParams, committed("speculative", last=2, sinks=1), "speculative")


def _scores(pair, mode, mapper, repair="none"):
    share = 0.5 if MODES[mode].parameter else None  # speculative:0.5
    handoff = pair[0].handoff(mode, mapper, repair=Repair.parse(repair), share=share, speculative=LOOKAHEAD)
    return [score for score, _ in score_continuations(handoff, _requests(n_contexts=3, endings=2), progress=False)]


def test_the_oracle_at_batch_1_in_one_forward_scores_as_its_prefill_then_its_step(pair):
    handoff, requests = pair[0].handoff("oracle"), _requests(n_contexts=3, endings=2)
    one = score_continuations(handoff, requests, batch_size=1, progress=False)
    two = score_continuations(handoff, requests, batch_size=8, progress=False)
    assert [score for score, _ in one] == pytest.approx([score for score, _ in two], abs=1e-5)
    assert [greedy for _, greedy in one] == [greedy for _, greedy in two]


def test_every_mode_runs_and_only_the_oracle_and_direct_agree_where_they_must(pair):
    assert set(pair[0].contract.modes) == set(MODES)
    scores = {mode: _scores(pair, mode, pair[1]) for mode in MODES}
    assert all(torch.isfinite(torch.tensor(values)).all() for values in scores.values())
    assert scores["direct"] == pytest.approx(scores["mapped"], abs=1e-5)  # the identity map moves nothing
    assert scores["mapped"] != pytest.approx(scores["oracle"], abs=1e-3)  # another model's cache


@pytest.mark.parametrize("mode", REPAIRED_MODES)
def test_every_policy_repairs_every_mode_that_hands_off_a_cache(pair, mode):
    for policy in (policy for policy in POLICIES if MODES[mode].hands_over or not SELECTORS[policy].reads_source):
        scores = _scores(pair, mode, pair[1], f"layers:1+sink:1+tokens:0.5:{policy}")
        assert torch.isfinite(torch.tensor(scores)).all(), policy


@pytest.mark.parametrize("repair", ["layers:2", *(f"tokens:1:{policy}" for policy in POLICIES)])
def test_a_full_repair_gives_the_oracles_scores(pair, repair):
    assert _scores(pair, "mapped", pair[1], repair) == pytest.approx(_scores(pair, "oracle", None), abs=1e-4)


def _plain_greedy(model, context: list[int], steps: int) -> list[int]:
    tokens = list(context)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(context):]


def test_decoding_after_the_oracle_handoff_is_the_models_own_greedy_continuation(pair):
    contexts = [list(range(3, 20)), list(range(40, 49))]
    rolled = greedy_rollout(pair[0].handoff("oracle"), contexts, steps=6)
    assert rolled.tolist() == [_plain_greedy(pair[0].target, context, 6) for context in contexts]
    repaired = greedy_rollout(pair[0].handoff("mapped", pair[1], repair=Repair.parse("tokens:1:attention")), contexts,
                              steps=6)
    assert torch.equal(repaired, rolled)


# ---- the run length ---------------------------------------------------------------------------------------------


def test_the_run_length_is_the_longest_sequence_any_stage_feeds_the_models():
    params = {"data": {"sequence_length": 256, "prompt_length": 40, "continuation_length": 16},
              "select": {"prompt_fraction": 0.5, "horizon": 8}, "evaluate": {"horizon": 16},
              "controls": {"horizon": 8}, "length": {"prompt_lengths": [16, 32, 64], "continuation": 8, "horizon": 8},
              "latency": {"lengths": None}, "candidates": {"length": 128}}
    assert run_length(params) == 256
    assert run_length({**params, "data": {**params["data"], "prompt_length": 300}}) == 316  # 300 + evaluate.horizon
    assert run_length({**params, "select": {"prompt_fraction": 0.95, "horizon": 64}}) == 243 + 64
    assert run_length({**params, "length": {"prompt_lengths": [512], "continuation": 32, "horizon": 8}}) == 544
    assert run_length({**params, "latency": {"lengths": [128, 8192]}}) == 8192
    assert run_length({**params, "candidates": {"length": 1024}}) == 1024
    long = {"continuation": 64, "lengths": {1024: {}, 2048: {}}}
    assert run_length({**params, "data": {**params["data"], "long": long}, "operating": {"horizon": 16}}) == 2048 + 64
    assert run_length({**params, "select": {"prompt_lengths": [4096], "continuation": 8, "horizon": 32}}) == 4096 + 32
