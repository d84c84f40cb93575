"""Stage `operating@<n>` on a tiny pair built here: every variant evaluated timed on the same prompts, its measured
speedup and FLOP bound beside its figures, the pass-key items scored by their greedy tokens, and where a variant
chooses the positions the target computes (speculative prefill, a repair) whether the key's tokens were among them."""
import pandas as pd
import pytest
from helpers import WIKITEXT, committed, measure_params

import pipeline.operating as operating_stage
from pipeline.kv.flops import speculative_bound
from pipeline.kv.mapper import random_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.speculative import SpeculativeParams
from pipeline.operating import baseline_bound, run
from pipeline.prepare_data import corpus_documents
from pipeline.schema.operating import OperatingParams
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.haystack import RetrievalForm, retrieval_items
from pipeline.store.params import ParamError, parse
from pipeline.store.shapes import pair_configs
from pipeline.studies import operating, render
from pipeline.studies.settings import ReportParams

LENGTH = 48
FORM = RetrievalForm("\nThe pass key is {key}.\n", "\nThe pass key is ", 3, (0.2, 0.6))
LOOKAHEAD = parse(SpeculativeParams, committed("speculative", last=3, sinks=2), "speculative")


def operating_params(path, **overrides) -> OperatingParams:
    section = committed("operating", lengths=[LENGTH], baselines=["source", "zero"], maps={"k1": str(path)},
                        repaired={"k1_full": {"map": "k1", "repair": "tokens:1:recency"},
                                  "k1_source": {"map": "k1", "repair": "tokens:0.3:source_attention"},
                                  "k1_end": {"map": "k1", "repair": "tokens:0.1:recency"}},
                        truncated=True, speculative=[0.3, 1.0], top_k=16, horizon=4)
    return parse(OperatingParams, {**section, **overrides}, "operating")


def wikitext_documents(tokenizer) -> list[tuple[str, list[int]]]:
    return [(f"doc-{i}", tokenizer.encode(text)) for i, text in
            enumerate(corpus_documents([{"text": WIKITEXT.read_text()}])) if len(tokenizer.encode(text)) > 80]


def prompt_rows(documents) -> pd.DataFrame:
    return pd.DataFrame([{"prompt_ids": ids[:LENGTH], "continuation_ids": ids[LENGTH : LENGTH + 6]}
                         for _, ids in documents[:3]])


@pytest.fixture(scope="module")
def study(wide_pair, tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("operating")
    pair = Pair(str(wide_pair["target"]), str(wide_pair["source"]), "float32", "cpu")
    mapper = random_mapper(pair.source.config, pair.target.config, k=1, seed=0)
    mapper.models = pair_fingerprints(str(wide_pair["source"]), str(wide_pair["target"]))
    save_mapper(mapper, root / "k1.safetensors")
    documents = wikitext_documents(tokenizer)
    prompts = prompt_rows(documents)
    items = retrieval_items(documents[3:], LENGTH, 4, FORM, tokenizer, seed=0)
    metrics = run(operating_params(root / "k1.safetensors"), pair, LENGTH, 0.2, prompts, items, root / "rows",
                  LOOKAHEAD)
    return metrics, root / "rows", pair


def test_every_variant_is_evaluated_in_order_with_its_time_and_bound(study):
    metrics, _, _ = study
    assert list(metrics["variants"]) == ["oracle", "source", "zero", "k1", "k1_full", "k1_source", "k1_end",
                                         "speculative_0.3", "speculative_1", "truncated_k1_full",
                                         "truncated_k1_source", "truncated_k1_end"]
    for name, figures in metrics["variants"].items():
        assert figures["n"] == 3 and figures["tokens"] == 18, name
        assert figures["speedup_measured"] > 0 and figures["flop_bound"] > 0, name
        assert figures["ttft"]["median_ms"] > 0 and figures["retrieval"]["n"] == 4, name
        for key in ("confident_agreement", "mean_kl", "ppl_ratio", "recall_agreement", "other_agreement"):
            assert key in figures, (name, key)
    oracle = metrics["variants"]["oracle"]
    assert oracle["speedup_measured"] == 1.0 and oracle["flop_bound"] == 1.0 and oracle["ppl_ratio"] == 1.0
    assert oracle["agreement"] == 1.0 and oracle["mean_kl"] < 1e-6
    assert metrics["variants"]["source"]["flop_bound"] > 1 and metrics["variants"]["k1"]["flop_bound"] > 1


def test_a_full_repair_is_the_oracle_and_costs_more_than_the_target_prefill(study):
    metrics, _, _ = study
    full, truncated = metrics["variants"]["k1_full"], metrics["variants"]["truncated_k1_full"]
    assert full["agreement"] == 1.0 and full["rollout_agreement"] == 1.0 and full["mean_kl"] < 1e-4
    assert full["flop_bound"] < 1  # every token recomputed, on top of the source's prefill and the map
    assert truncated["flop_bound"] == pytest.approx(1.0)  # its budget is above 1: the whole prompt kept
    assert truncated["agreement"] == 1.0


def test_retrieval_is_the_greedy_tokens_against_the_key_and_the_oracle(study):
    metrics, folder, _ = study
    oracle = pd.read_parquet(folder / "oracle" / "retrieval.parquet")
    assert list(oracle.depth) == [0.2, 0.6, 0.2, 0.6] and oracle.exact.dtype == bool
    full = pd.read_parquet(folder / "k1_full" / "retrieval.parquet")
    assert list(full.exact) == list(oracle.exact)  # the oracle's cache, recomputed: the same greedy tokens
    share = metrics["variants"]["oracle"]["retrieval"]["exact_match"]
    assert metrics["variants"]["oracle"]["retrieval"]["of_oracle"] == (1.0 if share else None)


def test_speculative_prefill_at_each_share_is_a_variant_with_its_rows_and_its_bound(study):
    metrics, folder, pair = study
    for name, share in (("speculative_0.3", 0.3), ("speculative_1", 1.0)):
        figures = metrics["variants"][name]
        bound = speculative_bound(pair.source.config, pair.target.config, LOOKAHEAD, share, LENGTH)
        assert figures["flop_bound"] == pytest.approx(bound, rel=1e-5)
        rows = pd.read_parquet(folder / name / "prompts.parquet")
        assert len(rows) == 3 and (rows.ttft_ms > 0).all() and (rows.way == "speculative").all()
    full = metrics["variants"]["speculative_1"]
    assert full["agreement"] == 1.0 and full["mean_kl"] < 1e-4  # p = 1 keeps every position: the oracle
    assert metrics["variants"]["speculative_0.3"]["flop_bound"] > full["flop_bound"]


def test_the_selection_recall_is_1_where_the_key_was_computed_and_0_where_it_was_not(study):
    metrics, folder, _ = study
    recall = {name: figures["retrieval"].get("selection_recall") for name, figures in metrics["variants"].items()}
    assert recall["speculative_1"] == 1.0 and recall["k1_full"] == 1.0  # every position kept, or recomputed
    assert recall["k1_end"] == 0.0  # the prompt's last 10% only: the keys sit at depths 0.2 and 0.6
    assert 0.0 <= recall["speculative_0.3"] <= 1.0 and 0.0 <= recall["k1_source"] <= 1.0
    assert recall["oracle"] is None and recall["k1"] is None and recall["truncated_k1_full"] is None  # nothing chosen
    rows = pd.read_parquet(folder / "k1_end" / "retrieval.parquet")
    assert list(rows.needle_selected) == [False] * 4 and "needle_selected" not in pd.read_parquet(
        folder / "oracle" / "retrieval.parquet")
    kept = pd.read_parquet(folder / "speculative_0.3" / "prompts.parquet").selected
    assert all(0 < len(positions) < LENGTH - 1 for positions in kept)  # a sparse choice of the 47-token prefix


def test_a_repair_ranking_by_the_source_counts_its_scores_in_its_bound_and_its_truncated_budget(study):
    metrics, _, _ = study
    by_source, by_recency = metrics["variants"]["k1_source"], metrics["variants"]["k1_end"]
    assert by_source["flop_bound"] < by_recency["flop_bound"]  # 30% recomputed, and the scores, against 10%
    truncated = metrics["variants"]["truncated_k1_source"]["flop_bound"]
    assert 1 < truncated < metrics["variants"]["truncated_k1_end"]["flop_bound"]


@pytest.mark.parametrize("pair", ["qwen25-coder", "qwen3-v0"])
def test_a_baselines_bound_counts_what_its_mode_reads_so_direct_pays_the_sources_prefill_and_zero_nothing(pair):
    source, target = pair_configs(pair)
    zero, direct, alone = (baseline_bound(name, source, target, 1024) for name in ("zero", "direct", "source"))
    assert 0.9 * alone < direct < alone  # the source's prefill of the prefix and the target's one step
    assert zero > 20 * direct  # the target's one step alone


def test_operating_params_refuse_a_share_listed_twice_or_named_as_another_variant(tmp_path):
    with pytest.raises(ParamError, match=r"operating\.speculative: a share is listed twice"):
        operating_params(tmp_path / "k1.safetensors", speculative=[0.1, 0.1])
    with pytest.raises(ParamError, match=r"the variant name 'speculative_0\.1' is used twice"):
        operating_params(tmp_path / "k1.safetensors", speculative=[0.1], maps={"k1": "m", "speculative_0.1": "m"})
    with pytest.raises(ParamError, match=r"operating\.speculative"):
        operating_params(tmp_path / "k1.safetensors", speculative=[0.0])
    assert operating_params(tmp_path / "k1.safetensors", speculative=[0.08, 1]).speculative_variants() == {
        "speculative_0.08": 0.08, "speculative_1": 1.0}


def test_operating_params_refuse_an_unknown_map_and_a_variant_name_used_twice(tmp_path):
    with pytest.raises(ParamError, match=r"operating\.repaired\.x\.map: 'nope' is not a variant of operating\.maps"):
        operating_params(tmp_path / "k1.safetensors", repaired={"x": {"map": "nope", "repair": "layers:1"}})
    with pytest.raises(ParamError, match=r"the variant name 'k1' is used twice"):
        operating_params(tmp_path / "k1.safetensors", repaired={"k1": {"map": "k1", "repair": "layers:1"}})


def test_the_study_holds_each_lengths_variants_with_the_keys_the_report_promises(study, tmp_path):
    metrics, folder, _ = study
    rows = {(LENGTH, name): pd.read_parquet(folder / name / "prompts.parquet") for name in metrics["variants"]}
    params = parse(ReportParams, committed("report"), "report")
    result = operating.compute(params, measure_params(bootstrap_iters=200), operating.Inputs({LENGTH: metrics}, rows))
    entries = result[str(LENGTH)]
    for name, entry in entries.items():
        for key in ("confident_agreement", "confident_agreement_low", "confident_agreement_high", "kl", "ppl_ratio",
                    "speedup_measured", "flop_bound", "retrieval", "n"):
            assert key in entry, (name, key)
        assert entry["speedup_measured"] == metrics["variants"][name]["speedup_measured"]
    fastest = max(entries, key=lambda name: entries[name]["speedup_measured"])
    assert entries[fastest]["on_front"]  # nothing is faster, so nothing dominates it
    text = render.section("lengths", result)
    assert f"### {LENGTH:,} tokens" in text and "Measured TTFT speedup" in text and "depth 0.2" in text
    assert entries["speculative_1"]["selection_recall"] == 1.0 and entries["oracle"]["selection_recall"] is None
    main_table = text.split("Retrieval by the needle's depth")[0]  # the variants' table, before the depths'
    table = {line.split(" | ")[0].strip("| "): line for line in main_table.splitlines() if line.startswith("| ")}
    assert "Selection recall" in table["Variant"]
    assert "| 100.0% |" in table["speculative_1"] and "| 0.0% |" in table["k1_end"] and "| — |" in table["oracle"]
    tables = operating.figure(result, tmp_path)
    assert (tmp_path / "operating.png").is_file() and len(tables["operating"]) == len(entries)



def test_one_request_under_two_names_is_evaluated_once_and_both_names_get_its_figures(study, tokenizer, monkeypatch,
                                                                                      tmp_path):
    _, rows, pair = study
    evaluated, evaluate = [], operating_stage.evaluate
    monkeypatch.setattr(operating_stage, "evaluate",
                        lambda router, *args, **kwargs: evaluated.append(router) or evaluate(router, *args, **kwargs))
    built, router = [], pair.router
    monkeypatch.setattr(pair, "router", lambda *args, **kwargs: built.append(kwargs) or router(*args, **kwargs))
    twice = {"k1_end": {"map": "k1", "repair": "tokens:0.1:recency"},
             "k1_again": {"map": "k1", "repair": "tokens:0.1:recency"}}  # as `selected` where select chose it
    params = operating_params(rows.parent / "k1.safetensors", baselines=[], repaired=twice, speculative=[])
    metrics = run(params, pair, LENGTH, 0.2, prompt_rows(wikitext_documents(tokenizer)), None, tmp_path, LOOKAHEAD)
    figures = metrics["variants"]
    assert list(figures) == ["oracle", "k1", "k1_end", "k1_again", "truncated_k1_end", "truncated_k1_again"]
    assert figures["k1_again"] == figures["k1_end"] and figures["truncated_k1_again"] == figures["truncated_k1_end"]
    assert len(evaluated) == len({id(router) for router in evaluated}) == 4  # the oracle, the map, the repair, the
    # truncated prompt at its budget: each once
    assert len(built) == 4  # and each built once: the repair's map file is loaded and bound once
