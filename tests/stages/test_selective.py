"""Selective handoff: scores from the handoff's first step only, the gate's limits, AUROC and the threshold rule, and
lm-eval through a gated `kv-transfer` against the stage's own composition of the ungated runs."""
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import ARCHITECTURES, build_model, committed, hellaswag_rows, piqa_rows

from pipeline.kv.gate import Gate, Probe, Scorer, fit_probe
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import random_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.scores.disagree import jensen_shannon
from pipeline.kv.scores.registry import FEATURES, SCORES
from pipeline.kv.scoring import score_continuations
from pipeline.lm_eval_model import KVTransferLM
from pipeline.measure import gating
from pipeline.measure.confident import MARGINS
from pipeline.measure.taskeval import evaluate_tasks
from pipeline.schema.selective import SelectiveParams
from pipeline.selective import METRIC, add_probe, item_rows, summarize, task_frame, train_probe
from pipeline.store.artifacts import ArtifactError
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.params import ParamError, parse
from pipeline.studies import selective as study
from pipeline.studies.settings import ReportParams

VOCAB = 97
E2E_ITEMS = 8  # per task: the end-to-end gate check on real items


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def models(request):
    """The tiny pair, Qwen3-shaped and Llama (helpers.ARCHITECTURES): every gate test runs on both."""
    config = ARCHITECTURES[request.param]
    return build_model(config(VOCAB, 64), seed=1), build_model(config(VOCAB, 32), seed=2)


@pytest.fixture(scope="module")
def handoffs(models):
    target, source = models
    maps = [random_mapper(source.config, target.config, k=k, seed=k) for k in (1, 2)]
    return [Handoff(target, source, "mapped", mapper) for mapper in maps]


def _contexts(count=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 30, (1,), generator=generator)),),
                          generator=generator).tolist() for _ in range(count)]


def _probe() -> Probe:
    """A probe over every feature with fixed weights: the `probe` score's path without a fit."""
    count = len(FEATURES)
    return Probe(FEATURES, [0.0] * count, [1.0] * count, [0.5, -0.2, 1.0, 2.0, -1.0, 0.3][:count], 0.1)


def _requests(contexts, endings=2, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(None, context, torch.randint(0, VOCAB, (3,), generator=generator).tolist())
            for context in contexts for _ in range(endings)]


def test_scores_are_computed_without_the_target_prefilling_the_prompt(models, handoffs, monkeypatch):
    target, _ = models
    body = target.model.forward

    def one_token_only(*args, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[1] > 1:
            raise AssertionError("the target prefilled the prompt")
        return body(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(target.model, "forward", one_token_only)
    monkeypatch.setattr(Handoff, "prefix_layers", lambda *args, **kwargs: pytest.fail("prefix_layers was called"))
    scores = Scorer(handoffs[0], tuple(handoffs), _probe()).scores(_contexts(), [*SCORES, *FEATURES], batch_size=4)
    for name in [*SCORES, *FEATURES]:
        assert torch.isfinite(scores[name]).all(), name
        assert name in ("probe", "key_norm", "value_norm") or (scores[name] >= 0).all(), name


def test_scores_of_a_padded_batch_equal_each_context_scored_alone(handoffs):
    scorer, contexts = Scorer(handoffs[0], tuple(handoffs), _probe()), _contexts(seed=3)
    together = scorer.scores(contexts, [*SCORES, *FEATURES], batch_size=len(contexts))
    for row, context in enumerate(contexts):
        alone = scorer.scores([context], [*SCORES, *FEATURES], batch_size=1)
        for name in [*SCORES, *FEATURES]:
            assert alone[name][0].item() == pytest.approx(together[name][row].item(), rel=1e-4, abs=1e-6), name


def test_a_one_token_context_hands_off_nothing_and_scores_minus_infinity(handoffs):
    scores = Scorer(handoffs[0]).scores([[5], [5, 6, 7]], ["entropy"])["entropy"]
    assert scores[0] == float("-inf") and math.isfinite(scores[1])


def test_two_identical_maps_never_disagree(handoffs):
    scores = Scorer(handoffs[0], (handoffs[0], handoffs[0])).scores(_contexts(), ["disagree"])["disagree"]
    assert torch.allclose(scores, torch.zeros_like(scores), atol=1e-6)
    assert jensen_shannon(torch.log_softmax(torch.randn(3, 5), -1), torch.log_softmax(torch.randn(3, 5), -1)).le(
        math.log(2)).all()


def _gated(models, handoffs, threshold, score="entropy"):
    target, _ = models
    gate = Gate(Scorer(handoffs[0], tuple(handoffs)), score, threshold, Handoff(target))
    return KVTransferLM(handoffs[0], tokenizer=None, batch_size=4, gate=gate)


def test_the_gate_at_plus_infinity_is_the_ungated_handoff_and_at_minus_infinity_the_oracle(models, handoffs):
    target, _ = models
    requests = _requests(_contexts(seed=5))
    pairs = [(context, continuation) for _, context, continuation in requests]
    ungated = score_continuations(handoffs[0], pairs, 4, progress=False)
    oracle = score_continuations(Handoff(target), pairs, 4, progress=False)
    for threshold, expected in ((float("inf"), ungated), (float("-inf"), oracle)):
        got = _gated(models, handoffs, threshold)._loglikelihood_tokens(requests, disable_tqdm=True)
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], abs=1e-4)


def test_a_gated_request_gets_the_oracle_exactly_where_its_score_exceeds_the_threshold(models, handoffs):
    target, _ = models
    contexts = _contexts(count=8, seed=7)
    requests = _requests(contexts)
    scores = Scorer(handoffs[0], tuple(handoffs)).scores(contexts, ["kl"])["kl"]
    ordered = scores.sort().values
    # halfway between the two middle scores: torch's median is one of the scores, and the gate scores each request
    # in its own batch, where float32 rounding may put that one a hair either side of it
    threshold = float(ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    lm = _gated(models, handoffs, threshold, "kl")
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    pairs = [(context, continuation) for _, context, continuation in requests]
    ungated = score_continuations(handoffs[0], pairs, 4, progress=False)
    oracle = score_continuations(Handoff(target), pairs, 4, progress=False)
    for index, (_, context, _) in enumerate(requests):
        fell_back = scores[contexts.index(context)].item() > threshold
        assert lm.router.decisions[tuple(context)][1] == fell_back
        assert got[index][0] == pytest.approx((oracle if fell_back else ungated)[index][0], abs=1e-4)
    assert 0 < sum(way for _, way in lm.router.decisions.values()) < len(contexts)


def test_a_gate_must_fall_back_to_the_targets_own_prefill(handoffs):
    with pytest.raises(ValueError, match="oracle"):
        Gate(Scorer(handoffs[0]), "entropy", 0.0, handoffs[1])
    with pytest.raises(ValueError, match="unknown score"):
        Gate(Scorer(handoffs[0]), "perplexity", 0.0, handoffs[1])


def test_auroc_of_a_constructed_case():
    assert gating.auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert gating.auroc([1, 1, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.5)  # ties count one half
    assert gating.auroc([3, 2, 1], [1, 1, 0]) == 1.0
    assert math.isnan(gating.auroc([1, 2], [1, 1]))


def _items(mapped, oracle, task="piqa"):
    return pd.DataFrame({"task": task, "item": range(len(mapped)), "mapped": mapped, "oracle": oracle})


def test_the_threshold_is_the_highest_that_reaches_the_declared_quality_on_its_split():
    items = _items(mapped=[0, 1, 1, 0, 1, 1], oracle=[1, 1, 1, 1, 1, 1])  # PIQA: chance 0.5
    scores = np.array([0.9, 0.1, 0.2, 0.7, 0.3, 0.4])  # the two wrong items score highest

    def quality(fallback: np.ndarray) -> float:
        return gating.item_quality(items, fallback)["retention"]

    assert gating.choose_threshold(scores, quality, 1.0) == pytest.approx(0.4)  # falls back on 0.9 and 0.7 only
    assert gating.choose_threshold(scores, quality, 0.3) == float("inf")  # ungated: (4/6 - .5) / .5 = 0.33
    assert gating.choose_threshold(np.zeros(6), quality, 1.0) == float("-inf")  # no score separates them


def test_item_quality_is_the_mean_over_tasks_of_each_tasks_retention_and_gap_closure_whatever_the_row_order():
    items = pd.DataFrame({"task": ["piqa", "hellaswag"] * 4, "item": range(8),
                          "mapped": [1, 1, 1, 0, 0, 0, 0, 1], "oracle": [1, 1, 1, 1, 1, 1, 0, 1],
                          "source": [0, 0, 0, 0, 0, 0, 0, 1]})
    # hellaswag (chance 0.25): mapped 0.5, oracle 1, source 0.25; piqa (chance 0.5): mapped 0.5, oracle 0.75, source 0
    ungated = gating.item_quality(items, np.zeros(8, bool))
    assert ungated["retention"] == pytest.approx(((0.5 - 0.25) / 0.75 + 0) / 2)
    assert ungated["gap_closure"] == pytest.approx(((0.5 - 0.25) / 0.75 + 0.5 / 0.75) / 2)
    fallback = np.array([False, False, False, True, False, False, False, False])  # one hellaswag miss: the oracle's
    assert gating.item_quality(items, fallback)["retention"] == pytest.approx(((0.75 - 0.25) / 0.75 + 0) / 2)
    shuffled = [7, 2, 4, 0, 6, 1, 3, 5]
    assert gating.item_quality(items.iloc[shuffled].reset_index(drop=True), fallback[shuffled]) == \
        pytest.approx(gating.item_quality(items, fallback))
    assert math.isnan(gating.item_quality(items.drop(columns="source"), fallback)["gap_closure"])


def test_the_oracle_curve_reaches_the_oracle_at_the_share_the_map_changes_and_random_is_in_between():
    items = _items(mapped=[0, 1, 0, 1, 1, 1, 1, 1], oracle=[1] * 8)
    changed = items.mapped != items.oracle
    references = gating.reference_scores(changed, seed=0)
    rates = [0.0, 0.25, 1.0]
    oracle = gating.curve(items, references["oracle"], gating.item_quality, rates, seed=0)
    assert [row["retention"] for row in oracle] == pytest.approx([0.5, 1.0, 1.0])
    random = gating.curve(items, references["random"], gating.item_quality, rates, seed=0)
    assert random[0]["retention"] == 0.5 and random[-1]["retention"] == 1.0


def test_the_effective_speedup_is_the_handoff_alone_without_fallback_and_below_one_with_all():
    assert gating.effective_speedup(10.0, 4.0, 1.0, 0.0) == pytest.approx(2.0)
    assert gating.effective_speedup(10.0, 4.0, 1.0, 1.0) < 1.0


@pytest.fixture(scope="module")
def sharp_pair(wide_pair, tmp_path_factory) -> dict[str, Path]:
    """conftest's wide pair (where a map changes decisions), a random k=1 map of it, and a few real HellaSwag and
    PIQA items as Parquet, as the stage reads them."""
    root = tmp_path_factory.mktemp("sharp")
    source, target = (Pair(str(wide_pair[side])).target for side in ("source", "target"))
    mapper = random_mapper(source.config, target.config, k=1, seed=0)
    mapper.models = pair_fingerprints(str(wide_pair["source"]), str(wide_pair["target"]))  # bound to its pair
    save_mapper(mapper, root / "k1.safetensors")
    pd.DataFrame(hellaswag_rows(E2E_ITEMS)).to_parquet(root / "hellaswag.parquet", index=False)
    pd.DataFrame(piqa_rows(E2E_ITEMS)).to_parquet(root / "piqa.parquet", index=False)
    return {**wide_pair, "mapper": root / "k1.safetensors", "hellaswag": root / "hellaswag.parquet",
            "piqa": root / "piqa.parquet"}


def _between(scores: np.ndarray) -> float:
    """A threshold in the widest gap between the middle half of the scores: some fall back, some do not, and no
    score lies within float noise of it."""
    ranked = np.sort(scores)
    middle = ranked[len(ranked) // 4 : len(ranked) - len(ranked) // 4]
    gap = int(np.argmax(np.diff(middle)))
    return float((middle[gap] + middle[gap + 1]) / 2)


@pytest.mark.slow  # three lm-eval runs and a scoring pass: 11 s on a quiet 2-core machine, 31 s on a busy one
def test_lm_eval_through_a_gated_kv_transfer_gives_per_item_the_stages_composition_of_mapped_and_oracle(sharp_pair):
    files = {task: sharp_pair[task] for task in ("hellaswag", "piqa")}
    pair = Pair(str(sharp_pair["target"]), str(sharp_pair["source"]), "float32", "cpu")
    mapped = pair.handoff("mapped", sharp_pair["mapper"])
    # the stage's way (selective.score_requests): each handoff ungated through lm-eval, each item's context scored
    frames = {name: task_frame(pair, handoff, files, 4)
              for name, handoff in (("mapped", mapped), ("oracle", pair.handoff("oracle")))}
    scores = Scorer(mapped).scores(list(frames["mapped"].tokens), ["kl"], 4)
    rows = item_rows("eval", "k1", frames["mapped"], {"oracle": frames["oracle"]}, scores)
    threshold = _between(rows.score_kl.to_numpy())
    fallback = rows.score_kl.to_numpy() > threshold
    expected = {metric: gating.gated(rows.assign(mapped=frames["mapped"][metric], oracle=frames["oracle"][metric]),
                                     fallback) for metric in ("acc", "acc_norm")}
    assert (expected[METRIC] == gating.gated(rows, fallback)).all()

    lm = KVTransferLM.from_args(target=str(sharp_pair["target"]), source=str(sharp_pair["source"]), transfer="mapped",
                                mapper=str(sharp_pair["mapper"]), dtype="float32", device="cpu", batch_size=4,
                                fallback="kl", threshold=repr(threshold))
    _, got = evaluate_tasks(lm, files)
    assert list(zip(got.task, got.item)) == list(zip(rows.task, rows.item))
    # each item went the way its score implies, all its endings the same way (one context per item)
    assert len(lm.router.decisions) == len(set(map(tuple, frames["mapped"].tokens)))
    for tokens, score, fell_back in zip(frames["mapped"].tokens, rows.score_kl, fallback):
        assert lm.router.decisions[tuple(tokens)][0] == pytest.approx(score, rel=1e-4)
        assert lm.router.decisions[tuple(tokens)][1] == fell_back
    for metric in ("acc", "acc_norm"):
        assert got[metric].tolist() == expected[metric].tolist(), metric
        chosen = {name: gating.decisions(frame, metric) for name, frame in frames.items()}
        assert gating.decisions(got, metric).tolist() == np.where(fallback, chosen["oracle"], chosen["mapped"]).tolist()
    for lls, mapped_lls, oracle_lls, fell_back in zip(got.loglikelihoods, frames["mapped"].loglikelihoods,
                                                      frames["oracle"].loglikelihoods, fallback):
        assert lls == pytest.approx(oracle_lls if fell_back else mapped_lls, abs=1e-4)
    # the case can fail: the gate sent some items each way, and the gated answers differ from both ungated runs
    assert 0 < fallback.sum() < len(fallback)
    assert (expected[METRIC] != rows["mapped"]).any() and (expected[METRIC] != rows.oracle).any()


@pytest.mark.parametrize("fallback, threshold, disagree, message", [
    (None, "0.5", None, "give fallback=<score> too"),
    ("kl", None, None, "needs threshold=<number>"),
    ("disagree", "0.5", "only_one.safetensors", "name two mapper files"),
    ("disagree", "0.5", None, "needs disagree="),
])
def test_kv_transfer_refuses_a_gate_missing_a_part_naming_the_model_arg(tiny_pair, fallback, threshold, disagree,
                                                                       message):
    with pytest.raises(ParamError, match=message):
        KVTransferLM.from_args(target=str(tiny_pair["target"]), source=str(tiny_pair["source"]), transfer="direct",
                               device="cpu", fallback=fallback, threshold=threshold, disagree=disagree)


def _probe_rows(part: str, count: int = 60, seed: int = 0) -> pd.DataFrame:
    """Requests where `feature_top1` alone separates "the map changes the decision"; the others are noise."""
    rng = np.random.default_rng(seed)
    changed = rng.random(count) < 0.4
    rows = pd.DataFrame({"part": part, "changed": changed,
                         "feature_top1": np.where(changed, 0.2, 0.6) + rng.uniform(-0.15, 0.15, count)})
    for name in ("score_entropy", "score_kl", "feature_key_norm", "feature_value_norm"):
        rows[name] = rng.normal(size=count)
    return rows


def test_a_probe_where_one_feature_separates_the_classes_reaches_auroc_one_on_held_out_rows():
    features = ("entropy", "kl", "top1")
    probe = train_probe(_probe_rows("dev"), features, l2=1.0)
    held_out = _probe_rows("eval", seed=1)
    scores = probe({name: held_out[f"score_{name}" if name != "top1" else "feature_top1"] for name in features})
    assert gating.auroc(scores.numpy(), held_out.changed) == 1.0
    assert probe.weights[2] < 0  # a confident target is trusted: low top-1 probability, high score
    assert probe == train_probe(_probe_rows("dev"), features, l2=1.0)  # deterministic


@pytest.mark.parametrize("parts", [["eval"], ["dev", "eval"]])
def test_the_probe_refuses_to_train_on_any_row_outside_the_dev_items(parts):
    rows = pd.concat([_probe_rows(part) for part in parts], ignore_index=True)
    with pytest.raises(ValueError, match="dev items only.*'eval'"):
        train_probe(rows, ("entropy", "kl", "top1"), l2=1.0)


def test_a_probe_of_one_class_is_constant_and_its_l2_penalty_shrinks_its_weights():
    values = {"a": np.arange(6.0), "b": np.array([0.0, 1, 0, 1, 0, 1])}
    flat = fit_probe(values, [False] * 6, ("a", "b"), l2=1.0)
    assert flat.weights == [0.0, 0.0] and torch.unique(flat(values)).numel() == 1
    labels = [False, False, True, False, True, True]
    loose, tight = (fit_probe(values, labels, ("a", "b"), l2=l2) for l2 in (0.01, 100.0))
    assert np.linalg.norm(tight.weights) < np.linalg.norm(loose.weights)


def test_a_dev_items_probe_score_is_out_of_fold_so_its_own_label_cannot_move_it():
    params = parse(SelectiveParams, {**committed("selective"), "maps": {"a": "a.safetensors"}}, "selective")
    items = pd.concat([_probe_rows("dev", seed=0), _probe_rows("eval", seed=1)], ignore_index=True).assign(map="a")
    prompts = _probe_rows("eval", seed=2).assign(map="a")
    scored = items.copy()
    add_probe(scored, prompts.copy(), params, disagree=None)
    flipped = items.copy()
    flipped.loc[0, "changed"] = not flipped.loc[0, "changed"]  # dev item 0, fold 0
    add_probe(flipped, prompts.copy(), params, disagree=None)
    same_fold = (np.arange(60) % params.probe_folds == 0)
    assert flipped.score_probe[0] == scored.score_probe[0]  # its score came from the probe of the other folds
    assert not np.allclose(flipped.score_probe[:60][~same_fold], scored.score_probe[:60][~same_fold])  # theirs did not
    assert not np.allclose(flipped.score_probe[60:], scored.score_probe[60:])  # nor the eval items' probe


def test_a_gate_by_the_probe_needs_a_fitted_probe(handoffs):
    with pytest.raises(ValueError, match="fitted on dev items"):
        Gate(Scorer(handoffs[0]), "probe", 0.0, Handoff(handoffs[0].decoder))


def test_the_stage_trains_each_maps_probe_on_its_dev_items_alone_and_scores_every_request():
    params = parse(SelectiveParams, {**committed("selective"), "maps": {"a": "a.safetensors", "b": "b.safetensors"}},
                   "selective")
    items = pd.concat([_probe_rows(part, seed=seed).assign(map=name) for seed, (name, part) in
                       enumerate((name, part) for name in params.maps for part in ("dev", "eval"))], ignore_index=True)
    prompts = pd.concat([_probe_rows("eval", seed=9).assign(map=name) for name in params.maps], ignore_index=True)
    probes = add_probe(items, prompts, params, disagree=None)
    assert set(probes) == {"a", "b"} and probes["a"] != probes["b"]
    assert items.score_probe.notna().all() and prompts.score_probe.notna().all()
    assert "disagree" not in probes["a"].features  # no two maps given: the probe does without that feature

    def flipped(part):
        return items.assign(changed=np.where(items.part == part, ~items.changed, items.changed))

    assert add_probe(flipped("eval"), prompts.copy(), params, disagree=None) == probes  # eval labels unread
    assert add_probe(flipped("dev"), prompts.copy(), params, disagree=None) != probes


def test_the_auroc_interval_brackets_the_auroc_and_a_score_blind_to_the_labels_straddles_one_half():
    rng = np.random.default_rng(0)
    changed = rng.random(300) < 0.35
    scores = changed + rng.normal(size=300)  # informative: AUROC about 0.76
    area, (low, high) = gating.auroc(scores, changed), gating.auroc_interval(scores, changed, 2000, 0)
    assert 0.5 < low < area < high < 1
    # the control fails on a broken input: the same scores detached from their requests tell nothing
    blind = gating.auroc_interval(rng.permutation(scores), changed, 2000, 0)
    assert blind[0] < 0.5 < blind[1]
    assert gating.auroc_interval(scores, changed, 2000, 0) == (low, high)  # seeded
    assert all(math.isnan(bound) for bound in gating.auroc_interval(scores, np.ones(300, bool), 2000, 0))


def _prompts(first_agree, confident) -> pd.DataFrame:
    return pd.DataFrame({"first_agree": first_agree, "rollout_agree": [2 * a for a in first_agree],
                         "horizon": 2, "confident": confident})


def test_confident_top1_under_the_gate_counts_only_the_prompts_where_the_oracle_is_sure():
    prompts = _prompts([1, 0, 1, 0, 0, 1], [True, True, True, False, False, False])
    fallback = np.zeros(6, bool)
    assert gating.prompt_quality(prompts, fallback)["next_token_top1"] == pytest.approx(3 / 6)
    assert gating.prompt_quality(prompts, fallback)["confident_top1"] == pytest.approx(2 / 3)
    fallback[3] = True  # a near-tie the map missed: top-1 gains, the confident top-1 cannot
    assert gating.prompt_quality(prompts, fallback)["next_token_top1"] == pytest.approx(4 / 6)
    assert gating.prompt_quality(prompts, fallback)["confident_top1"] == pytest.approx(2 / 3)
    fallback[1] = True  # the confident prompt the map missed: the oracle's answer
    assert gating.prompt_quality(prompts, fallback)["confident_top1"] == 1.0
    assert math.isnan(gating.prompt_quality(prompts.assign(confident=False), fallback)["confident_top1"])
    assert set(gating.prompt_quality(prompts.drop(columns="confident"), fallback)) == {"next_token_top1",
                                                                                      "rollout_agreement"}


def _summary_inputs(margins: list[list[float]]) -> tuple:
    """One map `a` scored by `entropy` on hand-built rows: 40 dev and 40 eval items (both tasks) where the score ranks
    the changed ones first (with noise), and eval prompts with the oracle's margins `margins` per position."""
    rng = np.random.default_rng(3)
    items = []
    for part in ("dev", "eval"):
        changed = np.arange(40) % 3 == 0
        task = np.where(np.arange(40) % 2, "piqa", "hellaswag")
        items.append(pd.DataFrame({"part": part, "map": "a", "task": task, "item": range(40),
                                   "mapped": (~changed).astype(int), "oracle": 1, "source": 0, "changed": changed,
                                   "score_entropy": changed + rng.normal(0, 0.4, 40)}))
    first_agree = np.arange(len(margins)) % 2
    prompts = pd.DataFrame({"map": "a", "prompt": range(len(margins)), "first_agree": first_agree,
                            "rollout_agree": first_agree, "horizon": 1, MARGINS: margins, "changed": first_agree == 0,
                            "score_entropy": (first_agree == 0) + rng.normal(0, 0.4, len(margins))})
    params = parse(SelectiveParams, {**committed("selective"), "maps": {"a": "a.safetensors"}, "scores": ["entropy"],
                                     "bootstrap_iters": 200}, "selective")
    costs = {"a": {"target_ms": 10.0, "handoff_ms": 4.0, "entropy_ms": 0.1, "target": 10.0, "handoff": 3.0,
                   "entropy": 0.01}}
    return pd.concat(items, ignore_index=True), prompts, params, costs


def test_the_summary_gives_confident_top1_over_the_prompts_sure_at_their_first_token_with_n_and_an_interval():
    margins = [[0.9, 0.0], [0.5, 0.0], [0.1, 0.9], [0.3, 0.9], [0.05, 0.9], [0.25, 0.0]] * 5  # 30 prompts
    items, prompts, params, costs = _summary_inputs(margins)
    metrics, curves = summarize(items, prompts, params, costs, margin=0.2)
    facts = metrics["maps"]["a"]
    # confident at the first token: positions 0, 1, 3 and 5 of each six; of those the map agrees on 1, 3 and 5
    assert metrics["confident_margin"] == 0.2 and facts["confident_prompts"] == 20
    assert facts["confident_top1"] == pytest.approx(15 / 20) and facts["next_token_top1"] == pytest.approx(0.5)
    assert facts["items"] == 40 and facts["changed_item_count"] == 14 and facts["file"] == "a.safetensors"
    row = facts["scores"]["entropy"]
    assert row["auroc_items_low"] <= row["auroc_items"] <= row["auroc_items_high"]
    assert row["confident_top1_low"] <= row["confident_top1"] <= row["confident_top1_high"]
    assert row["confident_top1"] >= facts["confident_top1"]  # a fallback only ever takes the oracle's answer
    oracle = curves[(curves.requests == "prompts") & (curves.score == "oracle")]
    assert oracle.confident_top1.iloc[0] == pytest.approx(15 / 20) and oracle.confident_top1.iloc[-1] == 1.0
    assert curves[curves.requests == "items"].confident_top1.isna().all()  # the items' curves as they were
    sure_nowhere = summarize(items, prompts, params, costs, margin=0.95)[0]["maps"]["a"]
    assert sure_nowhere["confident_prompts"] == 0 and sure_nowhere["confident_top1"] is None
    assert sure_nowhere["confident_top1_low"] is None and sure_nowhere["confident_top1_high"] is None
    assert sure_nowhere["scores"]["entropy"]["confident_top1"] is None


def test_the_study_names_the_selected_maps_item_auroc_with_its_interval_and_n_and_draws_confident_top1(tmp_path):
    margins = [[0.9, 0.0], [0.5, 0.0], [0.1, 0.9], [0.3, 0.9], [0.05, 0.9], [0.25, 0.0]] * 5
    items, prompts, params, costs = _summary_inputs(margins)
    params.maps = {"a": "models/mapper.safetensors"}  # select's output: the selected map
    metrics, curves = summarize(items, prompts, params, costs, margin=0.2)
    report = parse(ReportParams, committed("report"), "report")
    figures = study.compute(report, study.Inputs(metrics, curves))
    text = "\n".join(study.lines(figures))
    row = metrics["maps"]["a"]["scores"]["entropy"]
    auroc = f"{row['auroc_items']:.3f} [{row['auroc_items_low']:.3f}, {row['auroc_items_high']:.3f}]"
    assert (f"Selected map (`a`, models/mapper.safetensors): AUROC on the eval items entropy {auroc} (n = 40 items, "
            f"14 where the map changes the decision)") in text
    facts = metrics["maps"]["a"]
    assert facts["confident_top1_low"] < 0.75 < facts["confident_top1_high"]
    assert (f"| a | none (ungated) | — | 40 (14) | 50.0% | 75.0% [{100 * facts['confident_top1_low']:.1f}%, "
            f"{100 * facts['confident_top1_high']:.1f}%] (n = 20) |") in text
    study.figure(figures, tmp_path)
    assert (tmp_path / "selective.png").stat().st_size > 0 and (tmp_path / "selective_top1.png").stat().st_size > 0
    params.maps = {"a": "models/best/mapped_k1.safetensors"}  # not the selected map: no such sentence
    other = summarize(items, prompts, params, costs, margin=0.2)[0]
    assert "Selected map" not in "\n".join(study.lines(study.compute(report, study.Inputs(other, curves))))


def test_the_study_refuses_selective_metrics_written_before_the_confident_figures(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metrics = tmp_path / "metrics" / "selective.json"
    metrics.parent.mkdir()
    metrics.write_text('{"target_retention": 0.99, "maps": {}}')
    with pytest.raises(ArtifactError, match="rerun the selective stage"):
        study.load(None)
