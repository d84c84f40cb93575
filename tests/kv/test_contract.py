"""The architecture contract: each supported family is handled exactly, each other model is refused up front."""
import pytest
import torch
from helpers import ROOT, build_model, tiny_config
from helpers.architectures import SUPPORTED, VOCAB, _full_forward_scores, _requests, config_of, random_of
from lm_eval.api.instance import Instance

from pipeline import check_pair
from pipeline.controls import rope_against_model
from pipeline.fitting import ridge
from pipeline.kv.contract import (
    TESTED_FAMILIES,
    LongerThanWindowError,
    UnsupportedModelError,
    pair_contract,
    which_pairs_work,
)
from pipeline.kv.decode import greedy_rollout
from pipeline.kv.flops import mapper_parameter_count
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import cache_to_layers, kv_geometry
from pipeline.kv.mapper import Mapper
from pipeline.kv.rope import RotarySpec, Rotation, UnsupportedRopeError
from pipeline.kv.scoring import score_continuations
from pipeline.lm_eval_model import KVTransferLM
from pipeline.store.models import IncompatiblePairError
from pipeline.store.shapes import pair_configs

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


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_familys_rotary_spec_strips_exactly_what_the_model_rotated(name):
    model = random_of(SUPPORTED[name]())
    prompts = [torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(1)).tolist()]
    result = rope_against_model(model, prompts, RotarySpec.from_model(model), 1e-5)
    assert result["passed"], result


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
            Handoff(model, model, mode, mapper=None if mode == "oracle" else object())
        message = str(info.value)
        assert feature in message and f"tiny-{config.model_type}" in message and "\n" not in message


def test_sliding_window_shorter_than_the_run_is_refused_and_a_longer_one_is_exact():
    config = config_of("mistral", head_dim=16, sliding_window=48)
    assert not pair_contract(config, max_tokens=100).defined("oracle")
    model = random_of(config)
    with pytest.raises(UnsupportedModelError, match="sliding window of 48 tokens, active at 100"):
        Handoff(model, max_tokens=100)
    requests = _requests(n_contexts=3, endings=2, seed=3)  # at most 39 + 5 = 44 tokens: the window never masks
    results = score_continuations(Handoff(model, max_tokens=44), requests, progress=False)
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


def test_a_model_cast_to_bfloat16_after_loading_is_refused_naming_its_inv_freq():
    model = random_of(SUPPORTED["llama"]()).to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    with pytest.raises(UnsupportedRopeError, match="bfloat16 inv_freq"):
        Handoff(model)


def test_scaled_rope_spec_carries_the_models_frequencies_and_attention_factor():
    config = SUPPORTED["llama-yarn"]()
    model = random_of(config)
    spec = RotarySpec.from_model(model)
    assert spec.attention_scaling == pytest.approx(model.model.rotary_emb.attention_scaling) != 1.0
    assert torch.equal(spec.inv_freq("cpu"), model.model.rotary_emb.inv_freq)
    assert spec.to_dict()["scaling"]["factor"] == 4.0
    plain = RotarySpec.from_config(config_of("llama", head_dim=16))
    assert plain.to_dict() == {"rope_type": "default", "theta": 10000.0, "head_dim": 16, "max_positions": 512}


def test_pair_verdicts_name_what_differs():
    source, target = config_of("qwen3", head_dim=16), config_of("qwen3", head_dim=32, num_key_value_heads=4)
    contract = pair_contract(target, source)
    assert contract.defined("mapped") and contract.family_defined("linear") and contract.family_defined("mlp")
    assert "equal KV geometry" in contract.reason("direct")
    assert "equal KV head counts" in contract.families["head_matched"]
    assert contract.tokenizers == "unchecked"
    with pytest.raises(IncompatiblePairError, match="equal KV geometry"):
        contract.require("direct")


def test_a_folder_inside_the_repository_is_named_relative_to_it_and_one_elsewhere_by_its_absolute_path(tmp_path):
    source, target = config_of("qwen3", head_dim=16), config_of("qwen3", head_dim=32)
    source._name_or_path = str(ROOT.resolve() / "models" / "converted")
    target._name_or_path = str(tmp_path / "elsewhere")
    reason = pair_contract(target, source).reason("direct")
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
    message = pair_contract(config, max_tokens=100).reason("oracle")
    assert message.index("not a family") < message.index("it also has a sliding window of 32 tokens")
    assert "sliding window" not in pair_contract(config, max_tokens=32).reason("oracle")


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
    oracle = KVTransferLM(Handoff(target), tokenizer).loglikelihood(requests, disable_tqdm=True)
    handoff = Handoff(target, source, "mapped", mapper, tokenizers=(tokenizer, tokenizer))
    mapped = KVTransferLM(handoff, tokenizer).loglikelihood(requests, disable_tqdm=True)
    assert [ll for ll, _ in mapped] == pytest.approx([ll for ll, _ in oracle], abs=1e-4)
    assert [greedy for _, greedy in mapped] == [greedy for _, greedy in oracle]


def test_readme_which_pairs_work_section_is_the_one_the_contract_generates():
    assert which_pairs_work() in (ROOT / "README.md").read_text()


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
