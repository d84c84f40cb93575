"""The latency study's section of the report: time to first token of the handoff against the target's prefill at
each length (`metrics/latency.json`, stage latency), and each handoff's first step part by part."""
from __future__ import annotations

from pipeline.studies.format import md_table, pct

PARTS_SHOWN = ("prefill", "scores", "map", "repair", "sparse", "step")  # a first step's parts in the order they run


def lines(latency: dict) -> list[str]:
    """The summary table, the figure and the parts table."""
    rows = []
    for n, row in sorted((int(n), row) for n, row in latency["by_length"].items()):
        get = {key: row.get(key, float("nan"))
               for key in ("target_ms", "handoff_ms", "speedup", "bound", "fraction_of_bound")}
        rows.append([n, f"{get['target_ms']:.2f}", f"{get['handoff_ms']:.2f}", f"{get['speedup']:.2f}x",
                     f"{get['bound']:.2f}x", pct(get["fraction_of_bound"])])
    out = ["## Latency (time to first token)", ""]
    out += md_table(["Prompt tokens", "Target prefill ms", "Handoff ms", "Speedup", "FLOP bound",
                     "Fraction of bound"], rows)
    out += ["", "![TTFT against prompt length](plots/latency.png)", "", *parts(latency), ""]
    return out


def parts(latency: dict) -> list[str]:
    """Each handoff's first step part by part, at each length: its time and multiply-adds as shares of the target's
    prefill, and their ratio (a part within 1.5x runs at about its multiply-adds' cost)."""
    rows = []
    for n, row in sorted((int(n), row) for n, row in latency["by_length"].items()):
        for name, each in row.get("parts", {}).items():
            for part, f in sorted(each["parts"].items(), key=lambda item: PARTS_SHOWN.index(item[0])):
                ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}" + (" (over 1.5)" if f["ratio"] > 1.5 else "")
                rows.append([n, name, part, f"{f['ms']:.2f}", f"{100 * f['time_share']:.2f}%",
                             f"{100 * f['macs_share']:.2f}%", ratio])
    if not rows:
        return []
    return ["Each handoff's parts (`prefill`: the source's; `scores`: its look-ahead scores; `sparse`: the target's "
            "prefill of the kept tokens; `step`: the target's step on the last token), each as a share of the "
            "target prefill's time and of its multiply-adds:", "",
            *md_table(["Prompt tokens", "Handoff", "Part", "ms", "Time share", "MAC share", "Ratio"], rows)]
