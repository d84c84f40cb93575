"""Stage select: the rule picks the candidate that agrees with the oracle, and the best lambda per k."""
import pytest
import torch
from conftest import committed, periodic_batch

from pipeline.kv.kvcache import kv_geometry
from pipeline.kv.mapper import Mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.rope import RotarySpec
from pipeline.schema.select import SelectParams
from pipeline.select import choose, score_candidates, select_prompts
from pipeline.store.params import parse


def linear_copy_mapper(model, noise: float, ridge_lambda: float, seed: int = 0) -> Mapper:
    """k=1 linear map from a model's cache to itself: target head h copies source head h, plus noise."""
    geometry = kv_geometry(model.config)
    heads, dim = geometry["kv_heads"], geometry["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(geometry["layers"]):
        weight = torch.zeros(heads, heads * dim, dim)
        for h in range(heads):
            weight[h, h * dim : (h + 1) * dim] = torch.eye(dim)
        weight += noise * torch.randn(weight.shape, generator=generator)
        pairs.append((weight, torch.zeros(heads, dim)))
    rotary = RotarySpec.from_config(model.config).to_dict()
    return Mapper("linear", "m", "m", geometry, geometry, rotary, rotary, k=1, ridge_lambda=ridge_lambda,
                  source_layers=[[layer] for layer in range(geometry["layers"])], keys=pairs,
                  values=[(w.clone(), b.clone()) for w, b in pairs])


def test_select_picks_the_mapper_that_agrees_with_the_oracle(tmp_path, periodic_model):
    paths = []
    for name, noise, lam in (("linear_k1_noisy", 0.5, 0.1), ("linear_k1_exact", 0.0, 1.0),
                             ("linear_k1_rough", 0.2, 10.0)):
        paths.append(tmp_path / f"{name}.safetensors")
        save_mapper(linear_copy_mapper(periodic_model, noise, lam), paths[-1])
    sequences = periodic_batch(torch.Generator().manual_seed(3), 8, 30, 32).tolist()
    prompts = select_prompts(sequences, 0.6)
    params = parse(SelectParams, committed("select", top_k=32, horizon=4), "select")
    oracle, scores = score_candidates(Pair.of(periodic_model, periodic_model), prompts, params, paths)
    chosen, best_per_k = choose(scores, params.rule)
    assert chosen["name"] == "linear_k1_exact" and best_per_k[1]["name"] == "linear_k1_exact"
    exact = next(s for s in scores if s["name"] == "linear_k1_exact")
    assert exact["agreement"] > 0.99 and abs(exact["ppl_ratio"] - 1) < 1e-3
    assert min(s["agreement"] for s in scores) < exact["agreement"]
    assert exact["attention_cosine"] > 0.999 and oracle["attention_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert choose(scores, "attention_cosine")[0]["name"] == "linear_k1_exact"
    assert min(s["attention_cosine"] for s in scores) < 0.99  # the noisy maps' attention drifts from the oracle's


def test_ties_go_to_lower_perplexity():
    scores = [dict(name="a", agreement=0.5, perplexity=3.0, parameters=1, family="linear", k=1, distilled=False),
              dict(name="b", agreement=0.5, perplexity=2.0, parameters=9, family="linear", k=1, distilled=False)]
    assert choose(scores, "agreement")[0]["name"] == "b"


def test_a_distilled_linear_map_may_be_selected_but_the_best_per_k_stays_closed_form():
    scores = [dict(name="linear_k1_lam1", agreement=0.5, perplexity=3.0, parameters=1, family="linear", k=1,
                   distilled=False),
              dict(name="linear_k1_lam1+kl", agreement=0.7, perplexity=2.0, parameters=1, family="linear", k=1,
                   distilled=True)]
    chosen, best_per_k = choose(scores, "agreement")
    assert chosen["name"] == "linear_k1_lam1+kl" and best_per_k[1]["name"] == "linear_k1_lam1"
