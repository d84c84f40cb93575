"""The mapper families (`kv.families`) and map names (`kv.mapnames`): every list of families is the registry's, the
contract judges each, a name is built and read in one place; the low-rank family's closed form at full rank is the
linear map, and a reduced-rank map is the ridge map projected on the top principal directions of its fitted
values."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, tiny_config
from helpers.scratch import run_edited

from pipeline.fitting import ridge
from pipeline.kv.contract import pair_contract
from pipeline.kv.families import CLOSED_FORM, FAMILIES, FITTED_FAMILIES, TRAINABLE, Geometry
from pipeline.kv.mapnames import MapName


@pytest.mark.parametrize("name", ["linear_k1_lam0.001", "head_matched_k3_lam1e-05", "mlp_k3", "mlp_k3+kl",
                                  "low_rank_k1_r16_lam0.001", "low_rank_k2_r4_lam1e-05+kl", "linear_k4_lam0"])
def test_a_map_name_reads_back_to_the_same_text(name):
    parsed = MapName.parse(name)
    assert str(parsed) == name
    assert parsed.distilled == name.endswith("+kl") and str(parsed.start) == name.removesuffix("+kl")


def test_a_low_rank_name_is_not_read_as_a_family_named_low():
    parsed = MapName.parse("low_rank_k1_r8_lam0.1")
    assert (parsed.family, parsed.k, parsed.rank, parsed.ridge_lambda) == ("low_rank", 1, 8, 0.1)


@pytest.mark.parametrize("name", ["low_k1", "linear_k1", "mlp_k1_lam0.1", "linear_kx_lam1", "identity", "rank_k1"])
def test_a_name_no_family_makes_is_refused_naming_the_forms(name):
    with pytest.raises(ValueError, match="is not a map name.*low_rank_k1_r8_lam0.001"):
        MapName.parse(name)


def test_the_family_lists_are_the_registrys():
    assert set(CLOSED_FORM) | {"mlp"} == set(FITTED_FAMILIES) and set(FITTED_FAMILIES) < set(FAMILIES)
    assert "identity" not in TRAINABLE and {"linear", "head_matched", "mlp", "low_rank"} <= set(TRAINABLE)


def test_the_contract_judges_every_registered_family():
    source, target = tiny_config(64, 32, layers=2), tiny_config(64, 48, layers=3, num_key_value_heads=1)
    contract = pair_contract(target, source)
    assert list(contract.families) == list(FAMILIES)
    assert contract.families["linear"] is None and contract.families["low_rank"] is None
    assert "equal KV head counts" in contract.families["head_matched"]


GEOMETRY = Geometry(heads_s=2, dim_s=3, heads_t=2, dim_t=4)  # F = 6 inputs per source layer, 8 outputs


def _moments(rows: int = 200, seed: int = 0):
    """Moments of correlated rows: x (N, 6) and y = x W + noise (N, 8), W of full rank."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 6, generator=generator, dtype=torch.float64) @ torch.randn(6, 6, generator=generator,
                                                                                     dtype=torch.float64)
    y = x @ torch.randn(6, 8, generator=generator, dtype=torch.float64) + 0.1 * torch.randn(
        rows, 8, generator=generator, dtype=torch.float64) + 3.0
    moments = ridge.Moments.zeros(6, 8, "cpu")
    moments.update(x, y)
    return x, y, moments


def _predict(family: str, tensors: tuple, x: torch.Tensor) -> torch.Tensor:
    return FAMILIES[family].project(x[None], *tensors)[0].permute(1, 0, 2).reshape(len(x), -1)  # (N, H*D)


def _solve(family: str, moments, width):
    return FAMILIES[family].solve(moments, moments, [0], 1e-3, GEOMETRY, "relative", ridge, "cpu", width)


def test_the_low_rank_map_at_full_rank_is_the_linear_map():
    x, _, moments = _moments()
    linear, low_rank = _solve("linear", moments, None), _solve("low_rank", moments, 8)
    assert torch.allclose(_predict("linear", linear.tensors, x), _predict("low_rank", low_rank.tensors, x),
                          atol=1e-8)
    assert torch.allclose(linear.sse_fit, low_rank.sse_fit, rtol=1e-6)


@pytest.mark.parametrize("rank", [1, 3])
def test_the_low_rank_map_keeps_the_top_principal_directions_of_the_fitted_values(rank):
    x, y, moments = _moments()
    fitted = _predict("linear", _solve("linear", moments, None).tensors, x)  # (N, 8)
    centered = fitted - fitted.mean(0)
    _, _, directions = torch.linalg.svd(centered, full_matrices=False)  # rows: principal directions
    top = directions[:rank].T  # (8, r)
    expected = centered @ top @ top.T + fitted.mean(0)  # the fitted values projected, their means kept
    solved = _solve("low_rank", moments, rank)
    assert torch.allclose(_predict("low_rank", solved.tensors, x), expected, atol=1e-8)
    assert solved.tensors[0].shape == (6, rank) and solved.tensors[1].shape == (2, rank, 4)
    sse = ((y - expected) ** 2).sum(0)  # the residuals the solve reports, from moments alone
    assert torch.allclose(solved.sse_fit, sse, rtol=1e-6)


HALVED = '''

class Halved(Linear):
    """A scratch family: the linear map's output halved."""

    name = "halved"

    def project(self, inputs, weight, bias):
        return super().project(inputs, weight, bias) / 2
'''
CANDIDATES = '''
import json
from pathlib import Path

import numpy as np
import torch
from helpers import build_model, measure_params, tiny_config
from helpers.report import _fake_variant, report_params
from pipeline.kv.mapnames import MapName
from pipeline.kv.mapper import random_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.measure.evaluation import OracleStore, evaluate
from pipeline.studies import candidates, render

target, source = build_model(tiny_config(97, 64), seed=1), build_model(tiny_config(97, 32), seed=2)
pair, generator, rng = Pair.of(target, source), torch.Generator().manual_seed(0), np.random.default_rng(0)
prompts = [(torch.randint(0, 97, (12,), generator=generator).tolist(),
            torch.randint(0, 97, (4,), generator=generator).tolist()) for _ in range(6)]
oracle = evaluate(pair.router(mode="oracle"), prompts, store=OracleStore(top_k=5, horizon=2), progress=False)
items = {name: _fake_variant(rng, 0.9 - 0.2 * (name == "source"), 0.9, 1.0)[1] for name in ("oracle", "source")}
candidate_items, maps, fit, select, perplexity = {}, {}, {"maps": {}}, {"maps": {}}, {}
for family in ("linear", "halved"):
    name = str(MapName.parse(str(MapName(family, 1, 0.001))))  # built and read back by the family's own fields
    save_mapper(random_mapper(source.config, target.config, family=family), Path(f"{name}.safetensors"))
    figures = evaluate(pair.router(mode="mapped", mapper=Path(f"{name}.safetensors")), prompts, oracle.oracle,
                       progress=False).figures()["prompts"]
    perplexity[name] = figures["perplexity"]
    candidate_items[name] = _fake_variant(rng, 0.8, 0.85, 1.0)[1]  # the tasks are not what this shows
    maps[name] = {"family": family, "k": 1, "speedup": 2.0, "bound_at_pair": 3.0, "parameters": 10,
                  "mapper_bytes": 100}
    fit["maps"][name] = {"r2_keys_select": 0.5, "r2_values_select": 0.5}
    select["maps"][name] = {"prompts": {"attention_cosine": 0.5, "agreement": figures["agreement"], "mean_kl":
                                        figures["mean_kl"], "confident_top1": None, "confident_agreement": None,
                                        "oracle_weighted_agreement": None}}
study = candidates.compute(report_params(), measure_params(bootstrap_iters=20), candidates.Inputs(
    items, candidate_items, {"length": 16, "bound_pair": "qwen3-v0", "maps": maps}, fit, select))
print(json.dumps({"rows": list(study["rows"]), "perplexity": perplexity,
                  "section": render.section("candidates", study)}))
'''


def test_a_family_added_to_the_registry_alone_is_named_projected_and_reaches_the_candidates_table(tmp_path):
    """In a scratch copy, one class and one registry entry in kv/families.py, no other file: its maps are named and
    read back, built, saved, loaded and projected by a pair's handoff, and the candidates study has their row."""
    edits = {"pipeline/kv/families.py": [("\n\nclass HeadMatched(Family):", HALVED + "\n\nclass HeadMatched(Family):"),
                                         ("(Identity(), Linear(),", "(Identity(), Linear(), Halved(),")]}
    shown = json.loads(run_edited(ROOT, tmp_path, edits, CANDIDATES).splitlines()[-1])
    assert shown["rows"] == ["linear_k1_lam0.001", "halved_k1_lam0.001"]
    assert "\n| halved_k1_lam0.001 | " in shown["section"]  # its row in the table
    assert shown["perplexity"]["halved_k1_lam0.001"] != shown["perplexity"]["linear_k1_lam0.001"]
