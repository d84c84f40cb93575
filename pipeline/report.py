"""Stage `report`: normalized retention, gap closure, paired statistics, acceptance criteria, the V0-style report.

Load every study's inputs, compute each study, write: metrics/report.json (the variants' keys, then one per study that
ran), metrics/headline/<variant>.json (the few figures `dvc metrics show/diff` compare), report.md, PNG figures under
report/ and their tables under plots/ for `dvc plots`. A study is a module of `pipeline/studies/` (inputs, statistics,
figure) and its section's template (`studies.render`), joining with one line in `studies.registry.STUDIES`.
"""
from __future__ import annotations

import json
import os
import platform
from importlib.metadata import version
from pathlib import Path

from pipeline.kv.modes import BASELINES
from pipeline.measure.settings import MeasureParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, atomic_path, write_bytes_atomic, write_json_atomic
from pipeline.store.cli import entry, no_arguments
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams, read_pointer
from pipeline.store.params import load_section, load_value
from pipeline.studies import confident, render, variants
from pipeline.studies.registry import STUDIES
from pipeline.studies.run import Joining, Run
from pipeline.studies.settings import ReportParams

plt = lazy("matplotlib.pyplot")
pd = lazy("pandas")


def load(variant_names: list[str], calibration_sizes: list[int], operating_lengths: list[int]) -> tuple[Run, dict]:
    """The variants' run and each study's inputs (a study that did not run is left out), all read before anything
    is computed or written."""
    run = Run.load(variant_names, calibration_sizes, operating_lengths)
    inputs = {key: study.load(run) for key, study in STUDIES.items()}
    return run, {key: given for key, given in inputs.items() if given is not None}


def compute(params: ReportParams, measure: MeasureParams, run: Run, inputs: dict) -> dict:
    """metrics/report.json: the variants' study, then one key per study that ran."""
    report = variants.compute(params, measure, run)
    report.update({key: STUDIES[key].compute(params, measure, given) for key, given in inputs.items()})
    for key, study in STUDIES.items():  # once every study is computed: a join reads another's result
        if key in report and isinstance(study, Joining):
            study.join(report[key], report.get(study.JOINS))
    return report


def figures(report: dict, run: Run, folder: Path) -> dict[str, pd.DataFrame]:
    """Every study's PNG figures under `folder`, and the tables behind them (for `dvc plots`)."""
    tables = variants.figure(report, run, folder)
    for key, study in STUDIES.items():
        if key in report:
            tables.update(study.figure(report[key], folder))
    plt.close("all")
    return tables


def run_record(dtypes: dict, variant_names: list[str], sizes: list[int], lengths: list[int]) -> dict:
    """report.json's `run`: the models' dtype (`auto`'s figures beside it) and the run's wall time, the sum of each
    stage's own `wall_s` (its process from start to outputs written; not DVC's hashing, the conversion or the data
    preparation; a stage without a model, or not run, has none)."""
    timed = [paths.MODEL_SCORES, *(paths.METRICS / f"extract_{side}.json" for side in ("source", "target")),
             paths.FIT, paths.DISTILL, paths.SELECT, paths.CONTROLS_USAGE,
             *(paths.variant_metrics(name) for name in variant_names), *map(paths.operating_metrics, lengths),
             *map(paths.calibration_point, sizes), paths.CANDIDATES, paths.REPAIR_METRICS,
             paths.LENGTH, paths.LATENCY]
    seconds = {}
    for path in filter(Path.is_file, timed):
        figures = json.loads(path.read_text())
        if isinstance(figures.get("wall_s"), (int, float)):
            seconds[path.relative_to(paths.METRICS).as_posix()] = figures["wall_s"]
    return {"dtype": dtypes["models.dtype"], "dtype_auto": dtypes["auto"], "wall_s": round(sum(seconds.values()), 1),
            "stages_wall_s": seconds}


def dtype_phrase(dtypes: dict) -> str:
    auto = dtypes["auto"]
    if not auto or auto["device"] != "cpu":
        return dtypes["models.dtype"] + (" (`auto` on a GPU)" if auto else "")
    return (f"{auto['choice']} (`auto`: a matmul took {auto['bfloat16_ms']:g} ms in bfloat16 against "
            f"{auto['float32_ms']:g} ms in float32 on this CPU)")


def environment(models: ModelsParams, machine: MachineParams) -> dict:
    revisions = {name: (read_pointer(paths.model(name)) or {}).get("revision", "local")
                 for name in ("source", "target")}
    return {"python": platform.python_version(), "torch": version("torch"), "transformers": version("transformers"),
            "lm-eval": version("lm_eval"), "platform": platform.platform(), "device": machine.device,
            "dtype": models.dtype, "cpus": os.cpu_count(), "source revision": revisions["source"],
            "target revision": revisions["target"]}


def write(report: dict, tables: dict[str, pd.DataFrame], text: str) -> None:
    paths.PLOTS.mkdir(exist_ok=True)
    for name, table in tables.items():
        with atomic_path(paths.PLOTS / f"{name}.csv") as tmp:
            table.to_csv(tmp, index=False)
    write_json_atomic(paths.REPORT, report)
    with atomic_dir(paths.HEADLINE) as staging:
        for variant, row in variants.headline(report).items():
            sure = confident.headline(report.get("confident", {}), variant)  # beside V0's columns
            write_json_atomic(staging / f"{variant}.json", {**row, **sure})
    write_bytes_atomic(paths.REPORT_MD, text.encode())


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.report", __doc__, argv)
    params = load_section(ReportParams, "report")
    models, machine = load_section(ModelsParams, "models"), load_section(MachineParams, "machine")
    measure = load_section(MeasureParams, "measure")
    # a key or two of other stages' sections, as values (dvc.yaml declares only those keys; check_params validated
    # them through their classes, whose rules, the repair grammar among them, the report does not depend on)
    names = [*BASELINES, *load_value(dict, "evaluate.mapped")]
    sizes, data_kind = load_value(list, "calibration.sizes"), load_value(str, "data.kind")
    lengths = load_value(list, "operating.lengths")
    run, inputs = load(names, sizes, lengths)
    dtypes = json.loads(paths.DTYPE_CHOICE.read_text())
    report = compute(params, measure, run, inputs) | {"run": run_record(dtypes, names, sizes, lengths)}
    tables = figures(report, run, paths.FIGURES)
    context = {"profile": load_value(str, "profile"), "data_kind": data_kind, "source": models.source,
               "target": models.target, "dtype": dtype_phrase(dtypes), "device": machine.device, "pair": run.pair,
               "environment": environment(models, machine),
               "selected_name": run.select.get("selected", params.mapped_variant)}
    text = render.report(report, run, context)
    write(report, tables, text)
    print(text)


if __name__ == "__main__":
    entry(main)
