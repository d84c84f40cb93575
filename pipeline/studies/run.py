"""What every study reads, the `Run` (the variants' evaluation and other files), and the `Study` it fills in."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pipeline.measure.retention import closure_interval
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
    """What the variants' evaluation left (a variant the pair's contract skipped: only its reason), and the files and
    params the studies read."""
    metrics: dict
    items: dict[str, pd.DataFrame]
    prompts: dict[str, pd.DataFrame]
    skipped: dict[str, str]
    controls: dict
    select: dict
    latency: dict | None
    pair: tuple[str, str]
    calibration_sizes: list[int]  # params calibration.sizes (read by report.py, where dvc.yaml declares it)
    operating_lengths: list[int]  # params operating.lengths, likewise

    @classmethod
    def load(cls, names: list[str], calibration_sizes: list[int], operating_lengths: list[int]) -> Run:
        """The declared variants' results (another profile may leave other files in metrics/eval)."""
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
    """Each side of the pair that ran, by its pointer under models/ (models/<side>: the trained tiny pair)."""
    names = []
    for side in ("source", "target"):
        pointer = read_pointer(f"{models}/{side}") or {"kind": "trained"}
        named = {"hub": pointer.get("id"), "local": paths.shown(pointer.get("path", "")),
                 "random": f"shape:{pointer.get('shape')}", "self": self_name(pointer.get("layers", 0))}
        names.append(named.get(pointer["kind"], f"{models}/{side}"))
    return names[0], names[1]


def quality(items: dict[str, pd.DataFrame], name: str, params: ReportParams, measure: MeasureParams,
            suffix: str = "") -> dict:
    figures = {"retention": closure_interval(items, name, params.retention_metric, *measure.bootstrap),
               "gap_closure": closure_interval(items, name, params.retention_metric, *measure.bootstrap,
                                             from_source=True)}
    return {f"{key}{suffix}{end}": figures[key][field] for key in figures
            for end, field in (("", key), ("_low", "low"), ("_high", "high"))}


@runtime_checkable
class Study(Protocol):
    """A study module: `load(run)` its inputs (None when its stage did not run: left out), `compute` its key of
    metrics/report.json, `shown(study)` what its template (`templates/<module>.md.j2`) reads beside the study (tables,
    what its words choose between), `figure(study, folder)` its PNGs and their tables."""

    def load(self, run: Run) -> Any | None: ...

    def compute(self, params: ReportParams, measure: MeasureParams, inputs: Any) -> dict: ...

    def shown(self, study: dict) -> dict: ...

    def figure(self, study: dict, folder: Path) -> dict[str, pd.DataFrame]: ...


@runtime_checkable
class Joining(Study, Protocol):
    """A study completed with another's result (the repair study's frontier spans the candidates study's maps too):
    `JOINS` is the other's key in `STUDIES`; `join` gets both once all are computed (the other's None if not run)."""

    JOINS: str

    def join(self, study: dict, other: dict | None) -> None: ...
