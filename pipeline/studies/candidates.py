"""The candidates study (stage `candidates`): every fitted map evaluated like a mapped variant, how well each cheap
figure (`proxies`) ranks them the way retention does, and the quality/speed frontier."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.measure.prompt_metrics import CONFIDENT, FIDELITY, PROMPT_METRICS
from pipeline.measure.settings import MeasureParams
from pipeline.measure.stats import pareto_front, rank_correlation
from pipeline.store import paths
from pipeline.store.artifacts import read_table
from pipeline.store.lazy import lazy
from pipeline.studies.format import md_table, pct, pct_ci, save_figure, subplots
from pipeline.studies.run import Run, quality
from pipeline.studies.settings import ReportParams

pd = lazy("pandas")

R2 = "r2_heldout"  # fit's held-out R² (keys and values averaged), the one proxy that is not a prompt metric


def proxies(group: str) -> dict[str, str]:
    """A group's proxies (`fidelity` with R² first), each with its name in the table."""
    named = {R2: "held-out R² (fit, select split)"} if group == FIDELITY else {}
    return named | {metric.name: f"{metric.label} (select{'' if metric.higher else '; lower is better'})"
                    for metric in PROMPT_METRICS.values() if metric.proxy and metric.group == group}


@dataclass
class Inputs:
    items: dict[str, pd.DataFrame]  # the variants' per-item rows (the oracle's and the source's are read)
    candidate_items: dict[str, pd.DataFrame]
    figures: dict  # metrics/candidates.json: per candidate family, k, speed and size
    fit: dict
    select: dict


def load(run: Run) -> Inputs | None:
    """None when the stage did not run, or without the source's items."""
    if not paths.CANDIDATES.is_file() or "source" not in run.items:
        return None
    items = {path.stem: read_table(path) for path in sorted(paths.CANDIDATE_ITEMS.glob("*.parquet"))}
    return Inputs(run.items, items, json.loads(paths.CANDIDATES.read_text()), json.loads(paths.FIT.read_text()),
                  run.select)


def compute(params: ReportParams, measure: MeasureParams, inputs: Inputs) -> dict:
    """Every candidate's quality, proxies, speed and size; each proxy's rank correlation with retention; the Pareto
    fronts of gap closure against the measured speedup and against the FLOP bound at the real pair's shapes."""
    maps, rows = inputs.figures["maps"], {}
    for name, frame in inputs.candidate_items.items():
        select, figures = inputs.select["maps"][name], maps[name]
        fit = inputs.fit["maps"].get(name)  # None for a distilled map: fit never saw it
        rows[name] = {
            "family": figures["family"], "k": figures["k"],
            **quality({**inputs.items, name: frame}, name, params, measure),
            R2: (fit["r2_keys_select"] + fit["r2_values_select"]) / 2 if fit else None,
            # None: no confident select prompt or position
            **{key: select["prompts"][key] for group in (FIDELITY, CONFIDENT) for key in proxies(group) if key != R2},
            **{key: figures[key] for key in ("speedup", "bound_at_pair", "parameters", "mapper_bytes")},
        }
    names = list(rows)
    scored = {proxy: [n for n in names if rows[n][proxy] is not None]  # R²: fitted maps only
              for group in (FIDELITY, CONFIDENT) for proxy in proxies(group)}
    correlated = {group: {proxy: rank_correlation([rows[n][proxy] for n in scored[proxy]],
                                                  [rows[n]["retention"] for n in scored[proxy]],
                                                  *measure.bootstrap) for proxy in proxies(group)}
                  for group in (FIDELITY, CONFIDENT)}
    closure_values = [rows[n]["gap_closure"] for n in names]
    for speed, key in (("speedup", "pareto_measured"), ("bound_at_pair", "pareto_at_pair")):
        for name, on_front in zip(names, pareto_front(closure_values, [rows[n][speed] for n in names])):
            rows[name][key] = on_front
    return {"rows": rows, "proxies": correlated[FIDELITY], "confident_proxies": correlated[CONFIDENT],
            "length": inputs.figures["length"], "bound_pair": inputs.figures["bound_pair"]}


def front(row: dict) -> str:
    return " ".join(mark for key, mark in (("pareto_measured", "here"), ("pareto_at_pair", "at pair"))
                    if row[key]) or "—"


def shown(study: dict) -> dict:
    """`best`: the proxy that tracks retention best (None: none correlates); `tracks`: its rho, turned, is above 0."""
    rows = study["rows"]
    named = [(proxies(FIDELITY)[name], c) for name, c in study["proxies"].items()] + [
        (proxies(CONFIDENT)[name], c) for name, c in study["confident_proxies"].items()]
    # in the direction each proxy should point: higher R², cosine and agreement, lower KL
    strength = {name: c["rho"] if name == R2 else PROMPT_METRICS[name].better(c["rho"])
                for name, c in study["proxies"].items() if c["rho"] == c["rho"]}
    best = max(strength, key=strength.get) if strength else None
    return {
        "table": md_table(
            ["Candidate", "Retention [95% CI]", "Gap closure [95% CI]", "Held-out R²", "Attention cos", "Agreement",
             "Mean KL", "Speedup here", "FLOP bound", "Parameters", "Bytes", "Front", "Confident top-1",
             "Oracle-weighted agreement"],
            [[name, pct_ci(r, "retention"), pct_ci(r, "gap_closure"),
              "—" if r["r2_heldout"] is None else f"{r['r2_heldout']:.3f}", f"{r['attention_cosine']:.3f}",
              pct(r["agreement"]), f"{r['mean_kl']:.3f}",
              f"{r['speedup']:.2f}x", f"{r['bound_at_pair']:.2f}x", f"{r['parameters']:,}", f"{r['mapper_bytes']:,}",
              front(r), pct(r["confident_top1"]), pct(r["oracle_weighted_agreement"])] for name, r in rows.items()]),
        "proxies": md_table(["Proxy", "Spearman ρ [95% CI]", "p", "n"],
                            [[name, f"{c['rho']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]", f"{c['p']:.3g}", c["n"]]
                             for name, c in named]),
        "best": best, "best_name": proxies(FIDELITY)[best] if best else None,
        "tracks": best is not None and strength[best] > 0,
        "measured": [name for name, row in rows.items() if row["pareto_measured"]],
        "at_pair": [name for name, row in rows.items() if row["pareto_at_pair"]],
    }


def figure(study: dict, folder: Path) -> dict[str, pd.DataFrame]:
    table = pd.DataFrame([{"candidate": name, **{key: row[key] for key in (
        "family", "k", "retention", "gap_closure", "speedup", "bound_at_pair", "mapper_bytes", "pareto_measured",
        "pareto_at_pair")}} for name, row in study["rows"].items()])
    fig, axes = subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, speed, front, title in ((axes[0], "speedup", "pareto_measured", f"measured here, n={study['length']}"),
                                    (axes[1], "bound_at_pair", "pareto_at_pair",
                                     f"FLOP bound at {study['bound_pair']}, n={study['length']}")):
        for family, group in table.groupby("family", sort=True):
            ax.scatter(group[speed], group.gap_closure, label=family, s=24)
        ringed = table[table[front]]
        ax.scatter(ringed[speed], ringed.gap_closure, s=120, facecolors="none", edgecolors="black", lw=1)
        for _, row in table.iterrows():
            ax.annotate(row.candidate, (row[speed], row.gap_closure), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
        ax.set_xlabel("TTFT speedup over target prefill")
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("gap closure (eval part)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, folder / "frontier.png")
    return {"frontier": table}
