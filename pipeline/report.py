"""Stage `report`: normalized retention, gap closure, paired statistics, gates, and the V0-style report.

Reads every variant's metrics and per-item results (`evaluate`), the controls, the selection, the fit
diagnostics, every candidate's evaluation (`candidates`) and the latency study; writes
metrics/headline/<variant>.json (the few figures per variant that `dvc metrics show/diff` compare),
metrics/report.json (everything: `variants`, `selected`, `comparisons`, `gates`, `candidates` with the
proxies' rank correlations and the Pareto fronts), report.md (the V0 table with V0's published figures beside
it, intervals, gates, every candidate, environment and a reading generated from the numbers), PNG figures under
report/, and small tables for `dvc plots` under plots/.
"""
from __future__ import annotations

import json
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lm_eval
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import transformers

from pipeline.measure.retention import (
    comparison,
    gap_closure_interval,
    mean_gap_closure,
    mean_retention,
    paired_items,
    retention_interval,
)
from pipeline.measure.stats import mcnemar, paired_bootstrap, pareto_front, rank_correlation, sign_test
from pipeline.store.artifacts import atomic_dir, atomic_path, write_bytes_atomic, write_json_atomic
from pipeline.store.cli import entry, md_table, no_arguments
from pipeline.store.models import ModelsParams, read_pointer
from pipeline.store.params import load_section, read_key, spec
from pipeline.store.splits import ITEM_KINDS, TASKS

# V0's published table (PROTOCOL.md): perplexity, next-token top-1, HellaSwag, PIQA
V0 = {
    "oracle": (15.2157, 1.00, 0.594, 0.740),
    "direct": (44.2169, 0.02, 0.366, 0.600),
    "mapped_k1": (17.3496, 0.61, 0.546, 0.702),
    "mapped_k4": (17.0744, 0.62, 0.512, 0.684),
}
matplotlib.use("Agg")
HEADLINE = Path("metrics/headline")
CANDIDATES, CANDIDATE_ITEMS = Path("metrics/candidates.json"), Path("eval/candidates")
CALIBRATION, CALIBRATION_ITEMS = Path("metrics/calibration"), Path("eval/calibration")
LENGTH, LENGTH_ROWS = Path("metrics/length.json"), Path("eval/length")
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
    retention_floor: float = spec(min=0.0, max=1.0)
    gap_closure_floor: float = spec(min=0.0, max=1.0)  # of the source-to-oracle gap; needs the source baseline
    perplexity_ratio_limit: float = spec(positive=True)
    agreement_milestone: float = spec(min=0.0, max=1.0)  # on next-token top-1
    noninferiority_margin: float = spec(min=0.0, max=1.0)


@dataclass
class ReportParams:
    gates: Gates
    retention_metric: Literal["acc", "acc_norm"]
    mapped_variant: str
    bootstrap_iters: int = spec(positive=True)
    seed: int


def label(variant: str) -> str:
    if variant.startswith("mapped_k"):
        return f"Learned mapped transfer, k={variant[len('mapped_k'):]}"
    return LABELS.get(variant, variant)


def load_variants(variants: list[str]) -> tuple[dict, dict, dict, dict]:
    """The declared variants' metrics and per-item results (not whatever else metrics/eval holds: a profile
    with other k candidates leaves other files there), and the reasons of those the pair's contract skipped."""
    metrics, items, prompts, skipped = {}, {}, {}, {}
    for variant in variants:
        path = Path("metrics/eval") / f"{variant}.json"
        metrics[variant] = json.loads(path.read_text())
        if "skipped" in metrics[variant]:  # undefined for this pair (kv.contract): reported, not compared
            skipped[variant] = metrics.pop(variant)["skipped"]
            continue
        items[variant] = pd.read_parquet(Path("eval") / variant / "items.parquet")
        prompts[variant] = pd.read_parquet(Path("eval") / variant / "prompts.parquet")
    if "oracle" not in metrics:
        raise FileNotFoundError("metrics/eval/oracle.json not found: the report needs the oracle's evaluation")
    return metrics, items, prompts, skipped


def build(params: ReportParams, metrics: dict, items: dict, prompts: dict, controls: dict) -> dict:
    accuracy = {name: {t: m[f"{t}_{params.retention_metric}"] for t in TASKS} for name, m in metrics.items()}
    oracle_acc = accuracy["oracle"]
    variants = {}
    for variant, m in metrics.items():
        acc = accuracy[variant]
        interval = retention_interval(items, variant, params.retention_metric, params.bootstrap_iters, params.seed)
        closure = {"gap_closure": None, "gap_closure_low": None, "gap_closure_high": None}
        if "source" in items:  # the gap is the source model's own: without its evaluation there is none
            bounds = gap_closure_interval(items, variant, params.retention_metric, params.bootstrap_iters,
                                          params.seed)
            closure = {"gap_closure": mean_gap_closure(acc, accuracy["source"], oracle_acc),
                       "gap_closure_low": bounds["low"], "gap_closure_high": bounds["high"]}
        entry = {
            "perplexity": m["perplexity"], "ppl_ratio": m["perplexity"] / metrics["oracle"]["perplexity"],
            "next_token_top1": m["next_token_top1"], "agreement": m["agreement"], "mean_kl": m["mean_kl"],
            "rollout_agreement": m["rollout_agreement"], **{t: acc[t] for t in TASKS},
            "retention": mean_retention(acc, oracle_acc), "retention_low": interval["low"],
            "retention_high": interval["high"], **closure, "prompts": m["prompts"],
        }
        for t in TASKS:
            entry[f"{t}_acc"], entry[f"{t}_acc_norm"], entry[f"{t}_n"] = m[f"{t}_acc"], m[f"{t}_acc_norm"], m[f"{t}_n"]
        entry.update({k: v for k, v in m.items() if k.count("_") >= 2 and k.split("_")[1] in ITEM_KINDS})
        variants[variant] = entry

    mapped = params.mapped_variant
    if mapped not in metrics:
        raise FileNotFoundError(f"report.mapped_variant {mapped!r} has no evaluation (metrics/eval/{mapped}.json)")
    pairs = {f"{mapped}_minus_{other}": (mapped, other) for other in RIVALS if other in metrics}
    larger_k = sorted((int(v[8:]) for v in metrics if v.startswith("mapped_k") and v != "mapped_k1"))
    if "mapped_k1" in metrics and larger_k:  # V0's k=1 vs k=4; the tiny pair's largest k is its layer count
        pairs[f"k1_minus_k{larger_k[-1]}"] = ("mapped_k1", f"mapped_k{larger_k[-1]}")
    pairs[f"oracle_minus_{mapped}"] = ("oracle", mapped)
    comparisons = {name: comparison(items, prompts, a, b, "acc", params.bootstrap_iters, params.seed)
                   for name, (a, b) in pairs.items()}

    g, chosen = params.gates, variants[mapped]
    beats = {other: comparisons[f"{mapped}_minus_{other}"]["tasks_low"] > 0
             for other in ("source", "zero", "shuffled") if other in metrics}
    oracle_lead = comparisons[f"oracle_minus_{mapped}"]["tasks_high"]
    gates = {
        "controls_passed": {"passed": all(entry["passed"] for entry in controls.values()), "threshold": "all"},
        "retention_floor": _gate(chosen["retention"] >= g.retention_floor, g.retention_floor, chosen["retention"]),
        "gap_closure_floor": _gate(chosen["gap_closure"] is not None and chosen["gap_closure"] >= g.gap_closure_floor,
                                   g.gap_closure_floor, chosen["gap_closure"]),
        "perplexity_ratio": _gate(chosen["ppl_ratio"] <= g.perplexity_ratio_limit, g.perplexity_ratio_limit,
                                  chosen["ppl_ratio"]),
        "beats_source_and_nulls": {"passed": bool(beats) and all(beats.values()),
                                   "threshold": "95% interval of the task-accuracy difference excludes 0",
                                   **{f"beats_{k}": v for k, v in beats.items()}},
        "noninferiority": _gate(oracle_lead < g.noninferiority_margin, g.noninferiority_margin, oracle_lead),
        "agreement_milestone": {**_gate(chosen["next_token_top1"] >= g.agreement_milestone, g.agreement_milestone,
                                        chosen["next_token_top1"]), "milestone": True},
    }
    return {"variants": variants, "selected": mapped, "comparisons": comparisons, "gates": gates,
            "retention_metric": params.retention_metric}


PROXIES = {"r2_heldout": "held-out R² (fit, select split)", "attention_cosine": "attention-output cosine (select)",
           "agreement": "agreement (select)", "mean_kl": "mean KL (select; lower is better)"}


def candidate_study(params: ReportParams, items: dict, candidate_items: dict[str, pd.DataFrame], figures_: dict,
                    fit: dict, select: dict) -> dict:
    """Every fitted candidate's retention and gap closure on the eval part (intervals as for the variants), its
    cheap figures (`PROXIES`), speed and size; the rank correlation of each proxy with retention across
    candidates; and the Pareto fronts of gap closure against the measured speedup and against the FLOP bound at
    the real pair's shapes."""
    rows = {}
    for name, frame in candidate_items.items():
        both = {**items, name: frame}
        retention = retention_interval(both, name, params.retention_metric, params.bootstrap_iters, params.seed)
        closure = gap_closure_interval(both, name, params.retention_metric, params.bootstrap_iters, params.seed)
        rows[name] = {
            "family": figures_[f"{name}/family"], "k": figures_[f"{name}/k"],
            "retention": retention["retention"], "retention_low": retention["low"], "retention_high": retention["high"],
            "gap_closure": closure["gap_closure"], "gap_closure_low": closure["low"],
            "gap_closure_high": closure["high"],
            "r2_heldout": (fit[f"{name}/r2_keys_select"] + fit[f"{name}/r2_values_select"]) / 2,
            **{key: select[f"{name}_{key}"] for key in ("attention_cosine", "agreement", "mean_kl")},
            **{key: figures_[f"{name}/{key}"] for key in ("speedup", "bound_at_pair", "parameters", "mapper_bytes")},
        }
    names = list(rows)
    retention_values = [rows[n]["retention"] for n in names]
    proxies = {proxy: rank_correlation([rows[n][proxy] for n in names], retention_values, params.bootstrap_iters,
                                       params.seed) for proxy in PROXIES}
    closure_values = [rows[n]["gap_closure"] for n in names]
    for speed, key in (("speedup", "pareto_measured"), ("bound_at_pair", "pareto_at_pair")):
        for name, on_front in zip(names, pareto_front(closure_values, [rows[n][speed] for n in names])):
            rows[name][key] = on_front
    return {"rows": rows, "proxies": proxies, "length": figures_["length"], "bound_pair": figures_["bound_pair"]}


def calibration_study(params: ReportParams, items: dict, points: dict[int, dict],
                      point_items: dict[int, dict[str, pd.DataFrame]]) -> dict:
    """The calibration curve: per size n (fit sequences) and candidate, retention and gap closure on the eval
    part with their intervals; per size, the task-accuracy difference of the largest-k linear candidate over
    the smallest-k one (paired bootstrap, both tasks' items), and the smallest size from which it stays above
    0 at every larger size (`larger_k_pays_from`; None when it never does)."""
    rows = []
    for size in sorted(points):
        for name, frame in point_items[size].items():
            both = {**items, name: frame}
            retention = retention_interval(both, name, params.retention_metric, params.bootstrap_iters, params.seed)
            closure = gap_closure_interval(both, name, params.retention_metric, params.bootstrap_iters, params.seed)
            rows.append({"sequences": size, "tokens": points[size]["tokens"], "candidate": name,
                         "retention": retention["retention"], "retention_low": retention["low"],
                         "retention_high": retention["high"], "gap_closure": closure["gap_closure"],
                         "gap_closure_low": closure["low"], "gap_closure_high": closure["high"],
                         "params_per_token": points[size][f"{name}/params_per_token"]})
    linear = sorted({n for size in point_items for n in point_items[size] if re.fullmatch(r"linear_k\d+_lam.*", n)},
                    key=lambda n: int(n.split("_")[1][1:]))
    larger = {}
    if len(linear) >= 2:
        small, big = linear[0], linear[-1]
        for size in sorted(points):
            x, y = paired_items(point_items[size], big, small, "acc")
            larger[size] = paired_bootstrap(x, y, params.bootstrap_iters, params.seed)
    pays = [size for size in larger if all(larger[s]["low"] > 0 for s in larger if s >= size)]
    return {"rows": rows, "larger_k": {"larger": linear[-1], "smaller": linear[0], "by_size": larger}
            if larger else None, "larger_k_pays_from": min(pays) if pays else None}


def length_study(params: ReportParams, figures_: dict, rows: dict[tuple[str, int], pd.DataFrame],
                 tasks: dict[str, pd.DataFrame]) -> dict:
    """Per prompt length: both maps' perplexity ratio to the oracle and agreement (from metrics/length.json), and
    the paired comparison of the stripped map with the rotated one on the same prompts: a sign test on
    per-prompt NLL (stripped lower?) and a paired bootstrap of per-prompt agreement. Per bin of task context
    length (in multiples of the fit length): both maps' task accuracy, their paired difference and McNemar's p."""
    lengths = sorted({length for _, length in rows})
    out = []
    for length in lengths:
        stripped, rotated = (rows[(space, length)].sort_values("prompt") for space in ("stripped", "rotated"))
        agree = paired_bootstrap((stripped.agree / stripped.tokens).to_numpy(),
                                 (rotated.agree / rotated.tokens).to_numpy(), params.bootstrap_iters, params.seed)
        out.append({"length": length, "ratio_to_fit": length / figures_["fit_tokens"],
                    **{f"{space}_{key}": figures_[f"{space}/L{length}/{key}"] for space in ("stripped", "rotated")
                       for key in ("ppl_ratio", "agreement", "next_token_top1")},
                    "nll_sign_test": sign_test(stripped.nll.to_numpy(), rotated.nll.to_numpy()),
                    "agreement_diff": agree})
    fit = figures_["fit_tokens"]
    joined = tasks["stripped"].merge(tasks["rotated"], on=["task", "item", "context_tokens"],
                                     suffixes=("_stripped", "_rotated"))
    bins = []
    for low, high in ((0, 1), (1, 2), (2, 4), (4, None)):
        inside = joined[(joined.context_tokens > low * fit)
                        & ((joined.context_tokens <= high * fit) if high else True)]
        if inside.empty:
            continue
        a, b = inside.acc_stripped.to_numpy(), inside.acc_rotated.to_numpy()
        bins.append({"bin": f"{low}-{high}x" if high else f">{low}x", "items": len(inside),
                     "stripped_acc": float(a.mean()), "rotated_acc": float(b.mean()),
                     "diff": paired_bootstrap(a, b, params.bootstrap_iters, params.seed), "mcnemar_p": mcnemar(a, b)})
    return {"fit_tokens": fit, "candidate": figures_["candidate"], "prompts": figures_["prompts"], "rows": out,
            "task_bins": bins}


def headline(report: dict) -> dict[str, dict]:
    """Per variant, the figures `dvc metrics show` and `dvc metrics diff` compare (one row per variant): V0's
    columns, retention and the gap closure with their intervals, and the gap to the oracle in mean task
    accuracy."""
    oracle = report["variants"]["oracle"]
    return {name: {"perplexity": e["perplexity"], "next_token_top1": e["next_token_top1"],
                   "hellaswag": e["hellaswag"], "piqa": e["piqa"], "retention": e["retention"],
                   "retention_low": e["retention_low"], "retention_high": e["retention_high"],
                   "gap_closure": e["gap_closure"],  # its interval is in report.json
                   "gap": sum(oracle[t] - e[t] for t in TASKS) / len(TASKS)}
            for name, e in report["variants"].items()}


def _gate(passed: bool, threshold: float, measured: float) -> dict:
    return {"passed": passed, "threshold": threshold, "measured": measured}


def _pct(x: float) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _order(variants: dict) -> list[str]:
    first = ["oracle", "direct"] + sorted((v for v in variants if v.startswith("mapped_k")), key=lambda v: int(v[8:]))
    rest = ["selected", "source", "zero", "shuffled"]
    return [v for v in first + rest if v in variants] + sorted(set(variants) - set(first) - set(rest))


def _v0_reference(name: str, e: dict, profile: str) -> str:
    ref = V0.get(name)
    if ref is None:
        return "—"
    reference = f"{ref[0]:.4f} / {_pct(ref[1])} / {_pct(ref[2])} / {_pct(ref[3])}"
    if profile == "qwen3-v0":
        reference += (f" (Δ {e['perplexity'] - ref[0]:+.2f} / {100 * (e['next_token_top1'] - ref[1]):+.1f} / "
                      f"{100 * (e['hellaswag'] - ref[2]):+.1f} / {100 * (e['piqa'] - ref[3]):+.1f})")
    return reference


def _interval(value: float, low: float, high: float, scale: float = 100, fmt: str = "+.1f") -> str:
    return f"{scale * value:{fmt}} [{scale * low:{fmt}}, {scale * high:{fmt}}]"


def markdown(report: dict, context: dict) -> str:
    v, profile, order = report["variants"], context["profile"], _order(report["variants"])
    generated = context["data_kind"] == "generated"
    hs, pq = ("HellaSwag-shaped", "PIQA-shaped") if generated else ("HellaSwag", "PIQA")
    lines = [f"# KV handoff report — profile `{profile}`", "",
             f"Source `{context['source']}` → target `{context['target']}`; {context['dtype']} on {context['device']}. "
             f"Task metric for retention: `{report['retention_metric']}`, zero-shot, eval part only.", ""]
    if generated:
        lines += ["Tasks: the tiny world's HellaSwag-shaped and PIQA-shaped items (`pipeline/tiny/world.py`), scored "
                  "by lm-eval's own `hellaswag` and `piqa` definitions; they are not the real benchmarks, so the V0 "
                  "reference compares only as ratios.", ""]
    lines += ["## The V0 table", ""]
    lines += md_table(
        ["Variant", "Perplexity", "Next-token top-1", hs, pq, "Retention [95% CI]", "Gap closure [95% CI]",
         "V0 reference"],
        [[label(n), f"{v[n]['perplexity']:.4f}", _pct(v[n]["next_token_top1"]), _pct(v[n]["hellaswag"]),
          _pct(v[n]["piqa"]),
          f"{_pct(v[n]['retention'])} [{_pct(v[n]['retention_low'])}, {_pct(v[n]['retention_high'])}]",
          f"{_pct(v[n]['gap_closure'])} [{_pct(v[n]['gap_closure_low'])}, {_pct(v[n]['gap_closure_high'])}]",
          _v0_reference(n, v[n], profile)] for n in order])
    o = v["oracle"]
    if report.get("skipped"):
        lines += [""] + [f"Not run for this pair: {label(name)} — {reason}."
                         for name, reason in report["skipped"].items()]
    lines += ["", f"Items: {hs} {o['hellaswag_n']}, {pq} {o['piqa_n']}; eval prompts {o['prompts']}. "
              f"V0 reference: perplexity / next-token top-1 / HellaSwag / PIQA as published (V0's own data; comparable "
              f"only as ratios{' — deltas shown' if profile == 'qwen3-v0' else ''}). Retention is measured from "
              f"chance; the gap closure, (variant − source alone) / (oracle − source alone), from the source model "
              f"alone: 0 means the handoff buys nothing over running the small model.", ""]
    lines += ["## Beside the V0 columns", ""]
    lines += md_table(
        ["Variant", "PPL ratio", "Agreement (all positions)", "Mean KL", "Rollout agreement", f"{hs} acc",
         f"{pq} acc"],
        [[label(n), f"{v[n]['ppl_ratio']:.3f}", _pct(v[n]["agreement"]), f"{v[n]['mean_kl']:.4f}",
          _pct(v[n]["rollout_agreement"]), _pct(v[n]["hellaswag_acc"]), _pct(v[n]["piqa_acc"])] for n in order])
    kinds = sorted({k for e in v.values() for k in e if k.endswith("_acc") and k.split("_")[1] in ITEM_KINDS})
    if kinds:
        lines += ["", "### By item kind (acc)", ""]
        lines += md_table(["Variant", *(k[:-4].replace("_", " ") for k in kinds)],
                          [[label(n), *(_pct(v[n].get(k)) for k in kinds)] for n in order])
    lines += ["", "## Paired comparisons", "",
              "Differences of task accuracy (both tasks' items together, `acc`) and of next-token top-1 agreement; "
              "paired bootstrap 95% intervals over items/prompts, exact McNemar p-values.", ""]
    lines += md_table(
        ["Comparison", "Tasks Δ [95% CI]", "McNemar p", "n", "Next-token Δ [95% CI]", "McNemar p", "n"],
        [[name.replace("_", " "), _interval(c["tasks_diff"], c["tasks_low"], c["tasks_high"]),
          f"{c['tasks_mcnemar_p']:.3g}", c["tasks_n"],
          _interval(c["next_token_diff"], c["next_token_low"], c["next_token_high"]),
          f"{c['next_token_mcnemar_p']:.3g}", c["next_token_n"]] for name, c in report["comparisons"].items()])
    lines += ["", "## Gates (declared in params before the run)", ""]
    lines += md_table(["Gate", "Threshold", "Measured", "Verdict"],
                      [[GATE_NAMES.get(name, name.replace("_", " ")), gate["threshold"], _measured(gate),
                        _verdict(gate)]
                       for name, gate in report["gates"].items()])
    lines += ["", "## Reading", "", reading(report, context), ""]
    if report.get("candidates"):
        lines += candidate_lines(report["candidates"])
    if report.get("calibration"):
        lines += calibration_lines(report["calibration"])
    if report.get("length"):
        lines += length_lines(report["length"])
    lines += context.get("sections", [])
    lines += ["## Figures", "", "![Retention by variant](report/retention.png)", "",
              "![Agreement with the oracle by continuation position](report/agreement_by_position.png)", ""]
    lines += ["## Environment", ""] + [f"- {k}: {val}" for k, val in context["environment"].items()] + [""]
    return "\n".join(lines)


def candidate_lines(study: dict) -> list[str]:
    """The report's section on every candidate: quality, proxies, speed, and what predicts what."""
    rows, proxies = study["rows"], study["proxies"]
    front = lambda row: " ".join(mark for key, mark in (("pareto_measured", "here"), ("pareto_at_pair", "at pair"))  # noqa: E731
                                 if row[key]) or "—"
    lines = ["## Every candidate: what predicts retention, and the quality/speed frontier", "",
             f"Each fitted map evaluated on the eval part like a mapped variant (stage `candidates`); speedup is the "
             f"measured time to first token of the target's own prefill over the handoff's at {study['length']} "
             f"prompt tokens on this machine, the FLOP bound is the same family and k at `{study['bound_pair']}`'s "
             f"shapes. Front: on the Pareto front of gap closure against the measured speedup (here) or against "
             f"the bound (at pair).", ""]
    lines += md_table(
        ["Candidate", "Retention [95% CI]", "Gap closure [95% CI]", "Held-out R²", "Attention cos", "Agreement",
         "Mean KL", "Speedup here", "FLOP bound", "Parameters", "Bytes", "Front"],
        [[name, f"{_pct(r['retention'])} [{_pct(r['retention_low'])}, {_pct(r['retention_high'])}]",
          f"{_pct(r['gap_closure'])} [{_pct(r['gap_closure_low'])}, {_pct(r['gap_closure_high'])}]",
          f"{r['r2_heldout']:.3f}", f"{r['attention_cosine']:.3f}", _pct(r["agreement"]), f"{r['mean_kl']:.3f}",
          f"{r['speedup']:.2f}x", f"{r['bound_at_pair']:.2f}x", f"{r['parameters']:,}", f"{r['mapper_bytes']:,}",
          front(r)] for name, r in rows.items()])
    lines += ["", "Rank correlation (Spearman) of each cheap figure with eval-part retention across the candidates "
              "above; intervals resample the candidates.", ""]
    lines += md_table(["Proxy", "Spearman ρ [95% CI]", "p", "n"],
                      [[PROXIES[name], f"{c['rho']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]", f"{c['p']:.3g}",
                        c["n"]] for name, c in proxies.items()])
    lines += ["", candidate_reading(study), "", "![Gap closure against speedup](report/frontier.png)", ""]
    return lines


def calibration_lines(study: dict) -> list[str]:
    """The report's section on the calibration curve."""
    lines = ["## How much calibration", "",
             "Candidates refitted on the first n sequences of the calibration pool (`calibrate@<n>`; the fit "
             "split is its start), each evaluated on the eval part.", ""]
    lines += md_table(["Sequences", "Tokens", "Candidate", "Parameters per token", "Retention [95% CI]",
                       "Gap closure [95% CI]"],
                      [[r["sequences"], f"{r['tokens']:,}", r["candidate"], f"{r['params_per_token']:.3g}",
                        f"{_pct(r['retention'])} [{_pct(r['retention_low'])}, {_pct(r['retention_high'])}]",
                        f"{_pct(r['gap_closure'])} [{_pct(r['gap_closure_low'])}, {_pct(r['gap_closure_high'])}]"]
                       for r in study["rows"]])
    larger = study["larger_k"]
    if larger:
        lines += ["", f"{larger['larger']} minus {larger['smaller']}: task accuracy (`acc`, both tasks' items), "
                  "paired bootstrap 95% interval.", ""]
        lines += md_table(["Sequences", "Δ [95% CI]", "n"],
                          [[size, _interval(c["diff"], c["low"], c["high"]), c["n"]]
                           for size, c in larger["by_size"].items()])
        start = study["larger_k_pays_from"]
        lines += ["", f"The larger k pays off (interval above 0 at this size and every larger one) from {start} "
                  f"sequences on." if start is not None else "The larger k is not shown to pay off at any size "
                  "here (no size from which every interval is above 0)."]
    lines += ["", "![Calibration curve](report/calibration.png)", ""]
    return lines


def length_lines(study: dict) -> list[str]:
    """The report's section on length generalization and what stripping RoPE buys."""
    lines = ["## Longer prompts than the fit saw", "",
             f"`{study['candidate']}` refitted on the first {study['fit_tokens']} tokens of each fit sequence, with "
             f"RoPE stripped (the pipeline's map) and with keys as cached, rotated in and out (the ablation), then "
             f"used on {study['prompts']} eval prompts of each length (stage `length`). Perplexity ratio to the "
             f"oracle and agreement over all continuation positions; NLL sign test: prompts where the stripped map's "
             f"NLL is lower / higher, exact two-sided p.", ""]
    lines += md_table(
        ["Prompt tokens", "x fit length", "PPL ratio stripped", "PPL ratio rotated", "Agreement stripped",
         "Agreement rotated", "Agreement Δ [95% CI]", "NLL lower / higher", "Sign test p"],
        [[r["length"], f"{r['ratio_to_fit']:g}", f"{r['stripped_ppl_ratio']:.3f}", f"{r['rotated_ppl_ratio']:.3f}",
          _pct(r["stripped_agreement"]), _pct(r["rotated_agreement"]),
          _interval(r["agreement_diff"]["diff"], r["agreement_diff"]["low"], r["agreement_diff"]["high"]),
          f"{r['nll_sign_test']['lower']} / {r['nll_sign_test']['higher']}", f"{r['nll_sign_test']['p']:.3g}"]
         for r in study["rows"]])
    lines += ["", "Task accuracy (`acc`) of both maps on the eval task items, by the length of the item's context "
              "in multiples of the fit length; Δ = stripped − rotated, paired bootstrap 95% interval, exact McNemar p.",
              ""]
    lines += md_table(["Context length", "Items", "Stripped", "Rotated", "Δ [95% CI]", "McNemar p"],
                      [[b["bin"], b["items"], _pct(b["stripped_acc"]), _pct(b["rotated_acc"]),
                        _interval(b["diff"]["diff"], b["diff"]["low"], b["diff"]["high"]), f"{b['mcnemar_p']:.3g}"]
                       for b in study["task_bins"]])
    lines += ["", "![Perplexity ratio against prompt length](report/length.png)", ""]
    return lines


def candidate_reading(study: dict) -> str:
    """Which proxy tracks retention best, and which candidates are on the fronts, from the numbers."""
    # in the direction each proxy should point: higher R², cosine and agreement, lower KL
    strength = {name: c["rho"] * (-1 if name == "mean_kl" else 1) for name, c in study["proxies"].items()
                if c["rho"] == c["rho"]}
    parts = []
    if strength and max(strength.values()) <= 0:
        parts.append("No cheap figure ranks the candidates the way retention does.")
    elif strength:
        best = max(strength, key=strength.get)
        c = study["proxies"][best]
        settled = c["low"] > 0 or c["high"] < 0
        parts.append(f"Across {c['n']} candidates the {PROXIES[best]} tracks retention most closely (ρ "
                     f"{c['rho']:+.2f}, 95% interval [{c['low']:+.2f}, {c['high']:+.2f}]"
                     f"{'' if settled else ', which includes 0'}).")
    for key, where in (("pareto_measured", "against the measured speedup"),
                       ("pareto_at_pair", f"against the FLOP bound at {study['bound_pair']}")):
        names = [name for name, row in study["rows"].items() if row[key]]
        if names:
            parts.append(f"On the front {where}: {_and(names)}.")
    return " ".join(parts)


def _measured(gate: dict) -> str:
    return "—" if gate.get("measured") is None else f"{gate['measured']:.3f}"


def _verdict(gate: dict) -> str:
    if gate.get("milestone"):
        return "reached" if gate["passed"] else "not reached"
    return "PASS" if gate["passed"] else "FAIL"


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


GATE_NAMES = {"agreement_milestone": "agreement milestone (next-token top-1)"}
RIVALS = {"source": "the source model alone", "zero": "the zero-cache null", "shuffled": "the shuffled-cache null",
          "direct": "direct injection"}


def reading(report: dict, context: dict) -> str:
    """One paragraph generated from the numbers: what is and is not established at this sample size."""
    v, c, g, mapped = report["variants"], report["comparisons"], report["gates"], report["selected"]
    e = v[mapped]
    width = 100 * (e["retention_high"] - e["retention_low"]) / 2
    parts = [f"The selected map ({context.get('selected_name', mapped)}) retains {_pct(e['retention'])} of the "
             f"oracle's above-chance task accuracy (95% interval ±{width:.0f} points at {e['hellaswag_n']} + "
             f"{e['piqa_n']} items), with perplexity {e['ppl_ratio']:.2f}x the oracle's and next-token agreement "
             f"{_pct(e['next_token_top1'])}."]
    if e["gap_closure"] is not None:
        parts.append(f"Measured from the source model alone instead of chance, it closes {_pct(e['gap_closure'])} "
                     f"[{_pct(e['gap_closure_low'])}, {_pct(e['gap_closure_high'])}] of the gap between the source "
                     f"and the oracle.")
    established, open_ = [], []
    for other in ("source", "zero", "shuffled", "direct"):
        key = f"{mapped}_minus_{other}"
        if key in c:
            (established if c[key]["tasks_low"] > 0 else open_).append(RIVALS[other])
    if established:
        parts.append(f"It beats {_and(established)} on task accuracy with intervals that exclude 0.")
    if open_:
        parts.append(f"It is not shown to beat {_and(open_)}: those intervals include 0, so at this sample size the "
                     f"difference may be noise (or, for the source alone, the handoff adds nothing the source did "
                     f"not read).")
    ni = c[f"oracle_minus_{mapped}"]
    parts.append(f"Non-inferiority to the oracle within {g['noninferiority']['threshold']} is "
                 f"{'established' if g['noninferiority']['passed'] else 'not established'} "
                 f"(upper bound of the oracle's lead {100 * ni['tasks_high']:.1f} points).")
    for name in [n for n in c if n.startswith("k1_minus_k")]:
        k = c[name]
        parts.append(f"k=1 vs k={name[len('k1_minus_k'):]}: {100 * k['tasks_diff']:+.1f} points on tasks "
                     f"[{100 * k['tasks_low']:+.1f}, {100 * k['tasks_high']:+.1f}]"
                     f"{'' if k['tasks_low'] > 0 or k['tasks_high'] < 0 else ', not distinguishable here'}.")
    failed = [name for name, gate in g.items() if not gate["passed"] and not gate.get("milestone")]
    parts.append("All gates pass." if not failed else f"Gates not passed: {', '.join(failed)}.")
    return " ".join(parts)


def figures(report: dict, prompts: dict, folder: Path) -> dict[str, pd.DataFrame]:
    """PNG figures for report.md and the tables behind them (for `dvc plots`)."""
    order = _order(report["variants"])
    retention_table = pd.DataFrame([{"variant": n, "retention": report["variants"][n]["retention"],
                                     "low": report["variants"][n]["retention_low"],
                                     "high": report["variants"][n]["retention_high"]}
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
    tables = {"retention": retention_table, "agreement_by_position": position_table}
    if report.get("candidates"):
        tables["frontier"] = frontier_figure(report["candidates"], folder / "frontier.png")
    if report.get("calibration"):
        tables["calibration"] = calibration_figure(report["calibration"], folder / "calibration.png")
    if report.get("length"):
        tables["length"] = length_figure(report["length"], folder / "length.png")
    plt.close("all")
    return tables


def calibration_figure(study: dict, path: Path) -> pd.DataFrame:
    """Retention and gap closure of each candidate against calibration tokens, with intervals."""
    table = pd.DataFrame(study["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, figure in ((axes[0], "retention"), (axes[1], "gap_closure")):
        for name, group in table.groupby("candidate", sort=False):
            y = group[figure].to_numpy()
            errors = np.vstack([y - group[f"{figure}_low"].to_numpy(), group[f"{figure}_high"].to_numpy() - y])
            ax.errorbar(group.tokens, y, yerr=np.nan_to_num(errors), marker="o", capsize=3, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("calibration tokens")
        ax.set_ylabel(figure.replace("_", " ") + " (eval part)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    _save_figure(fig, path)
    return table


def length_figure(study: dict, path: Path) -> pd.DataFrame:
    """Perplexity ratio to the oracle and agreement of both maps against prompt length."""
    table = pd.DataFrame([{"length": r["length"], "keys": space, "ppl_ratio": r[f"{space}_ppl_ratio"],
                           "agreement": r[f"{space}_agreement"]} for r in study["rows"]
                          for space in ("stripped", "rotated")])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
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
    _save_figure(fig, path)
    return table


def frontier_figure(study: dict, path: Path) -> pd.DataFrame:
    """Gap closure of every candidate against the measured speedup and against the FLOP bound at the real
    pair's shapes, fronts ringed; returns the table behind it."""
    table = pd.DataFrame([{"candidate": name, **{key: row[key] for key in (
        "family", "k", "retention", "gap_closure", "speedup", "bound_at_pair", "mapper_bytes", "pareto_measured",
        "pareto_at_pair")}} for name, row in study["rows"].items()])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
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
    _save_figure(fig, path)
    return table


def _save_figure(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def environment(models: ModelsParams) -> dict:
    revisions = {name: (read_pointer(f"models/{name}") or {}).get("revision", "local") for name in ("source", "target")}
    return {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "lm-eval": lm_eval.__version__, "platform": platform.platform(), "device": models.device, "dtype": models.dtype,
        "threads": torch.get_num_threads(), "source revision": revisions["source"],
        "target revision": revisions["target"],
    }


def optional_sections() -> list[str]:
    """Controls, selection and latency summaries, when their metrics exist."""
    lines = []
    controls = Path("metrics/controls.json")
    if controls.is_file():
        rows = []
        for name, entry in json.loads(controls.read_text()).items():
            figures_ = ", ".join(f"{k} {val:.3g}" if isinstance(val, float) else f"{k} {val}"
                                 for k, val in entry.items() if k != "passed" and not isinstance(val, dict))
            rows.append([name.replace("_", " "), "yes" if entry["passed"] else "NO", figures_])
        lines += ["## Controls", "", *md_table(["Control", "Passed", "Figure"], rows), ""]
    latency = Path("metrics/latency.json")
    if latency.is_file():
        data = json.loads(latency.read_text())
        lengths = sorted({int(k[3:].split("_")[0]) for k in data
                          if k.startswith("len") and k[3:].split("_")[0].isdigit()})
        rows = []
        for n in lengths:
            get = lambda key: data.get(f"len{n}_{key}", float("nan"))  # noqa: E731
            rows.append([n, f"{get('target_ms'):.2f}", f"{get('handoff_ms'):.2f}", f"{get('speedup'):.2f}x",
                         f"{get('bound'):.2f}x", _pct(get("fraction_of_bound"))])
        lines += ["## Latency (time to first token)", ""]
        lines += md_table(["Prompt tokens", "Target prefill ms", "Handoff ms", "Speedup", "FLOP bound",
                           "Fraction of bound"], rows)
        lines += ["", "![TTFT against prompt length](plots/latency.png)", ""]
    return lines


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.report", __doc__, argv)
    params = load_section(ReportParams, "report")
    models = load_section(ModelsParams, "models")
    variants = ["oracle", *read_key("evaluate.baselines"), *read_key("evaluate.mapped")]
    metrics, items, prompts, skipped = load_variants(variants)
    controls = json.loads(Path("metrics/controls.json").read_text())
    report = build(params, metrics, items, prompts, controls)
    report["skipped"] = skipped
    select = json.loads(Path("metrics/select.json").read_text()) if Path("metrics/select.json").is_file() else {}
    if CANDIDATES.is_file() and "source" in items:  # the gap closure of each candidate needs the source's items
        report["candidates"] = candidate_study(
            params, items, {path.stem: pd.read_parquet(path) for path in sorted(CANDIDATE_ITEMS.glob("*.parquet"))},
            json.loads(CANDIDATES.read_text()), json.loads(Path("metrics/fit.json").read_text()), select)
    points = {int(path.stem): json.loads(path.read_text()) for path in sorted(CALIBRATION.glob("*.json"))}
    points = {size: point for size, point in points.items() if size in read_key("calibration.sizes")}
    if points and "source" in items:
        point_items = {size: {path.stem: pd.read_parquet(path)
                              for path in sorted((CALIBRATION_ITEMS / str(size)).glob("*.parquet"))}
                       for size in points}
        report["calibration"] = calibration_study(params, items, points, point_items)
    if LENGTH.is_file():
        report["length"] = length_study(params, json.loads(LENGTH.read_text()), {
            (path.stem.split("_L")[0], int(path.stem.split("_L")[1])): pd.read_parquet(path)
            for path in sorted(LENGTH_ROWS.glob("*_L*.parquet"))},
            {space: pd.read_parquet(LENGTH_ROWS / f"{space}_tasks.parquet") for space in ("stripped", "rotated")})
    tables = figures(report, prompts, Path("report"))
    Path("plots").mkdir(exist_ok=True)
    for name, table in tables.items():
        with atomic_path(Path("plots") / f"{name}.csv") as tmp:
            table.to_csv(tmp, index=False)
    context = {"profile": read_key("profile"), "data_kind": read_key("data.kind"), "source": models.source,
               "target": models.target,
               "dtype": models.dtype, "device": models.device, "environment": environment(models),
               "selected_name": select.get("selected", params.mapped_variant), "sections": optional_sections()}
    write_json_atomic("metrics/report.json", report)
    with atomic_dir(HEADLINE) as staging:
        for variant, row in headline(report).items():
            write_json_atomic(staging / f"{variant}.json", row)
    write_bytes_atomic("report.md", markdown(report, context).encode())
    print(markdown(report, context))


if __name__ == "__main__":
    entry(main)
