"""The operating study (stage `operating@<n>`): the handoff at lengths where prefill costs, every variant's quality and
measured TTFT on the same prompts, and the front of confident agreement against measured speedup."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.measure.confident import confidence_intervals
from pipeline.measure.settings import MeasureParams
from pipeline.measure.stats import pareto_front
from pipeline.store import paths
from pipeline.store.artifacts import read_table
from pipeline.store.lazy import lazy
from pipeline.studies.format import md_table, pct, pct_ci, pct_or_dash, save_figure, subplots, times
from pipeline.studies.run import Run
from pipeline.studies.settings import ReportParams

pd = lazy("pandas")
np = lazy("numpy")

FIGURE = "operating.png"
SPECULATIVE = "speculative_"  # speculative prefill's variants, speculative_<p> (schema.operating)


@dataclass
class Inputs:
    figures: dict[int, dict]  # per length: metrics/eval/operating/<n>.json
    rows: dict[tuple[int, str], pd.DataFrame]  # per (length, variant): one row per eval prompt


def load(run: Run) -> Inputs:
    figures = {length: json.loads(paths.operating_metrics(length).read_text()) for length in run.operating_lengths}
    rows = {(length, name): read_table(paths.operating_rows(length) / name / "prompts.parquet")
            for length, study in figures.items() for name in study["variants"]}
    return Inputs(figures, rows)


def compute(params: ReportParams, measure: MeasureParams, inputs: Inputs) -> dict:
    out = {}
    for length, study in sorted(inputs.figures.items()):
        entries = {}
        for name, figures in study["variants"].items():
            rows = inputs.rows[(length, name)]
            bounds = confidence_intervals(rows, measure.confident_margin, *measure.bootstrap)
            retrieval = figures.get("retrieval") or {}
            entries[name] = {
                "confident_agreement": figures.get("confident_agreement"),
                "confident_agreement_low": bounds["confident_agreement_low"],
                "confident_agreement_high": bounds["confident_agreement_high"],
                "kl": figures["mean_kl"], "ppl_ratio": figures["ppl_ratio"],
                "speedup_measured": figures["speedup_measured"], "flop_bound": figures["flop_bound"],
                "retrieval": retrieval.get("exact_match"), "retrieval_of_oracle": retrieval.get("of_oracle"),
                "retrieval_by_depth": retrieval.get("by_depth"), "retrieval_n": retrieval.get("n", 0),
                "selection_recall": retrieval.get("selection_recall"),
                "n": figures["n"], "positions": figures["tokens"],
                "confident_positions": figures.get("confident_positions"),
                "next_token_top1": figures["next_token_top1"], "rollout_agreement": figures["rollout_agreement"],
                "recall_agreement": figures.get("recall_agreement"),
                "recall_positions": int(sum(sum(flags) for flags in rows.recall_by_position)),
                "other_agreement": figures.get("other_agreement"),
                "ttft_ms": figures["ttft"]["mean_ms"],
            }
        front = pareto_front([float("nan") if e["confident_agreement"] is None else e["confident_agreement"]
                              for e in entries.values()],
                             [e["speedup_measured"] for e in entries.values()])
        for entry, on in zip(entries.values(), front):
            entry["on_front"] = bool(on)
        out[str(length)] = entries
    return out


def shown(study: dict) -> dict:
    lengths = {}
    for length, entries in study.items():
        depths = sorted((entries["oracle"]["retrieval_by_depth"] or {}), key=float)
        lengths[length] = {"table": md_table(
            ["Variant", "Confident agreement [95% CI]", "KL", "PPL ratio", "Recall / other agreement",
             "Retrieval (of oracle's)", "Selection recall", "Measured TTFT speedup", "FLOP bound", "Front"],
            [[name, pct_ci(e, "confident_agreement"), f"{e['kl']:.3f}", f"{e['ppl_ratio']:.3f}",
              f"{pct(e['recall_agreement'])} / {pct(e['other_agreement'])}",
              f"{pct(e['retrieval'])} ({pct(e['retrieval_of_oracle'])})", pct_or_dash(e["selection_recall"]),
              times(e["speedup_measured"]), times(e["flop_bound"]), "yes" if e["on_front"] else ""]
             for name, e in entries.items()]),
            "depths": md_table(["Variant", *(f"depth {d}" for d in depths)],
                               [[name, *(pct(e["retrieval_by_depth"][d]) for d in depths)]
                                for name, e in entries.items()]) if depths else None,
            "equal_time": equal_time(entries)}
    return {"lengths": lengths, "with_length": _with_length(study), "figure": FIGURE}


def equal_time(entries: dict) -> dict | None:
    """Each variant's confident agreement beside speculative prefill's at the same measured speedup (`rival`,
    interpolated; None outside `low` to `high`); None where no share ran."""
    curve = sorted((e["speedup_measured"], e["confident_agreement"]) for name, e in entries.items()
                   if name.startswith(SPECULATIVE) and e["confident_agreement"] is not None)
    if not curve:
        return None
    low, high = curve[0][0], curve[-1][0]
    points = []
    for name, e in entries.items():
        mine, speed = e["confident_agreement"], e["speedup_measured"]
        if name == "oracle" or name.startswith(SPECULATIVE) or mine is None:
            continue
        rival = float(np.interp(speed, [x for x, _ in curve], [y for _, y in curve])) if low <= speed <= high else None
        points.append({"name": name, "mine": mine, "speed": speed, "rival": rival})
    return {"low": low, "high": high, "points": points}


def _with_length(study: dict) -> dict | None:
    if len(study) < 2:
        return None
    short, long = study[min(study, key=int)], study[max(study, key=int)]
    changes = [(name, short[name]["confident_agreement"], long.get(name, {}).get("confident_agreement"))
               for name in short if name != "oracle"]
    return {"short": int(min(study, key=int)), "long": int(max(study, key=int)),
            "changes": [(name, a, b) for name, a, b in changes if a is not None and b is not None]}


def figure(study: dict, folder: Path) -> dict[str, pd.DataFrame]:
    table = pd.DataFrame([{"length": int(length), "variant": name, "speedup": e["speedup_measured"],
                           "confident_agreement": e["confident_agreement"], "on_front": e["on_front"]}
                          for length, entries in study.items() for name, e in entries.items()],
                         columns=["length", "variant", "speedup", "confident_agreement", "on_front"])
    fig, axes = subplots(1, max(1, len(study)), figsize=(5 * max(1, len(study)), 4), squeeze=False)
    if not study:
        axes[0][0].text(0.5, 0.5, "no operating length in this profile (data.long, operating.lengths)",
                        ha="center", va="center")
        axes[0][0].set_axis_off()
    for ax, (length, part) in zip(axes[0], table.groupby("length", sort=True)):
        ax.scatter(part.speedup, part.confident_agreement, color="tab:blue")
        for row in part.itertuples():
            ax.annotate(row.variant, (row.speedup, row.confident_agreement), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        front = part[part.on_front].sort_values("speedup")
        ax.plot(front.speedup, front.confident_agreement, color="tab:red", lw=1, label="front (measured)")
        ax.set(xlabel="measured TTFT speedup over the target's prefill", ylabel="confident-position agreement",
               title=f"{length:,} tokens")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, folder / FIGURE)
    return {"operating": table}


def lookahead(select: dict) -> dict:
    if "selected_lookahead" not in select:
        return {"table": None}
    rows = [[label + (" (chosen)" if label == select["selected_lookahead"] else ""), pct(figures["agreement"]),
             pct(figures.get("confident_agreement")), f"{figures['perplexity']:.3f}"]
            for label, figures in ((label, value["prompts"]) for label, value in select["lookahead"].items())]
    return {"table": md_table(["Look-ahead", "Agreement", "Confident agreement", "Perplexity"], rows)}
