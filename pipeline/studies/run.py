"""What every study reads and what every study is: the `Run` (the variants' evaluation and the files each study
beside them starts from) and the `Study` protocol a study module fills in.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pipeline.measure.settings import MeasureParams
from pipeline.store import paths
from pipeline.store.artifacts import read_table
from pipeline.store.lazy import lazy
from pipeline.store.models import read_pointer
from pipeline.store.truncated import self_name
from pipeline.studies.settings import ReportParams

pd = lazy("pandas")



@dataclass
class Run:
    """What the variants' evaluation left: per variant its metrics, per-item and per-prompt rows (those the
    pair's contract skipped only with their reason), the controls, the selection, the latency study (None
    when it did not run), the pair that ran (`pair_names`) and the other stages' params the studies read."""
    metrics: dict
    items: dict[str, pd.DataFrame]
    prompts: dict[str, pd.DataFrame]
    skipped: dict[str, str]
    controls: dict
    select: dict
    latency: dict | None
    pair: tuple[str, str]
    calibration_sizes: list[int]  # params calibration.sizes (report.py reads it: dvc.yaml declares it there)
    operating_lengths: list[int]  # params operating.lengths, likewise

    @classmethod
    def load(cls, names: list[str], calibration_sizes: list[int], operating_lengths: list[int]) -> Run:
        """The declared variants' results (not whatever else metrics/eval holds: a profile with other k candidates
        leaves other files there) and the files every study beside them reads."""
        metrics, items, prompts, skipped = {}, {}, {}, {}
        for variant in names:
            metrics[variant] = json.loads(paths.variant_metrics(variant).read_text())
            if "skipped" in metrics[variant]:  # undefined for this pair (kv.contract): reported, not compared
                skipped[variant] = metrics.pop(variant)["skipped"]
                continue
            items[variant] = read_table(paths.variant_rows("items", paths.variant_folder(variant)))
            prompts[variant] = read_table(paths.variant_rows("prompts", paths.variant_folder(variant)))
        if "oracle" not in metrics:
            raise FileNotFoundError(f"{paths.variant_metrics('oracle')} not found: the report needs the oracle's "
                                    "evaluation")
        return cls(metrics, items, prompts, skipped, controls=json.loads(paths.CONTROLS.read_text()),
                   select=json.loads(paths.SELECT.read_text()) if paths.SELECT.is_file() else {},
                   latency=json.loads(paths.LATENCY.read_text()) if paths.LATENCY.is_file() else None,
                   pair=pair_names(), calibration_sizes=calibration_sizes, operating_lengths=operating_lengths)


def pair_names(models: str = "models") -> tuple[str, str]:
    """What each side of the pair that ran is: its hub id, its local folder, `shape:<name>` for random weights
    of a stored shape, `self:<n>` for the target's own first n layers, or the prepared folder itself (the trained
    tiny pair), from the pointers under models/."""
    names = []
    for side in ("source", "target"):
        pointer = read_pointer(f"{models}/{side}") or {"kind": "trained"}
        named = {"hub": pointer.get("id"), "local": paths.shown(pointer.get("path", "")),
                 "random": f"shape:{pointer.get('shape')}", "self": self_name(pointer.get("layers", 0))}
        names.append(named.get(pointer["kind"], f"{models}/{side}"))
    return names[0], names[1]


@runtime_checkable
class Study(Protocol):
    """A study module: four functions. `load(run)` reads its input files (None when its stage did not run, and the
    report leaves it out); `compute(params, measure, inputs)` its statistics, its key of metrics/report.json
    (`measure`: the `measure` section, how it resamples); then, from that result, `lines(study)` its Markdown section
    and `figure(study, folder)` its PNG figures and the tables behind them (for `dvc plots`)."""

    def load(self, run: Run) -> Any | None: ...

    def compute(self, params: ReportParams, measure: MeasureParams, inputs: Any) -> dict: ...

    def lines(self, study: dict) -> list[str]: ...

    def figure(self, study: dict, folder: Path) -> dict[str, pd.DataFrame]: ...


@runtime_checkable
class Joining(Study, Protocol):
    """A study whose result is completed with another study's (the repair study's frontier runs over the candidates
    study's maps too): `JOINS` is that study's key in `STUDIES`; `join` gets this study's result and the other's (None
    when the other did not run), after every study is computed."""

    JOINS: str

    def join(self, study: dict, other: dict | None) -> None: ...
