"""Stage selective: lm-eval through a gated `kv-transfer` gives the stage's own composition of the ungated runs,
the probe is trained on the dev items alone (out of fold there), and the summary's confident top-1."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import committed, hellaswag_rows, measure_params, piqa_rows
from helpers.selective import _summary_inputs

from pipeline.kv.gate import Scorer
from pipeline.kv.mapper import random_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.lm_eval_model import KVTransferLM
from pipeline.measure import gating
from pipeline.measure.taskeval import evaluate_tasks
from pipeline.schema.selective import SelectiveParams
from pipeline.selective import METRIC, add_probe, item_rows, summarize, task_frame, train_probe
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.params import parse

E2E_ITEMS = 8  # per task: the end-to-end gate check on real items


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
    routers = {"mapped": pair.router(mode="mapped", mapper=sharp_pair["mapper"], batch_size=4),
               "oracle": pair.router(mode="oracle", batch_size=4)}
    # the stage's way (selective.score_requests): each handoff ungated through lm-eval, each item's context scored
    frames = {name: task_frame(pair, router, files) for name, router in routers.items()}
    scores = Scorer(routers["mapped"].handoff).scores(list(frames["mapped"].tokens), ["kl"], 4)
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


def test_the_summary_gives_confident_top1_over_the_prompts_sure_at_their_first_token_with_n_and_an_interval():
    margins = [[0.9, 0.0], [0.5, 0.0], [0.1, 0.9], [0.3, 0.9], [0.05, 0.9], [0.25, 0.0]] * 5  # 30 prompts
    items, prompts, params, costs = _summary_inputs(margins)
    metrics, curves = summarize(items, prompts, params, costs, measure_params(bootstrap_iters=200))
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
    sure_nowhere = summarize(items, prompts, params, costs,
                             measure_params(confident_margin=0.95, bootstrap_iters=200))[0]["maps"]["a"]
    assert sure_nowhere["confident_prompts"] == 0 and sure_nowhere["confident_top1"] is None
    assert sure_nowhere["confident_top1_low"] is None and sure_nowhere["confident_top1_high"] is None
    assert sure_nowhere["scores"]["entropy"]["confident_top1"] is None
