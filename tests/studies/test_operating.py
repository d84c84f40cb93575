"""The operating-point study (`studies.operating`): a point is on the front by its measured figures alone, and
without an operating length the study is empty."""
import pandas as pd
from helpers import committed, measure_params

from pipeline.store.params import parse
from pipeline.studies import operating, render
from pipeline.studies.settings import ReportParams


def test_a_point_is_on_the_front_only_by_its_measured_figures():
    figures = {"oracle": (0.99, 1.0), "fast_poor": (0.5, 3.0), "dominated": (0.6, 1.5), "good": (0.9, 2.0)}
    variants = {name: {"confident_agreement": q, "speedup_measured": s, "mean_kl": 0.1, "ppl_ratio": 1.0,
                       "flop_bound": 9.0, "n": 1, "tokens": 1, "next_token_top1": 1.0, "rollout_agreement": 1.0,
                       "ttft": {"mean_ms": 1.0}} for name, (q, s) in figures.items()}
    rows = pd.DataFrame({"margin_by_position": [[0.9]], "agree_by_position": [[1]], "first_agree": [1],
                         "oracle_prob_by_position": [[0.9]], "recall_by_position": [[False]]})
    params = parse(ReportParams, committed("report"), "report")
    result = operating.compute(params, measure_params(bootstrap_iters=50), operating.Inputs({8: {"variants": variants}},
                                                        {(8, name): rows for name in variants}))["8"]
    assert {name for name, entry in result.items() if entry["on_front"]} == {"oracle", "fast_poor", "good"}


def test_without_an_operating_length_the_study_is_empty_and_its_figure_says_so(tmp_path):
    params = parse(ReportParams, committed("report"), "report")
    result = operating.compute(params, measure_params(), operating.Inputs({}, {}))
    assert result == {} and render.section("lengths", result) == ""
    assert operating.figure(result, tmp_path)["operating"].empty and (tmp_path / "operating.png").is_file()


def test_the_report_states_which_look_ahead_select_chose_beside_every_candidates_select_figures():
    figures = {"agreement": 0.5, "confident_agreement": 0.75, "perplexity": 3.0}
    select = {"rule": "agreement", "selected_lookahead": "-1:max", "lookahead": {
        "all:max": {"prompts": figures}, "-1:max": {"prompts": {**figures, "agreement": 0.625}}}}
    rows = [line for line in render.lookahead(select).splitlines()
            if line.startswith("| ") and "Look-ahead" not in line]
    assert rows == ["| all:max | 50.0% | 75.0% | 3.000 |", "| -1:max (chosen) | 62.5% | 75.0% | 3.000 |"]
    assert render.lookahead({"rule": "agreement", "selected": "linear_k1"}) == ""  # select scored none


def test_each_variant_is_read_against_speculative_prefill_at_its_own_measured_speedup():
    def entry(agreement, speedup):  # the figures the equal-time line reads, the table's others beside them
        return {"confident_agreement": agreement, "speedup_measured": speedup, "confident_agreement_low": agreement,
                "confident_agreement_high": agreement, "kl": 0.1, "ppl_ratio": 1.0, "flop_bound": speedup,
                "retrieval": None, "retrieval_of_oracle": None, "retrieval_by_depth": None, "retrieval_n": 0,
                "selection_recall": None, "recall_agreement": None, "other_agreement": None, "on_front": False, "n": 1,
                "positions": 1, "confident_positions": 1, "recall_positions": 0, "ttft_ms": 1.0}

    def equal_time(entries: dict) -> list[str]:
        return [line for line in render.section("lengths", {"8": entries}).splitlines()
                if line.startswith("At equal measured time")]

    entries = {"oracle": entry(1.0, 1.0), "selected": entry(0.689, 2.79), "hybrid": entry(0.747, 2.07),
               "slow": entry(0.6, 1.5), "speculative_0.08": entry(0.689, 2.26), "speculative_0.2": entry(0.722, 1.81)}
    line = equal_time(entries)[0]
    # 0.722 + (2.07 - 1.81) / (2.26 - 1.81) x (0.689 - 0.722) = 0.703
    assert "hybrid 74.7% against 70.3% at 2.07x: above it" in line
    assert "selected (68.9% at 2.79x) faster than every share" in line and "slow (60.0% at 1.50x) slower" in line
    entries["hybrid"] = entry(0.70, 2.07)
    assert "hybrid 70.0% against 70.3% at 2.07x: not above it" in equal_time(entries)[0]
    assert equal_time({"oracle": entry(1.0, 1.0), "selected": entry(0.7, 2.0)}) == []  # none ran
