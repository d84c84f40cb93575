"""The latency study's section (stage latency): TTFT of the handoff against the target's prefill, part by part."""
from __future__ import annotations

from pipeline.measure.compare import FIRST_STEP_PARTS
from pipeline.studies.format import md_table, pct


def shown(latency: dict) -> dict:
    """A part's ratio of time to multiply-adds share within 1.5 runs at about its multiply-adds' cost."""
    rows, parts = [], []
    for n, row in sorted((int(n), row) for n, row in latency["by_length"].items()):
        get = {key: row.get(key, float("nan"))
               for key in ("target_ms", "handoff_ms", "speedup", "bound", "fraction_of_bound")}
        rows.append([n, f"{get['target_ms']:.2f}", f"{get['handoff_ms']:.2f}", f"{get['speedup']:.2f}x",
                     f"{get['bound']:.2f}x", pct(get["fraction_of_bound"])])
        for name, each in row.get("parts", {}).items():
            for part, f in sorted(each["parts"].items(), key=lambda item: FIRST_STEP_PARTS.index(item[0])):
                ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}" + (" (over 1.5)" if f["ratio"] > 1.5 else "")
                parts.append([n, name, part, f"{f['ms']:.2f}", f"{100 * f['time_share']:.2f}%",
                              f"{100 * f['macs_share']:.2f}%", ratio])
    return {"table": md_table(["Prompt tokens", "Target prefill ms", "Handoff ms", "Speedup", "FLOP bound",
                               "Fraction of bound"], rows),
            "parts": md_table(["Prompt tokens", "Handoff", "Part", "ms", "Time share", "MAC share", "Ratio"], parts)
            if parts else None}
