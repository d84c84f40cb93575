"""The length study (stage `length`): a map refitted on short prefixes, with RoPE stripped (the pipeline's way) and
with keys as cached (the ablation), used on longer prompts."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.measure.settings import MeasureParams
from pipeline.measure.stats import mcnemar, paired_bootstrap, sign_test
from pipeline.store import paths
from pipeline.store.artifacts import read_table
from pipeline.store.lazy import lazy
from pipeline.studies.format import interval, md_table, pct, save_figure, subplots
from pipeline.studies.run import Run
from pipeline.studies.settings import ReportParams

pd = lazy("pandas")

SPACES = ("stripped", "rotated")


@dataclass
class Inputs:
    figures: dict  # metrics/length.json: fit length, candidate, prompts, and per space and length its figures
    rows: dict[tuple[str, int], pd.DataFrame]  # per (space, prompt length): one row per prompt
    tasks: dict[str, pd.DataFrame]  # per space: one row per task item


def load(run: Run) -> Inputs | None:
    if not paths.LENGTH.is_file():
        return None
    figures = json.loads(paths.LENGTH.read_text())
    rows = {(space, length): read_table(paths.length_rows(space, length, paths.LENGTH_ROWS))
            for space in SPACES for length in sorted(map(int, figures["oracle"]["by_length"]))}
    return Inputs(figures, rows,
                  {space: read_table(paths.length_tasks(space, paths.LENGTH_ROWS)) for space in SPACES})


def compute(params: ReportParams, measure: MeasureParams, inputs: Inputs) -> dict:
    """Stripped against rotated per prompt length (sign test on per-prompt NLL, bootstrap of agreement) and per bin
    of task context length (paired difference of accuracy, McNemar's p)."""
    figures, out = inputs.figures, []
    for length in sorted({length for _, length in inputs.rows}):
        stripped, rotated = (inputs.rows[(space, length)].sort_values("prompt") for space in SPACES)
        agree = paired_bootstrap((stripped.agree / stripped.tokens).to_numpy(),
                                 (rotated.agree / rotated.tokens).to_numpy(), *measure.bootstrap)
        out.append({"length": length, "ratio_to_fit": length / figures["fit_tokens"],
                    **{f"{space}_{key}": figures[space]["by_length"][str(length)]["prompts"][key] for space in SPACES
                       for key in ("ppl_ratio", "agreement", "next_token_top1")},
                    "nll_sign_test": sign_test(stripped.nll.to_numpy(), rotated.nll.to_numpy()),
                    "agreement_diff": agree})
    return {"fit_tokens": figures["fit_tokens"], "candidate": figures["candidate"], "prompts": figures["prompts"],
            "rows": out, "task_bins": _task_bins(params, measure, inputs.tasks, figures["fit_tokens"])}


def _task_bins(params: ReportParams, measure: MeasureParams, tasks: dict[str, pd.DataFrame], fit: int) -> list[dict]:
    joined = tasks["stripped"].merge(tasks["rotated"], on=["task", "item", "context_tokens"],
                                     suffixes=("_stripped", "_rotated"))
    edges = [0.0, *params.length_bins]
    bins = []
    for low, high in zip(edges, [*params.length_bins, None]):
        inside = joined[(joined.context_tokens > low * fit)
                        & ((joined.context_tokens <= high * fit) if high else True)]
        if inside.empty:
            continue
        a, b = inside.acc_stripped.to_numpy(), inside.acc_rotated.to_numpy()
        bins.append({"bin": f"{low:g}-{high:g}x" if high else f">{low:g}x", "items": len(inside),
                     "stripped_acc": float(a.mean()), "rotated_acc": float(b.mean()),
                     "diff": paired_bootstrap(a, b, *measure.bootstrap), "mcnemar_p": mcnemar(a, b)})
    return bins


def shown(study: dict) -> dict:
    return {"lengths": md_table(
        ["Prompt tokens", "x fit length", "PPL ratio stripped", "PPL ratio rotated", "Agreement stripped",
         "Agreement rotated", "Agreement Δ [95% CI]", "NLL lower / higher", "Sign test p"],
        [[r["length"], f"{r['ratio_to_fit']:g}", f"{r['stripped_ppl_ratio']:.3f}", f"{r['rotated_ppl_ratio']:.3f}",
          pct(r["stripped_agreement"]), pct(r["rotated_agreement"]),
          interval(r["agreement_diff"]["diff"], r["agreement_diff"]["low"], r["agreement_diff"]["high"]),
          f"{r['nll_sign_test']['lower']} / {r['nll_sign_test']['higher']}", f"{r['nll_sign_test']['p']:.3g}"]
         for r in study["rows"]]),
        "bins": md_table(["Context length", "Items", "Stripped", "Rotated", "Δ [95% CI]", "McNemar p"],
                         [[b["bin"], b["items"], pct(b["stripped_acc"]), pct(b["rotated_acc"]),
                           interval(b["diff"]["diff"], b["diff"]["low"], b["diff"]["high"]), f"{b['mcnemar_p']:.3g}"]
                          for b in study["task_bins"]])}


def figure(study: dict, folder: Path) -> dict[str, pd.DataFrame]:
    table = pd.DataFrame([{"length": r["length"], "keys": space, "ppl_ratio": r[f"{space}_ppl_ratio"],
                           "agreement": r[f"{space}_agreement"]} for r in study["rows"] for space in SPACES])
    fig, axes = subplots(1, 2, figsize=(9, 3.5))
    for space, group in table.groupby("keys", sort=False):
        axes[0].plot(group.length, group.ppl_ratio, marker="o", label=f"RoPE {space}")
        axes[1].plot(group.length, group.agreement, marker="o", label=f"RoPE {space}")
    for ax, name in ((axes[0], "perplexity ratio to the oracle"), (axes[1], "agreement with the oracle")):
        ax.axvline(study["fit_tokens"], color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens (dotted: fit length)")
        ax.set_ylabel(name)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, folder / "length.png")
    return {"length": table}
