"""Distilling a fitted map through the frozen target (`fitting.distill`): the trained map builds the mapped handoff's
cache, its loss has the right gradient and the gradient reaches the map alone, an exact map stays put, a noisy
exact map recovers (also at real Llama shapes, the rate and the regression weight chosen on the select split),
both models come out untouched, the probes choose the rate and weight and are the full run's first steps, timings stay
outside the map, and the result is deterministic and saves as any mapper."""
import copy
import math
from dataclasses import replace

import pytest
import torch
import yaml
from helpers import ARCHITECTURES, ROOT, build_model, periodic_batch, tiny_config
from helpers.distill import HORIZON, PREFIX, VOCAB, content_cache, frozen, oracle_of, random_rows, rows_of
from transformers import Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from pipeline.fitting.distill import (
    TIMED_PARTS,
    Clock,
    DistillSettings,
    chosen_pair,
    distill,
    epoch_batches,
    evaluate,
    losses,
    map_tensors,
    tensors_digest,
    trainable,
)
from pipeline.fitting.distill_rows import Batch, Splits, StoredOracle, with_oracles
from pipeline.kv.families import TRAINABLE
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import Mapper, load_mapper, map_cache, random_mapper, save_mapper
from pipeline.kv.rope import RotarySpec, Rotation
from pipeline.store.shapes import random_model, shape_config

PERIODIC_VOCAB = 32  # the vocabulary `periodic_model` was trained on


def settings(lrs=(1e-2,), kv_weights=(1.0,), batch=16, **overrides) -> DistillSettings:
    """Training settings whose rates are every trainable family's."""
    values = dict(lrs={family: list(lrs) for family in TRAINABLE}, probe_steps=1, weight_decay=0.0, batch_size=batch,
                  epochs=25, patience=5, kv_weights=list(kv_weights), seed=0)
    return DistillSettings(**{**values, **overrides})


def periodic_rows(model, seed: int, rows: int) -> Batch:
    return rows_of(model, model, periodic_batch(torch.Generator().manual_seed(seed), rows, PREFIX + 1 + HORIZON,
                                         PERIODIC_VOCAB))


def exact_map(model) -> Mapper:
    """The linear k=1 map handing `model` its own cache: target head h reads source head h, weight the identity."""
    geometry, spec = kv_geometry(model.config), RotarySpec.from_model(model).to_dict()
    heads, dim = geometry["kv_heads"], geometry["head_dim"]
    weight = torch.zeros(heads, heads * dim, dim)  # (H_t, H_s*D_s, D_t)
    for head in range(heads):
        weight[head, head * dim : (head + 1) * dim] = torch.eye(dim)
    keys, values = ([(weight.clone(), torch.zeros(heads, dim)) for _ in range(geometry["layers"])] for _ in range(2))
    return Mapper("linear", "self", "self", geometry, geometry, spec, spec, k=1,
                  source_layers=[[layer] for layer in range(geometry["layers"])], keys=keys, values=values)


def with_noise(mapper: Mapper, scale: float, seed: int) -> Mapper:
    generator = torch.Generator().manual_seed(seed)
    keys, values = ([tuple(t + scale * torch.randn(t.shape, generator=generator) for t in tensors)
                     for tensors in layers] for layers in (mapper.keys, mapper.values))
    return replace(mapper, keys=keys, values=values)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/fitting/conftest.py: one torch thread, then back


@pytest.fixture(scope="module")
def periodic(periodic_model):
    return frozen(copy.deepcopy(periodic_model))


def start_map(source, target, family: str) -> Mapper:
    """A random k=1 map of `family` for the pair (the mlp's hidden width 8)."""
    if family != "mlp":
        return random_mapper(source.config, target.config, k=1, family=family)
    linear = random_mapper(source.config, target.config, k=1)
    generator = torch.Generator().manual_seed(0)
    width, (heads, dim) = linear.keys[0][0].shape[1], linear.keys[0][1].shape
    keys, values = ([(torch.randn(width, 8, generator=generator) / width**0.5, torch.zeros(8),
                      torch.randn(heads, 8, dim, generator=generator) / 8**0.5, torch.zeros(heads, dim))
                     for _ in linear.keys] for _ in range(2))
    return replace(linear, family="mlp", keys=keys, values=values)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("family", ["linear", "head_matched", "mlp"])
def test_the_trainable_map_builds_the_cache_the_mapped_handoff_injects(architecture, family):
    config = ARCHITECTURES[architecture]
    target, source = frozen(build_model(config(VOCAB, 64), seed=1)), frozen(build_model(config(VOCAB, 32), seed=2))
    start = start_map(source, target, family)
    mapper = trainable(start, "cpu")
    assert mapper.parameter_count() == start.parameter_count()
    assert all(isinstance(t, torch.nn.Parameter) and t.dtype == torch.float32 for t in map_tensors(mapper))
    ids = torch.randint(0, VOCAB, (3, PREFIX), generator=torch.Generator().manual_seed(3))
    handed = Handoff(target, source, "mapped", start).prefix_layers(ids)
    rotation = Rotation(RotarySpec.from_model(target), torch.arange(PREFIX))
    built = [cache for _, cache in map_cache(mapper, content_cache(source, ids), rotation, target.dtype, 'cpu')]
    for (keys, values), (keys_built, values_built) in zip(handed, built, strict=True):
        assert torch.equal(keys, keys_built) and torch.equal(values, values_built)


def rms_norm_in_its_dtype(self, hidden: torch.Tensor) -> torch.Tensor:
    """Qwen3RMSNorm without its float32 upcast, so a float64 model computes in float64 throughout."""
    return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def float64_model(hidden: int, seed: int):
    torch.manual_seed(seed)  # _from_config keeps the rotary inv_freq in float32, as the handoff requires
    model = Qwen3ForCausalLM._from_config(tiny_config(VOCAB, hidden, head_dim=8), dtype=torch.float64)
    for module in model.modules():
        if isinstance(module, Qwen3RMSNorm):  # its float32 rounding would swamp the finite differences
            module.forward = rms_norm_in_its_dtype.__get__(module)
    return frozen(model)


def test_the_loss_gradient_matches_finite_differences_in_float64():
    target, source = float64_model(32, 1), float64_model(16, 2)
    start = random_mapper(source.config, target.config, k=1).to(dtype=torch.float64)
    mapper, handoff, batch = trainable(start, "cpu"), Handoff(target), random_rows(source, target, 4, 2)

    def loss(key_weight, key_bias, value_bias):
        keys = [(key_weight, mapper.keys[0][1]), (mapper.keys[1][0], key_bias)]
        values = [(mapper.values[0][0], value_bias), mapper.values[1]]
        return losses(replace(mapper, keys=keys, values=values), batch, handoff, kv_weight=0.5).total

    inputs = (mapper.keys[0][0], mapper.keys[1][1], mapper.values[0][1])  # (H_t, F, D_t) = (2, 16, 8), (2, 8), (2, 8)
    assert all(t.dtype == torch.float64 and t.requires_grad for t in inputs)
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_only_the_maps_parameters_receive_gradients(random_pair):
    target, source = random_pair
    mapper = trainable(random_mapper(source.config, target.config, k=1), "cpu")
    losses(mapper, random_rows(source, target, 5, 4), Handoff(target), kv_weight=1.0).total.backward()
    assert all(p.grad is None for model in (target, source) for p in model.parameters())
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in map_tensors(mapper))


def test_an_unfrozen_target_an_untrainable_map_and_no_work_to_do_are_refused(random_pair):
    target, source = random_pair
    start = random_mapper(source.config, target.config, k=1)
    splits = Splits([random_rows(source, target, 6, 2)], [random_rows(source, target, 7, 2)])
    with pytest.raises(ValueError, match="must be frozen.*requires_grad_\\(False\\)"):
        distill(start, splits, oracle_of(copy.deepcopy(target).requires_grad_(True)), settings(epochs=1))
    with pytest.raises(ValueError, match="epochs"):
        settings(epochs=0)
    with pytest.raises(ValueError, match="needs fit and select rows, got 2 and 0"):
        distill(start, Splits(splits.fit, [splits.select[0].take([])]), oracle_of(target), settings(epochs=1))
    with pytest.raises(ValueError, match="rotated keys"):
        trainable(replace(start, key_space="rotated"), "cpu")


def test_from_the_exact_map_the_loss_is_zero_and_distillation_keeps_the_map(periodic):
    start = exact_map(periodic)
    fit = periodic_rows(periodic, 1, 32)
    with torch.no_grad():
        scored = losses(trainable(start, "cpu"), fit, Handoff(periodic), kv_weight=1.0)
    assert float(scored.kl.max()) < 1e-6 and float(scored.kv) < 1e-10
    distilled, history = distill(start, Splits([fit], [periodic_rows(periodic, 2, 16)]), oracle_of(periodic),
                                 settings(epochs=4))
    # AdamW's first steps move every entry by about lr however small the gradient, so from an exact map the
    # trained epochs score worse on select, and the select KL is what keeps the start
    assert history[0]["select_kl"] < 1e-6 and distilled.distilled["select_kl"] <= history[0]["select_kl"]
    for moved, kept in zip(map_tensors(distilled), map_tensors(start), strict=True):
        assert (moved - kept).abs().max() < 1e-3


@pytest.fixture(scope="module")
def recovery(periodic):
    """A noisy exact map distilled on periodic text by the KL alone: the start, the map, its history, and the
    target's weights before."""
    start = with_noise(exact_map(periodic), 0.05, seed=5)
    before = {name: t.clone() for name, t in periodic.state_dict().items()}
    splits = Splits([periodic_rows(periodic, 1, 256)], [periodic_rows(periodic, 2, 16)])
    distilled, history = distill(start, splits, oracle_of(periodic),
                                 settings(kv_weights=(0.0,), batch=64, epochs=60, patience=10))
    return dict(start=start, distilled=distilled, history=history, weights_before=before)


def decided_prompts(model, seed: int, rows: int, margin: float) -> Batch:
    """Held-out prompts whose oracle argmax at the handoff position is decided (its top-two log-probability
    margin over `margin` nats): agreement on a near tie flips under any perturbation of the cache."""
    batch = periodic_rows(model, seed, rows)
    with torch.no_grad():
        logits = model(torch.cat([batch.prefix, batch.steps[:, :1]], dim=1)).logits[:, -1]  # (B, V)
    top = torch.log_softmax(logits, -1).topk(2).values  # (B, 2)
    return batch.take(torch.nonzero(top[:, 0] - top[:, 1] > margin).flatten().tolist())


def test_from_a_noisy_exact_map_the_kl_alone_restores_agreement_and_cuts_the_kl_a_hundredfold(periodic, recovery):
    prompts, handoff = decided_prompts(periodic, 3, 48, margin=0.1), Handoff(periodic)
    before = evaluate(trainable(recovery["start"], "cpu"), [prompts], handoff, batch=64)
    after = evaluate(trainable(recovery["distilled"], "cpu"), [prompts], handoff, batch=64)
    print(f"{len(prompts)} prompts: KL {before['kl']:.3g} -> {after['kl']:.3g} ({before['kl'] / after['kl']:.0f}x), "
          f"agreement {before['agreement']:.3f} -> {after['agreement']:.3f}")
    assert len(prompts) >= 32 and before["agreement"] < 1.0
    assert after["agreement"] == 1.0 and after["kl"] * 100 <= before["kl"]


def test_distillation_leaves_the_targets_weights_bit_identical(periodic, recovery):
    after = periodic.state_dict()
    assert after.keys() == recovery["weights_before"].keys()
    assert all(torch.equal(after[name], tensor) for name, tensor in recovery["weights_before"].items())


def test_the_distilled_map_saves_loads_and_hands_off_like_any_mapper(periodic, recovery, tmp_path):
    distilled, start = recovery["distilled"], recovery["start"]
    assert [t.shape for t in map_tensors(distilled)] == [t.shape for t in map_tensors(start)]
    assert distilled.parameter_count() == start.parameter_count() and distilled.family == start.family
    facts = distilled.distilled
    assert facts["best_epoch"] == min(recovery["history"], key=lambda row: row["select_kl"])["epoch"] > 0
    assert facts["steps"] == facts["epochs"] * 4 and facts["kv_weight"] == 0.0  # 256 fit rows, 64 a step
    save_mapper(distilled, tmp_path / "distilled.safetensors")
    loaded = load_mapper(tmp_path / "distilled.safetensors")
    assert loaded.extra == distilled.extra  # bit-identical tensors, and not the start's
    assert facts["start"]["tensors_sha256"] != tensors_digest(distilled) == tensors_digest(loaded)
    prompts = periodic_rows(periodic, 4, 4)
    handoff = Handoff(periodic, periodic, "mapped", loaded)
    handed = handoff.step_logprobs(handoff.prefix_layers(prompts.prefix), prompts.steps)
    scored = losses(trainable(loaded, "cpu"), prompts, Handoff(periodic), kv_weight=0.0)
    oracle = Handoff(periodic)
    reference = oracle.step_logprobs(oracle.prefix_layers(prompts.prefix), prompts.steps)
    kl = torch.nn.functional.kl_div(handed, reference, reduction="none", log_target=True).sum(-1)  # (B, h + 1)
    assert torch.allclose(kl, scored.kl, atol=1e-6)


@pytest.fixture(scope="module")
def random_runs(random_pair):
    """A random map distilled twice with one seed on the random pair (KL alone), and both models' weights
    before."""
    target, source = random_pair
    before = [{name: t.clone() for name, t in model.state_dict().items()} for model in random_pair]
    start = random_mapper(source.config, target.config, k=1)
    splits = Splits([random_rows(source, target, 8, 16)], [random_rows(source, target, 9, 8)])
    runs = [distill(start, splits, oracle_of(target), settings(epochs=3, batch=8, lrs=(3e-3,), kv_weights=(0.0,)))
            for _ in range(2)]
    return dict(runs=runs, weights_before=before)


def test_the_same_seed_distils_bit_identical_tensors_twice(random_runs):
    (first, first_history), (second, second_history) = random_runs["runs"]
    assert all(torch.equal(a, b) for a, b in zip(map_tensors(first), map_tensors(second), strict=True))
    assert first_history == second_history and first.extra == second.extra


def test_the_kl_alone_lowers_the_select_kl_of_a_random_start(random_runs):
    _, history = random_runs["runs"][0]
    assert min(row["select_kl"] for row in history[1:]) < history[0]["select_kl"]


def test_distillation_leaves_the_target_and_source_weights_bit_identical(random_pair, random_runs):
    for model, before in zip(random_pair, random_runs["weights_before"]):
        after = model.state_dict()
        assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_distilling_with_the_oracle_kept_gives_the_maps_of_an_oracle_computed_per_batch(random_pair, random_runs):
    target, source = random_pair
    rows = [random_rows(source, target, 8, 16), random_rows(source, target, 9, 8)]
    groups = with_oracles(rows, oracle_of(target), 8, 2**30)
    assert all(isinstance(group, StoredOracle) for group in groups)
    start = random_mapper(source.config, target.config, k=1)
    kept, history = distill(start, Splits([groups[0]], [groups[1]]), oracle_of(target),
                            settings(epochs=3, batch=8, lrs=(3e-3,), kv_weights=(0.0,)))
    computed, computed_history = random_runs["runs"][0]
    assert all(torch.equal(a, b) for a, b in zip(map_tensors(kept), map_tensors(computed), strict=True))
    assert history == computed_history


def test_an_epochs_batches_keep_one_length_each_and_cover_every_row_once():
    groups = [list(range(5)), list(range(3)), list(range(8))]  # only len() is read
    batches = epoch_batches(groups, 2, torch.Generator().manual_seed(0))
    seen = sorted((group, row) for group, rows in batches for row in rows)
    assert seen == [(g, r) for g, rows in enumerate(groups) for r in rows]
    assert all(len(rows) <= 2 for _, rows in batches)
    assert [group for group, _ in batches] != sorted(group for group, _ in batches)  # the groups are interleaved


RATES, WEIGHTS = (1e-5, 3e-3, 3.0), (0.0, 10.0)  # the regression pulls a random map towards the target's cache


@pytest.fixture(scope="module")
def probed(random_pair):
    """The random map distilled with a grid of three rates by two regression weights (probes of one epoch: 16 fit
    rows, 8 a step), a clock, each pair's own one-epoch run, and the same three rates at the second weight alone."""
    target, source = random_pair
    start = random_mapper(source.config, target.config, k=1)
    splits = Splits([random_rows(source, target, 8, 16)], [random_rows(source, target, 9, 8)])
    clock = Clock()
    run = distill(start, splits, oracle_of(target),
                  settings(lrs=RATES, kv_weights=WEIGHTS, probe_steps=2, epochs=3, batch=8), clock)
    alone = {(lr, kv_weight): distill(start, splits, oracle_of(target),
                                      settings(lrs=(lr,), kv_weights=(kv_weight,), epochs=1, patience=1, batch=8))
             for lr in RATES for kv_weight in WEIGHTS}
    one_weight = distill(start, splits, oracle_of(target),
                         settings(lrs=RATES, kv_weights=WEIGHTS[1:], probe_steps=2, epochs=3, batch=8))
    return dict(run=run, clock=clock, alone=alone, one_weight=one_weight, start=start, splits=splits)


def test_each_probe_scores_the_full_runs_first_steps_at_its_rate_and_weight(probed):
    (mapper, _), alone = probed["run"], probed["alone"]
    probes = mapper.distilled["probes"]
    assert [(row["lr"], row["kv_weight"]) for row in probes] == [(lr, w) for lr in RATES for w in WEIGHTS]
    assert mapper.distilled["probe_steps"] == 2 and mapper.distilled["kv_weights"] == list(WEIGHTS)
    for row in probes:  # a probe of one epoch's steps is the select KL after epoch 1 of a run at that pair alone
        assert row["select_kl"] == alone[row["lr"], row["kv_weight"]][1][1]["select_kl"]


def test_a_probe_grid_over_rates_and_weights_trains_the_pair_of_the_lowest_select_kl_bit_for_bit(probed, random_pair):
    (mapper, history), probes = probed["run"], probed["run"][0].distilled["probes"]
    best = min(probes, key=lambda row: row["select_kl"])
    facts = mapper.distilled
    assert (facts["lr"], facts["kv_weight"]) == (best["lr"], best["kv_weight"])
    at_rate = [row["select_kl"] for row in probes if row["lr"] == best["lr"]]
    assert max(at_rate) > best["select_kl"]  # the weight mattered at the chosen rate
    target, _ = random_pair
    single, single_history = distill(probed["start"], probed["splits"], oracle_of(target),
                                     settings(lrs=(best["lr"],), kv_weights=(best["kv_weight"],), epochs=3, batch=8))
    assert all(torch.equal(a, b) for a, b in zip(map_tensors(mapper), map_tensors(single), strict=True))
    assert history == single_history and single.distilled["probes"] == [] and single.distilled["probe_steps"] == 0


def test_a_one_weight_grid_probes_the_rates_alone_and_records_them_as_a_rate_grid_did(probed):
    (mapper, history), grid = probed["one_weight"], probed["run"][0].distilled["probes"]
    facts, weight = mapper.distilled, WEIGHTS[1]
    assert facts["probes"] == [{"lr": row["lr"], "select_kl": row["select_kl"]} for row in grid
                               if row["kv_weight"] == weight]  # the same probes, each without its weight
    assert "kv_weights" not in facts and facts["kv_weight"] == weight
    best = min(facts["probes"], key=lambda row: row["select_kl"])
    assert facts["lr"] == best["lr"]
    assert history[1]["select_kl"] == probed["alone"][best["lr"], weight][1][1]["select_kl"]


def test_a_diverged_probe_never_wins_and_a_tie_goes_to_the_first_pair_tried():
    assert chosen_pair([{"lr": 1e-2, "kv_weight": 0.1, "select_kl": math.nan},
                        {"lr": 1e-3, "kv_weight": 0.1, "select_kl": 0.7}, {"lr": 1e-3, "kv_weight": 1.0,
                                                                           "select_kl": 0.5},
                        {"lr": 1e-4, "kv_weight": 0.1, "select_kl": 0.5}]) == (1e-3, 1.0)


def test_every_part_of_the_work_is_timed_and_no_timing_enters_the_map(probed, random_pair):
    seconds = probed["clock"].seconds
    assert set(seconds) == set(TIMED_PARTS)
    assert all(seconds[part] > 0 for part in TIMED_PARTS)  # the rows keep no oracle
    mapper = probed["run"][0]
    facts = repr(mapper.distilled)
    assert all(word not in facts for word in ("second", "time", "cost"))
    again, _ = distill(probed["start"], probed["splits"], oracle_of(random_pair[0]),  # no clock: the same bytes
                       settings(lrs=RATES, kv_weights=WEIGHTS, probe_steps=2, epochs=3, batch=8))
    assert again.extra == mapper.extra and all(torch.equal(a, b) for a, b in
                                               zip(map_tensors(again), map_tensors(mapper), strict=True))


BASE = ROOT / "conf" / "base.yaml"
WORLD_TOKENS = 128  # about the tiny world's vocabulary (109 words and specials)


@pytest.mark.realshape
def test_at_llama_shapes_the_rate_and_weight_chosen_on_select_recover_most_of_a_perturbed_exact_maps_kl():
    """Llama-3.2-3B's config (24 heads, 8 KV heads x 128, hidden 3072, llama3 RoPE) cut to 2 of its 28 layers and
    an 8192-token output vocabulary, random weights in float32 (two CPU cores), handed its own cache by the exact
    k=1 map perturbed by 20% of each key and value; the default grids (conf/base.yaml's linear `distill.lrs` by
    `distill.kv_weights`) with probes of 4 steps and 16 epochs of 4 steps must win back at least half of the
    perturbation's select KL. The prompts draw from WORLD_TOKENS ids, as the shape profiles feed the tiny
    world's words: drawn from the whole vocabulary, 32 fit rows' keys span 378 of the 1024 input dimensions,
    and no map the fit rows can teach recovers half of the select KL (issue 37)."""
    config = shape_config("llama-3.2-3b")
    config.num_hidden_layers, config.vocab_size = 2, 8192  # the map's shapes and the attention's stay Llama-3B's
    model = frozen(random_model(config, "float32", "cpu", seed=0))
    fit, select = (rows_of(model, model, torch.randint(0, WORLD_TOKENS, (rows, PREFIX + 1 + HORIZON),
                                                generator=torch.Generator().manual_seed(seed)))
                   for seed, rows in ((1, 32), (2, 16)))
    exact = exact_map(model)
    width = exact.keys[0][0].shape[1]  # H_s * D_s = 1024 inputs per output: the noise keeps its sum's scale
    start = with_noise(exact, 0.2 / width**0.5, seed=5)
    base = yaml.safe_load(BASE.read_text())["distill"]
    chosen = settings(lrs=tuple(base["lrs"]["linear"]), probe_steps=4, batch=8, epochs=16, patience=3,
                      kv_weights=tuple(base["kv_weights"]))
    distilled, history = distill(start, Splits([fit], [select]), oracle_of(model), chosen)
    floor = evaluate(trainable(exact, "cpu"), [select], Handoff(model), 8)["kl"]
    facts = distilled.distilled
    recovered = (facts["select_kl_start"] - facts["select_kl"]) / (facts["select_kl_start"] - floor)
    print(f"\nprobe table (rate x kv_weight -> select KL after {facts['probe_steps']} steps):")
    for row in facts["probes"]:
        chosen = (row["lr"], row["kv_weight"]) == (facts["lr"], facts["kv_weight"])
        print(f"  {row['lr']:g} x {row['kv_weight']:g} -> {row['select_kl']:.5f}{'  (chosen)' if chosen else ''}")
    print(f"select KL exact {floor:.3g}, perturbed {facts['select_kl_start']:.4g}, distilled {facts['select_kl']:.4g} "
          f"(epoch {facts['best_epoch']} of {facts['epochs']}): {recovered:.0%} recovered; "
          f"curve {[round(row['select_kl'], 4) for row in history]}")
    assert floor < 1e-4 and recovered >= 0.5
