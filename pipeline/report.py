"""Stage `report`: normalized retention, paired statistics, gates, and the V0-style report.

Reads every variant's metrics and per-item results (`evaluate`), the controls, the selection, the fit
diagnostics and the latency study; writes metrics/report.json (top-level `variants`, `selected`,
`comparisons`, `gates`), report.md (the V0 table with V0's published figures beside it, intervals, gates,
environment and a reading generated from the numbers), PNG figures under report/, and small tables for
`dvc plots` under plots/.
"""
from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

from pipeline.artifacts import atomic_path, write_bytes_atomic, write_json_atomic
from pipeline.params import load_section, read_params, spec
from pipeline.stats import mcnemar, paired_bootstrap
from pipeline.tasks import CHANCE

TASKS = ("hellaswag", "piqa")
# V0's published table (PROTOCOL.md): perplexity, next-token top-1, HellaSwag, PIQA
V0 = {
    "oracle": (15.2157, 1.00, 0.594, 0.740),
    "direct": (44.2169, 0.02, 0.366, 0.600),
    "mapped_k1": (17.3496, 0.61, 0.546, 0.702),
    "mapped_k4": (17.0744, 0.62, 0.512, 0.684),
}
LABELS = {
    "oracle": "Target full-prefill oracle",
    "direct": "Direct source-cache injection",
    "source": "Source model alone",
    "zero": "Null control: zero cache",
    "shuffled": "Null control: shuffled cache",
    "selected": "Selected mapped transfer",
}


@dataclass
class Gates:
    retention_floor: float = spec(0.80, min=0.0, max=1.0)
    perplexity_ratio_limit: float = spec(1.25, positive=True)
    agreement_milestone: float = spec(0.80, min=0.0, max=1.0)
    noninferiority_margin: float = spec(0.05, min=0.0, max=1.0)


@dataclass
class ReportParams:
    gates: Gates = field(default_factory=Gates)
    retention_metric: Literal["acc", "acc_norm"] = "acc_norm"
    mapped_variant: str = "selected"
    bootstrap_iters: int = spec(2000, positive=True)
    seed: int = 0


def retention(acc_variant: float, acc_oracle: float, chance: float) -> float:
    """PROTOCOL's normalized retention for one task: (acc_variant - chance) / (acc_oracle - chance)."""
    if acc_oracle <= chance:
        return float("nan")  # the oracle itself is at chance: nothing to retain
    return (acc_variant - chance) / (acc_oracle - chance)


def mean_retention(acc: dict[str, float], oracle: dict[str, float]) -> float:
    return float(np.mean([retention(acc[t], oracle[t], CHANCE[t]) for t in TASKS]))


def label(variant: str) -> str:
    if variant.startswith("mapped_k"):
        return f"Learned mapped transfer, k={variant[len('mapped_k'):]}"
    return LABELS.get(variant, variant)


def paired_items(items: dict[str, pd.DataFrame], a: str, b: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """0/1 outcomes of variants a and b on the same items, both tasks concatenated."""
    left = items[a].set_index(["task", "item"])[metric]
    right = items[b].set_index(["task", "item"])[metric]
    joined = pd.concat([left.rename("a"), right.rename("b")], axis=1, join="inner")
    return joined.a.to_numpy(), joined.b.to_numpy()


def retention_interval(items: dict[str, pd.DataFrame], variant: str, metric: str, iters: int, seed: int) -> dict:
    """Paired bootstrap of mean retention: items resampled per task, the same draw for variant and oracle."""
    rng = np.random.default_rng(seed)
    draws = np.zeros(iters)
    point = []
    for task in TASKS:
        v = items[variant][items[variant].task == task].sort_values("item")[metric].to_numpy()
        o = items["oracle"][items["oracle"].task == task].sort_values("item")[metric].to_numpy()
        picks = rng.integers(0, len(v), size=(iters, len(v)))
        acc_v, acc_o = v[picks].mean(1), o[picks].mean(1)
        chance = CHANCE[task]
        with np.errstate(divide="ignore", invalid="ignore"):
            draws += np.where(acc_o > chance, (acc_v - chance) / (acc_o - chance), np.nan) / len(TASKS)
        point.append(retention(v.mean(), o.mean(), chance))
    low, high = np.nanpercentile(draws, [2.5, 97.5])
    return {"retention": float(np.mean(point)), "low": float(low), "high": float(high)}


def comparison(items, prompts, a: str, b: str, metric: str, iters: int, seed: int) -> dict:
    x, y = paired_items(items, a, b, metric)
    tasks = paired_bootstrap(x, y, iters, seed)
    pa, pb = prompts[a].sort_values("prompt"), prompts[b].sort_values("prompt")
    agreement = paired_bootstrap(pa.first_agree.to_numpy(), pb.first_agree.to_numpy(), iters, seed)
    return {"tasks_diff": tasks["diff"], "tasks_low": tasks["low"], "tasks_high": tasks["high"], "tasks_n": tasks["n"],
            "tasks_mcnemar_p": mcnemar(x, y), "next_token_diff": agreement["diff"], "next_token_low": agreement["low"],
            "next_token_high": agreement["high"], "next_token_n": agreement["n"],
            "next_token_mcnemar_p": mcnemar(pa.first_agree.to_numpy(), pb.first_agree.to_numpy())}


def load_variants(variants: list[str]) -> tuple[dict, dict, dict]:
    """The declared variants' metrics and per-item results (not whatever else metrics/eval holds: a profile
    with other k candidates leaves other files there)."""
    metrics, items, prompts = {}, {}, {}
    for variant in variants:
        path = Path("metrics/eval") / f"{variant}.json"
        metrics[variant] = json.loads(path.read_text())
        items[variant] = pd.read_parquet(Path("eval") / variant / "items.parquet")
        prompts[variant] = pd.read_parquet(Path("eval") / variant / "prompts.parquet")
    if "oracle" not in metrics:
        raise FileNotFoundError("metrics/eval/oracle.json not found: the report needs the oracle's evaluation")
    return metrics, items, prompts


def build(params: ReportParams, metrics: dict, items: dict, prompts: dict, controls: dict) -> dict:
    oracle_acc = {t: metrics["oracle"][f"{t}_{params.retention_metric}"] for t in TASKS}
    variants = {}
    for variant, m in metrics.items():
        acc = {t: m[f"{t}_{params.retention_metric}"] for t in TASKS}
        interval = retention_interval(items, variant, params.retention_metric, params.bootstrap_iters, params.seed)
        entry = {
            "perplexity": m["perplexity"], "ppl_ratio": m["perplexity"] / metrics["oracle"]["perplexity"],
            "next_token_top1": m["next_token_top1"], "agreement": m["agreement"], "mean_kl": m["mean_kl"],
            "rollout_agreement": m["rollout_agreement"], **{t: acc[t] for t in TASKS},
            "retention": mean_retention(acc, oracle_acc), "retention_low": interval["low"],
            "retention_high": interval["high"], "prompts": m["prompts"],
        }
        for t in TASKS:
            entry[f"{t}_acc"], entry[f"{t}_acc_norm"], entry[f"{t}_n"] = m[f"{t}_acc"], m[f"{t}_acc_norm"], m[f"{t}_n"]
        entry.update({k: v for k, v in m.items() if k.count("_") >= 2 and k.split("_")[1] in ("recall", "gist", "knowledge")})
        variants[variant] = entry

    mapped = params.mapped_variant
    if mapped not in metrics:
        raise FileNotFoundError(f"report.mapped_variant {mapped!r} has no evaluation (metrics/eval/{mapped}.json)")
    pairs = {f"{mapped}_minus_{other}": (mapped, other) for other in ("source", "zero", "shuffled", "direct") if other in metrics}
    larger_k = sorted((int(v[8:]) for v in metrics if v.startswith("mapped_k") and v != "mapped_k1"))
    if "mapped_k1" in metrics and larger_k:  # V0's k=1 vs k=4; the tiny pair's largest k is its layer count
        pairs[f"k1_minus_k{larger_k[-1]}"] = ("mapped_k1", f"mapped_k{larger_k[-1]}")
    pairs[f"oracle_minus_{mapped}"] = ("oracle", mapped)
    comparisons = {name: comparison(items, prompts, a, b, "acc", params.bootstrap_iters, params.seed) for name, (a, b) in pairs.items()}

    g, chosen = params.gates, variants[mapped]
    beats = {other: comparisons[f"{mapped}_minus_{other}"]["tasks_low"] > 0 for other in ("source", "zero", "shuffled") if other in metrics}
    gates = {
        "controls_passed": {"passed": all(entry["passed"] for entry in controls.values()), "threshold": "all"},
        "retention_floor": {"passed": chosen["retention"] >= g.retention_floor, "threshold": g.retention_floor, "measured": chosen["retention"]},
        "perplexity_ratio": {"passed": chosen["ppl_ratio"] <= g.perplexity_ratio_limit, "threshold": g.perplexity_ratio_limit, "measured": chosen["ppl_ratio"]},
        "beats_source_and_nulls": {"passed": bool(beats) and all(beats.values()), "threshold": "95% interval of the task-accuracy difference excludes 0", **{f"beats_{k}": v for k, v in beats.items()}},
        "noninferiority": {"passed": comparisons[f"oracle_minus_{mapped}"]["tasks_high"] < g.noninferiority_margin, "threshold": g.noninferiority_margin, "measured": comparisons[f"oracle_minus_{mapped}"]["tasks_high"]},
        "agreement_milestone": {"passed": chosen["next_token_top1"] >= g.agreement_milestone, "threshold": g.agreement_milestone, "measured": chosen["next_token_top1"], "milestone": True},
    }
    return {"variants": variants, "selected": mapped, "comparisons": comparisons, "gates": gates,
            "retention_metric": params.retention_metric}


def _pct(x: float) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _order(variants: dict) -> list[str]:
    first = ["oracle", "direct"] + sorted((v for v in variants if v.startswith("mapped_k")), key=lambda v: int(v[8:]))
    rest = ["selected", "source", "zero", "shuffled"]
    return [v for v in first + rest if v in variants] + sorted(set(variants) - set(first) - set(rest))


def markdown(report: dict, context: dict) -> str:
    v, profile = report["variants"], context["profile"]
    lines = [f"# KV handoff report — profile `{profile}`", "",
             f"Source `{context['source']}` → target `{context['target']}`; {context['dtype']} on {context['device']}. "
             f"Task metric for retention: `{report['retention_metric']}`, zero-shot, eval part only.", "",
             "## The V0 table", "",
             "| Variant | Perplexity | Next-token top-1 | HellaSwag | PIQA | Retention [95% CI] | V0 reference |",
             "|---|---|---|---|---|---|---|"]
    for name in _order(v):
        e = v[name]
        ref = V0.get(name)
        reference = "—" if ref is None else f"{ref[0]:.4f} / {_pct(ref[1])} / {_pct(ref[2])} / {_pct(ref[3])}"
        if ref is not None and profile == "qwen3-v0":
            reference += f" (Δ {e['perplexity'] - ref[0]:+.2f} / {100 * (e['next_token_top1'] - ref[1]):+.1f} / " \
                         f"{100 * (e['hellaswag'] - ref[2]):+.1f} / {100 * (e['piqa'] - ref[3]):+.1f})"
        lines.append(f"| {label(name)} | {e['perplexity']:.4f} | {_pct(e['next_token_top1'])} | {_pct(e['hellaswag'])} | "
                     f"{_pct(e['piqa'])} | {_pct(e['retention'])} [{_pct(e['retention_low'])}, {_pct(e['retention_high'])}] | {reference} |")
    o = v["oracle"]
    lines += ["", f"Items: HellaSwag {o['hellaswag_n']}, PIQA {o['piqa_n']}; eval prompts {o['prompts']}. "
              f"V0 reference: perplexity / next-token top-1 / HellaSwag / PIQA as published (V0's own data; comparable "
              f"only as ratios{' — deltas shown' if profile == 'qwen3-v0' else ''}).", ""]
    lines += ["## Beside the V0 columns", "", "| Variant | PPL ratio | Agreement (all positions) | Mean KL | Rollout agreement | HellaSwag acc | PIQA acc |",
              "|---|---|---|---|---|---|---|"]
    for name in _order(v):
        e = v[name]
        lines.append(f"| {label(name)} | {e['ppl_ratio']:.3f} | {_pct(e['agreement'])} | {e['mean_kl']:.4f} | "
                     f"{_pct(e['rollout_agreement'])} | {_pct(e['hellaswag_acc'])} | {_pct(e['piqa_acc'])} |")
    kinds = sorted({k for e in v.values() for k in e if k.endswith("_acc") and k.split("_")[1] in ("recall", "gist", "knowledge")})
    if kinds:
        lines += ["", "### By item kind (acc)", "", "| Variant | " + " | ".join(k[:-4].replace("_", " ") for k in kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        for name in _order(v):
            lines.append(f"| {label(name)} | " + " | ".join(_pct(v[name].get(k)) for k in kinds) + " |")
    lines += ["", "## Paired comparisons", "",
              "Differences of task accuracy (both tasks' items together, `acc`) and of next-token top-1 agreement; "
              "paired bootstrap 95% intervals over items/prompts, exact McNemar p-values.", "",
              "| Comparison | Tasks Δ [95% CI] | McNemar p | n | Next-token Δ [95% CI] | McNemar p | n |", "|---|---|---|---|---|---|---|"]
    for name, c in report["comparisons"].items():
        lines.append(f"| {name.replace('_', ' ')} | {100 * c['tasks_diff']:+.1f} [{100 * c['tasks_low']:+.1f}, {100 * c['tasks_high']:+.1f}] | "
                     f"{c['tasks_mcnemar_p']:.3g} | {c['tasks_n']} | {100 * c['next_token_diff']:+.1f} "
                     f"[{100 * c['next_token_low']:+.1f}, {100 * c['next_token_high']:+.1f}] | {c['next_token_mcnemar_p']:.3g} | {c['next_token_n']} |")
    lines += ["", "## Gates (declared in params before the run)", "", "| Gate | Threshold | Measured | Verdict |", "|---|---|---|---|"]
    for name, gate in report["gates"].items():
        measured = gate.get("measured")
        shown = "—" if measured is None else f"{measured:.3f}"
        verdict = ("reached" if gate["passed"] else "not reached") if gate.get("milestone") else ("PASS" if gate["passed"] else "FAIL")
        lines.append(f"| {name.replace('_', ' ')} | {gate['threshold']} | {shown} | {verdict} |")
    lines += ["", "## Reading", "", reading(report, context), ""]
    lines += context.get("sections", [])
    lines += ["## Figures", "", "![Retention by variant](report/retention.png)", "",
              "![Agreement with the oracle by continuation position](report/agreement_by_position.png)", ""]
    lines += ["## Environment", ""] + [f"- {k}: {val}" for k, val in context["environment"].items()] + [""]
    return "\n".join(lines)


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


RIVALS = {"source": "the source model alone", "zero": "the zero-cache null", "shuffled": "the shuffled-cache null",
          "direct": "direct injection"}


def reading(report: dict, context: dict) -> str:
    """One paragraph generated from the numbers: what is and is not established at this sample size."""
    v, c, g, mapped = report["variants"], report["comparisons"], report["gates"], report["selected"]
    e = v[mapped]
    width = 100 * (e["retention_high"] - e["retention_low"]) / 2
    parts = [f"The selected map ({context.get('selected_name', mapped)}) retains {_pct(e['retention'])} of the oracle's "
             f"above-chance task accuracy (95% interval ±{width:.0f} points at {e['hellaswag_n']} + {e['piqa_n']} items), "
             f"with perplexity {e['ppl_ratio']:.2f}x the oracle's and next-token agreement {_pct(e['next_token_top1'])}."]
    established, open_ = [], []
    for other in ("source", "zero", "shuffled", "direct"):
        key = f"{mapped}_minus_{other}"
        if key in c:
            (established if c[key]["tasks_low"] > 0 else open_).append(RIVALS[other])
    if established:
        parts.append(f"It beats {_and(established)} on task accuracy with intervals that exclude 0.")
    if open_:
        parts.append(f"It is not shown to beat {_and(open_)}: those intervals include 0, so at this sample size the "
                     f"difference may be noise (or, for the source alone, the handoff adds nothing the source did not read).")
    ni = c[f"oracle_minus_{mapped}"]
    parts.append(f"Non-inferiority to the oracle within {g['noninferiority']['threshold']} is "
                 f"{'established' if g['noninferiority']['passed'] else 'not established'} "
                 f"(upper bound of the oracle's lead {100 * ni['tasks_high']:.1f} points).")
    for name in [n for n in c if n.startswith("k1_minus_k")]:
        k = c[name]
        parts.append(f"k=1 vs k={name[len('k1_minus_k'):]}: {100 * k['tasks_diff']:+.1f} points on tasks [{100 * k['tasks_low']:+.1f}, {100 * k['tasks_high']:+.1f}]"
                     f"{'' if k['tasks_low'] > 0 or k['tasks_high'] < 0 else ', not distinguishable here'}.")
    failed = [name for name, gate in g.items() if not gate["passed"] and not gate.get("milestone")]
    parts.append("All gates pass." if not failed else f"Gates not passed: {', '.join(failed)}.")
    return " ".join(parts)


def figures(report: dict, prompts: dict, folder: Path) -> dict[str, pd.DataFrame]:
    """PNG figures for report.md and the tables behind them (for `dvc plots`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = _order(report["variants"])
    retention_table = pd.DataFrame([{"variant": n, "retention": report["variants"][n]["retention"],
                                     "low": report["variants"][n]["retention_low"], "high": report["variants"][n]["retention_high"]}
                                    for n in order])
    rows = []
    for name in order:
        agree = np.array(prompts[name].agree_by_position.tolist(), dtype=object)
        width = max(len(a) for a in agree)
        for position in range(width):
            values = [a[position] for a in agree if len(a) > position]
            rows.append({"variant": name, "position": position, "agreement": float(np.mean(values))})
    position_table = pd.DataFrame(rows)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    y = retention_table.retention.to_numpy()
    errors = np.vstack([y - retention_table.low.to_numpy(), retention_table.high.to_numpy() - y])
    ax.bar(range(len(order)), y, yerr=np.nan_to_num(errors), capsize=4, color="#4c72b0")
    ax.axhline(report["gates"]["retention_floor"]["threshold"], color="#c44e52", ls="--", lw=1, label="retention floor")
    ax.set_xticks(range(len(order)), [label(n).replace(" ", "\n", 2) for n in order], fontsize=7)
    ax.set_ylabel("normalized retention")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save_figure(fig, folder / "retention.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, group in position_table.groupby("variant", sort=False):
        ax.plot(group.position, group.agreement, marker=".", label=label(name))
    ax.set_xlabel("continuation position")
    ax.set_ylabel("top-1 agreement with the oracle")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _save_figure(fig, folder / "agreement_by_position.png")
    plt.close("all")
    return {"retention": retention_table, "agreement_by_position": position_table}


def _save_figure(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def environment(models: dict) -> dict:
    import lm_eval
    import torch
    import transformers

    from pipeline.models import read_pointer

    revisions = {name: (read_pointer(f"models/{name}") or {}).get("revision", "local") for name in ("source", "target")}
    return {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "lm-eval": lm_eval.__version__, "platform": platform.platform(), "device": models["device"], "dtype": models["dtype"],
        "threads": torch.get_num_threads(), "source revision": revisions["source"], "target revision": revisions["target"],
    }


def optional_sections() -> list[str]:
    """Controls, selection and latency summaries, when their metrics exist."""
    lines = []
    controls = Path("metrics/controls.json")
    if controls.is_file():
        lines += ["## Controls", "", "| Control | Passed | Figure |", "|---|---|---|"]
        for name, entry in json.loads(controls.read_text()).items():
            figures_ = ", ".join(f"{k} {val:.3g}" if isinstance(val, float) else f"{k} {val}" for k, val in entry.items()
                                 if k != "passed" and not isinstance(val, dict))
            lines.append(f"| {name.replace('_', ' ')} | {'yes' if entry['passed'] else 'NO'} | {figures_} |")
        lines.append("")
    latency = Path("metrics/latency.json")
    if latency.is_file():
        data = json.loads(latency.read_text())
        lengths = sorted({int(k[3:].split("_")[0]) for k in data if k.startswith("len") and k[3:].split("_")[0].isdigit()})
        lines += ["## Latency (time to first token)", "", "| Prompt tokens | Target prefill ms | Handoff ms | Speedup | FLOP bound | Fraction of bound |",
                  "|---|---|---|---|---|---|"]
        for n in lengths:
            get = lambda key: data.get(f"len{n}_{key}", float("nan"))  # noqa: E731
            lines.append(f"| {n} | {get('target_ms'):.2f} | {get('handoff_ms'):.2f} | {get('speedup'):.2f}x | {get('bound'):.2f}x | {_pct(get('fraction_of_bound'))} |")
        lines += ["", "![TTFT against prompt length](plots/latency.png)", ""]
    return lines


def main() -> None:
    params = load_section(ReportParams, "report")
    everything = read_params()
    evaluate = everything["evaluate"]
    metrics, items, prompts = load_variants(["oracle", *evaluate["baselines"], *evaluate["mapped"]])
    controls = json.loads(Path("metrics/controls.json").read_text())
    report = build(params, metrics, items, prompts, controls)
    select = json.loads(Path("metrics/select.json").read_text()) if Path("metrics/select.json").is_file() else {}
    tables = figures(report, prompts, Path("report"))
    Path("plots").mkdir(exist_ok=True)
    for name, table in tables.items():
        with atomic_path(Path("plots") / f"{name}.csv") as tmp:
            table.to_csv(tmp, index=False)
    context = {"profile": everything.get("profile", "?"), "source": everything["models"]["source"],
               "target": everything["models"]["target"], "dtype": everything["models"]["dtype"],
               "device": everything["models"]["device"], "environment": environment(everything["models"]),
               "selected_name": select.get("selected", params.mapped_variant), "sections": optional_sections()}
    write_json_atomic("metrics/report.json", report)
    write_bytes_atomic("report.md", markdown(report, context).encode())
    print(markdown(report, context))


if __name__ == "__main__":
    main()
