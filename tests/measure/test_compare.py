"""Agreement with the stored oracle: the oracle agrees with itself, nulls do not, KL is exact on a full top-K."""
import pytest
import torch
from helpers import periodic_batch

from pipeline.kv.handoff import Handoff
from pipeline.measure.compare import _kl_on_top, oracle_outputs, variant_rows
from pipeline.measure.prompt_metrics import attention_layers, prompt_figures


def summarize(rows):
    """The figures that need no confident margin, with the attention cosine per layer where stored."""
    figures = prompt_figures(rows, None)
    return figures | ({"layers": attention_layers(rows)} if "attention_cosine" in rows else {})


@pytest.fixture(scope="module")
def prompts():
    sequences = periodic_batch(torch.Generator().manual_seed(2), 12, 34, 32).tolist()
    return [(s[:24], s[24:]) for s in sequences]


def test_oracle_against_itself_is_perfect(periodic_model, prompts):
    oracle = Handoff(periodic_model)
    stored = oracle_outputs(oracle, prompts, top_k=64, horizon=6, batch_size=5, progress=False)
    summary = summarize(variant_rows(oracle, prompts, stored, batch_size=5, progress=False))
    assert summary["next_token_top1"] == 1.0 and summary["agreement"] == 1.0
    assert summary["rollout_agreement"] == 1.0 and summary["mean_kl"] < 1e-6
    assert summary["perplexity"] < 3.0


def test_null_controls_lose_agreement(periodic_model, prompts):
    stored = oracle_outputs(Handoff(periodic_model), prompts, top_k=64, horizon=6, batch_size=5, progress=False)
    for mode in ("zero", "shuffled"):
        summary = summarize(variant_rows(Handoff(periodic_model, periodic_model, mode), prompts, stored,
                                         batch_size=5, progress=False))
        assert summary["agreement"] < 0.8 and summary["mean_kl"] > 0.1


def test_attention_output_cosine_is_one_for_the_oracle_and_lower_for_the_nulls_at_every_layer(periodic_model, prompts):
    stored = oracle_outputs(Handoff(periodic_model), prompts, top_k=64, horizon=6, batch_size=5, progress=False,
                            attention=True)
    layers = periodic_model.config.num_hidden_layers
    assert len(stored["attention"]) == len(prompts)
    assert stored["attention"][0].shape == (layers, len(prompts[0][1]), periodic_model.config.hidden_size)
    oracle = summarize(variant_rows(Handoff(periodic_model), prompts, stored, batch_size=5, progress=False))
    assert oracle["layers"] == pytest.approx([1.0] * layers, abs=1e-5)
    for mode in ("zero", "shuffled"):
        null = summarize(variant_rows(Handoff(periodic_model, periodic_model, mode), prompts, stored, batch_size=5,
                                      progress=False))
        assert len(null["layers"]) == layers and max(null["layers"]) < 0.99, mode
        assert null["attention_cosine"] < oracle["attention_cosine"] - 0.05, mode
    plain = summarize(variant_rows(Handoff(periodic_model), prompts, oracle_outputs(
        Handoff(periodic_model), prompts, top_k=64, horizon=6, batch_size=5, progress=False), 5, progress=False))
    assert "attention_cosine" not in plain  # stored outputs without attention (evaluate's): nothing added


def test_kl_on_full_top_k_is_the_exact_kl():
    torch.manual_seed(0)
    p = torch.log_softmax(torch.randn(5, 10), -1)
    q = torch.log_softmax(torch.randn(5, 10), -1)
    values, ids = p.topk(10, dim=-1)
    exact = (p.exp() * (p - q)).sum(-1)
    assert torch.allclose(_kl_on_top(values, ids, q), exact, atol=1e-5)
    values3, ids3 = p.topk(3, dim=-1)
    assert (_kl_on_top(values3, ids3, q) <= exact + 1e-6).all()  # a coarser partition never exceeds it


@pytest.mark.parametrize("mode", ["oracle", "shuffled"])
def test_prompts_of_different_lengths_compare_in_batches_as_one_at_a_time(periodic_model, mode):
    sequences = periodic_batch(torch.Generator().manual_seed(4), 8, 40, 32).tolist()
    prompts = [(s[: 12 + 3 * i], s[12 + 3 * i : 20 + 3 * i]) for i, s in enumerate(sequences)]  # 12..33 tokens
    stored = {size: oracle_outputs(Handoff(periodic_model), prompts, top_k=64, horizon=6, batch_size=size,
                                   progress=False) for size in (1, 4)}
    assert torch.equal(stored[1]["top_ids"], stored[4]["top_ids"]) and torch.equal(stored[1]["greedy"],
                                                                                   stored[4]["greedy"])
    assert torch.allclose(stored[1]["top_logprobs"], stored[4]["top_logprobs"], atol=1e-4)
    handoff = Handoff(periodic_model, periodic_model, mode) if mode != "oracle" else Handoff(periodic_model)
    one, batched = (variant_rows(handoff, prompts, stored[1], batch_size=size, progress=False) for size in (1, 4))
    for column in ("first_agree", "agree", "rollout_agree"):
        assert one[column].tolist() == batched[column].tolist(), column
    assert batched.nll.tolist() == pytest.approx(one.nll.tolist(), abs=1e-4)
    assert batched.kl.tolist() == pytest.approx(one.kl.tolist(), abs=1e-4)
