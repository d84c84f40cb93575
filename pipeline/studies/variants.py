"""The V0 study (the report's head): every declared variant's figures, the paired comparisons, the criteria and the
headline. V0's reference column belongs to V0's pair only (`V0_PAIR`), whatever the profile is called."""
from __future__ import annotations

from pathlib import Path

from pipeline.measure.prompt_metrics import FIDELITY, in_group
from pipeline.measure.retention import (
    PROMPT_MEASURES,
    closure_interval,
    comparison,
    mean_gap_closure,
    mean_retention,
    prompt_gap_closure,
)
from pipeline.measure.settings import MeasureParams
from pipeline.store.lazy import lazy
from pipeline.store.splits import TASKS
from pipeline.store.truncated import self_layers
from pipeline.studies.criteria import CRITERION_NAMES, GAP_CLOSURE_KEYS, criteria, verdict
from pipeline.studies.format import interval, md_table, pct, pct_ci, save_figure, subplots
from pipeline.studies.run import Run
from pipeline.studies.settings import ReportParams

np = lazy("numpy")
pd = lazy("pandas")

# V0's published table (PROTOCOL.md): perplexity, next-token top-1, HellaSwag, PIQA; for this pair only
V0 = {
    "oracle": (15.2157, 1.00, 0.594, 0.740),
    "direct": (44.2169, 0.02, 0.366, 0.600),
    "mapped_k1": (17.3496, 0.61, 0.546, 0.702),
    "mapped_k4": (17.0744, 0.62, 0.512, 0.684),
}
V0_PAIR = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B")
SELECTED_LABELS = {"selected": "Selected mapped transfer", "selected_repaired": "Selected mapped transfer, repaired"}
# each mode's name and row in the table: below MAPS_ROW before the maps (V0's best per k, the selected, the repaired),
# else after them; a mode not named here is a row by its own name after the others
MAPS_ROW = 100
MODE_ROWS = {"oracle": ("Target full-prefill oracle", 0), "direct": ("Direct source-cache injection", 1),
             "source": ("Source model alone", 101), "zero": ("Null control: zero cache", 102),
             "shuffled": ("Null control: shuffled cache", 103)}
# the modes the reading compares a mapped transfer with, in its order, each by its words
RIVALS = {"source": "the source model alone", "zero": "the zero-cache null", "shuffled": "the shuffled-cache null",
          "direct": "direct injection"}
WIDE = 1.0  # a gap-closure interval around 0 and wider than the whole gap decides nothing


def labels() -> dict[str, str]:
    """Read at each call, so a mode added to `MODE_ROWS` is named."""
    return {**{name: words for name, (words, _) in MODE_ROWS.items()}, **SELECTED_LABELS}


def label(variant: str, entry: dict | None = None, setting: bool = True) -> str:
    """A variant's row name from its metrics or report entry; a repaired one with its setting if `setting`."""
    entry = entry or {}
    facts = entry.get("map") or {}
    name = labels().get(variant)
    if name is None and facts.get("distilled"):
        name = f"Distilled mapped transfer, k={facts['k']}"
    if name is None and facts.get("best_of_k"):
        name = f"Learned mapped transfer, k={facts['k']}"
    name = name or variant
    return f"{name} (`{entry['repair']}`)" if setting and entry.get("repair") is not None else name


def best_of_k(variants: dict) -> dict[int, str]:
    """Per k, the variant evaluating select's best closed-form map of that k (V0's rows), by its figures' `map`."""
    best: dict[int, str] = {}
    named = labels()
    for name in sorted(variants):
        facts = variants[name].get("map") or {}
        if facts.get("best_of_k") and name not in named:
            best.setdefault(facts["k"], name)
    return dict(sorted(best.items()))


def k_comparison(variants: dict) -> tuple[str, int] | None:
    """V0's k=1 against the largest other k: the comparison's name and that k, or None without both."""
    best = best_of_k(variants)
    larger = [k for k in best if k != 1]
    return (f"k1_minus_k{larger[-1]}", larger[-1]) if 1 in best and larger else None


def model_phrase(name: str) -> str:
    layers = self_layers(name)
    if layers is None:
        return f"`{name}`"
    return f"the target's first {'layer' if layers == 1 else f'{layers} layers'} (`{name}`)"


def compute(params: ReportParams, measure: MeasureParams, run: Run) -> dict:
    """What metrics/report.json holds before the other studies' keys."""
    metrics, items = run.metrics, run.items
    variants = {variant: _figures(params, measure, metrics, items, variant, run.prompts) for variant in metrics}
    mapped = params.mapped_variant
    if mapped not in metrics:
        raise FileNotFoundError(f"report.mapped_variant {mapped!r} has no evaluation (metrics/eval/{mapped}.json)")
    compared = {f"{mapped}_minus_{other}": (mapped, other) for other in RIVALS if other in metrics}
    best, ks = best_of_k(metrics), k_comparison(metrics)
    if ks is not None:
        compared[ks[0]] = (best[1], best[ks[1]])
    named = labels()
    for variant in sorted(metrics):  # a distilled map against the best closed-form map of its start's k
        facts = metrics[variant].get("map") or {}
        if variant not in named and facts.get("distilled") and facts["k"] in best:
            compared[f"{variant}_minus_{best[facts['k']]}"] = (variant, best[facts["k"]])
    compared[f"oracle_minus_{mapped}"] = ("oracle", mapped)
    comparisons = {name: comparison(items, run.prompts, a, b, "acc", *measure.bootstrap)
                   for name, (a, b) in compared.items()}
    return {"variants": variants, "selected": mapped, "comparisons": comparisons,
            "criteria": criteria(params, variants[mapped], comparisons, run.controls, list(metrics)),
            "retention_metric": params.retention_metric, "gap_closure_metric": params.gap_closure_metric,
            "skipped": run.skipped}


def _figures(params: ReportParams, measure: MeasureParams, metrics: dict, items: dict, variant: str,
             prompts: dict) -> dict:
    accuracy = {name: {t: m["tasks"][t][params.retention_metric] for t in TASKS} for name, m in metrics.items()}
    m, acc, oracle_acc = metrics[variant], accuracy[variant], accuracy["oracle"]
    bounds = closure_interval(items, variant, params.retention_metric, *measure.bootstrap)
    closure = {"gap_closure": None, "gap_closure_low": None, "gap_closure_high": None}
    if "source" in items:  # the gap is the source model's own: without its evaluation there is none
        gap = closure_interval(items, variant, params.retention_metric, *measure.bootstrap, from_source=True)
        closure = {"gap_closure": mean_gap_closure(acc, accuracy["source"], oracle_acc),
                   "gap_closure_low": gap["low"], "gap_closure_high": gap["high"]}
    if "source" in prompts and variant in prompts:  # the same gap on the eval prompts' own measures
        for name in PROMPT_MEASURES:
            gap = prompt_gap_closure(prompts, variant, name, *measure.bootstrap)
            closure.update({f"gap_closure_{name}": gap["gap_closure"], f"gap_closure_{name}_low": gap["low"],
                            f"gap_closure_{name}_high": gap["high"]})
    figures, oracle = m["prompts"], metrics["oracle"]["prompts"]
    entry = {metric.name: figures[metric.name] for metric in in_group(FIDELITY) if metric.name in figures}
    entry.update({metric.ratio: figures[metric.name] / oracle[metric.name] for metric in in_group(FIDELITY)
                  if metric.ratio and metric.name in figures})
    entry.update({**{t: acc[t] for t in TASKS}, "retention": mean_retention(acc, oracle_acc),
                  "retention_low": bounds["low"], "retention_high": bounds["high"], **closure,
                  "prompts": figures["n"], "tasks": m["tasks"]})
    entry.update({key: m[key] for key in ("repair", "map") if key in m})
    return entry


def headline(report: dict) -> dict[str, dict]:
    """Per variant, the figures `dvc metrics show/diff` compare (`gap`: to the oracle in mean task accuracy)."""
    oracle = report["variants"]["oracle"]
    return {name: {"perplexity": e["perplexity"], "next_token_top1": e["next_token_top1"],
                   "hellaswag": e["hellaswag"], "piqa": e["piqa"], "retention": e["retention"],
                   "retention_low": e["retention_low"], "retention_high": e["retention_high"],
                   "gap_closure": e["gap_closure"],  # its interval is in report.json
                   "gap": sum(oracle[t] - e[t] for t in TASKS) / len(TASKS)}
            for name, e in report["variants"].items()}


def order(variants: dict) -> list[str]:
    """The table's rows: the modes before the maps (`MODE_ROWS`), V0's best map per k, the selected map, the repaired
    variants, the modes after the maps, then any other variant."""
    rows = sorted((row, name) for name, (_, row) in MODE_ROWS.items())
    first = [*(name for row, name in rows if row < MAPS_ROW), *best_of_k(variants).values()]
    rest = ["selected", *sorted(v for v in variants if "repair" in variants[v]),
            *(name for row, name in rows if row >= MAPS_ROW)]
    return [v for v in first + rest if v in variants] + sorted(set(variants) - set(first) - set(rest))


def _v0_reference(name: str, e: dict) -> str:
    ref = V0.get(name)
    if ref is None:
        return "—"
    return (f"{ref[0]:.4f} / {pct(ref[1])} / {pct(ref[2])} / {pct(ref[3])} (Δ {e['perplexity'] - ref[0]:+.2f} / "
            f"{100 * (e['next_token_top1'] - ref[1]):+.1f} / {100 * (e['hellaswag'] - ref[2]):+.1f} / "
            f"{100 * (e['piqa'] - ref[3]):+.1f})")


def shown(report: dict, context: dict) -> dict:
    """What `templates/variants.md.j2` reads beside the report. `context`: as `render.report`."""
    v, rows, mapped, c = report["variants"], order(report["variants"]), report["selected"], report["comparisons"]
    v0 = tuple(context["pair"]) == V0_PAIR  # V0's figures compare with V0's pair only, whatever the profile is called
    hs, pq = ("HellaSwag-shaped", "PIQA-shaped") if context["data_kind"] == "generated" else ("HellaSwag", "PIQA")
    gap_rows = [n for n in rows if v[n].get("gap_closure_next_token_top1") is not None and n != "source"]
    kinds = sorted({(task, kind) for e in v.values() for task, figures in e["tasks"].items()
                    for kind in figures["kinds"]})
    ks = k_comparison(v)
    beaten = [(words, c[f"{mapped}_minus_{other}"]["tasks_low"] > 0) for other, words in RIVALS.items()
              if f"{mapped}_minus_{other}" in c]
    return {
        "v0": v0, "v0_pair": V0_PAIR, "hs": hs, "pq": pq, "source": model_phrase(context["source"]),
        "pair_source": model_phrase(context["pair"][0]),
        "skipped": [(label(name), reason) for name, reason in report["skipped"].items()],
        "table": md_table(
            ["Variant", "Perplexity", "Next-token top-1", hs, pq, "Retention [95% CI]", "Gap closure [95% CI]",
             *(["V0 reference"] if v0 else [])],
            [[label(n, v[n]), f"{v[n]['perplexity']:.4f}", pct(v[n]["next_token_top1"]),
              pct(v[n]["hellaswag"]), pct(v[n]["piqa"]),
              pct_ci(v[n], "retention"), pct_ci(v[n], "gap_closure"),
              *([_v0_reference(n, v[n])] if v0 else [])] for n in rows]),
        "gap": md_table(["Variant", "Tasks [95% CI]", "Next-token top-1 [95% CI]", "Log-perplexity [95% CI]"],
                        [[label(n, v[n]), *(pct_ci(v[n], k) for k in GAP_CLOSURE_KEYS.values())] for n in gap_rows])
        if gap_rows else None,
        "wide": [label(n, v[n], setting=False) for n in gap_rows if v[n]["gap_closure_low"] is not None
                 and v[n]["gap_closure_low"] < 0 < v[n]["gap_closure_high"]
                 and v[n]["gap_closure_high"] - v[n]["gap_closure_low"] > WIDE],
        "beside": md_table(
            ["Variant", "PPL ratio", "Agreement (all positions)", "Mean KL", "Rollout agreement", f"{hs} acc",
             f"{pq} acc"],
            [[label(n, v[n]), f"{v[n]['ppl_ratio']:.3f}", pct(v[n]["agreement"]), f"{v[n]['mean_kl']:.4f}",
              pct(v[n]["rollout_agreement"]), pct(v[n]["tasks"]["hellaswag"]["acc"]),
              pct(v[n]["tasks"]["piqa"]["acc"])] for n in rows]),
        "kinds": md_table(["Variant", *(f"{task} {kind}" for task, kind in kinds)],
                          [[label(n, v[n]), *(pct(v[n]["tasks"][task]["kinds"].get(kind, {}).get("acc"))
                                              for task, kind in kinds)] for n in rows]) if kinds else None,
        "comparisons": md_table(
            ["Comparison", "Tasks Δ [95% CI]", "McNemar p", "n", "Next-token Δ [95% CI]", "McNemar p", "n"],
            [[name.replace("_", " "), interval(e["tasks_diff"], e["tasks_low"], e["tasks_high"]),
              f"{e['tasks_mcnemar_p']:.3g}", e["tasks_n"],
              interval(e["next_token_diff"], e["next_token_low"], e["next_token_high"]),
              f"{e['next_token_mcnemar_p']:.3g}", e["next_token_n"]] for name, e in c.items()]),
        "criteria": md_table(["Criterion", "Threshold", "Measured", "Verdict"],
                             [[CRITERION_NAMES.get(name, name.replace("_", " ")), criterion["threshold"],
                               "—" if criterion.get("measured") is None else f"{criterion['measured']:.3f}",
                               verdict(criterion)] for name, criterion in report["criteria"].items()]),
        # the rivals' words, by whether the selected map beats each with an interval that excludes 0
        "beaten": [words for words, won in beaten if won], "open": [words for words, won in beaten if not won],
        "k": ks if ks is not None and ks[0] in c else None,
        "failed": [name for name, criterion in report["criteria"].items()
                   if not criterion["passed"] and not criterion.get("milestone")],
    }


def controls(results: dict) -> str:
    rows = []
    for name, entry in results.items():
        figures_ = ", ".join(f"{k} {val:.3g}" if isinstance(val, float) else f"{k} {val}"
                             for k, val in entry.items() if k != "passed" and not isinstance(val, dict))
        rows.append([name.replace("_", " "), "yes" if entry["passed"] else "NO", figures_])
    return md_table(["Control", "Passed", "Figure"], rows)


def figure(report: dict, run: Run, folder: Path) -> dict[str, pd.DataFrame]:
    names = order(report["variants"])
    retention_table = pd.DataFrame([{"variant": n, "retention": report["variants"][n]["retention"],
                                     "low": report["variants"][n]["retention_low"],
                                     "high": report["variants"][n]["retention_high"]} for n in names])
    rows = []
    for name in names:
        agree = np.array(run.prompts[name].agree_by_position.tolist(), dtype=object)
        width = max(len(a) for a in agree)
        for position in range(width):
            values = [a[position] for a in agree if len(a) > position]
            rows.append({"variant": name, "position": position, "agreement": float(np.mean(values))})
    position_table = pd.DataFrame(rows)

    fig, ax = subplots(figsize=(7, 3.5))
    y = retention_table.retention.to_numpy()
    errors = np.vstack([y - retention_table.low.to_numpy(), retention_table.high.to_numpy() - y])
    ax.bar(range(len(names)), y, yerr=np.nan_to_num(errors), capsize=4, color="#4c72b0")
    ax.axhline(report["criteria"]["retention_floor"]["threshold"], color="#c44e52", ls="--", lw=1,
               label="retention floor")
    entries = report["variants"]
    ax.set_xticks(range(len(names)), [label(n, entries[n], setting=False).replace(" ", "\n", 2) for n in names],
                  fontsize=7)
    ax.set_ylabel("normalized retention")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, folder / "retention.png")

    fig, ax = subplots(figsize=(7, 3.5))
    for name, group in position_table.groupby("variant", sort=False):
        ax.plot(group.position, group.agreement, marker=".", label=label(name, entries[name], setting=False))
    ax.set_xlabel("continuation position")
    ax.set_ylabel("top-1 agreement with the oracle")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, folder / "agreement_by_position.png")
    return {"retention": retention_table, "agreement_by_position": position_table}
