"""Stage `check_params`: the whole of params.yaml validated before any other stage does any work.

    python -m pipeline.check_params

Every section is parsed by the Params class of the stage that reads it (the one place this stage looks
into other stages: their parameter classes), and a top-level key no stage reads is refused, so a typo
anywhere (`evaluate.horizn`) or an empty list (`fit.lambdas: []`) stops `dvc repro` and `dvc exp run` here,
naming the key, before anything is computed. Writes metrics/params_check.json, the names of the sections
checked: its bytes do not depend on the values, so `prepare_data`, which depends on it, and everything after
it rerun only for the parameters they read.
"""
from __future__ import annotations

import json

from pipeline.calibrate import CalibrationParams
from pipeline.candidates import CandidatesParams
from pipeline.controls import ControlsParams, ToleranceParams
from pipeline.evaluate import EvaluateParams
from pipeline.extract import ExtractParams
from pipeline.fit import FitParams
from pipeline.latency import LatencyParams
from pipeline.length import LengthParams
from pipeline.prepare_data import DataParams
from pipeline.prepare_models import TrainParams
from pipeline.report import ReportParams
from pipeline.select import SelectParams
from pipeline.store.artifacts import write_json_atomic
from pipeline.store.cli import entry, no_arguments
from pipeline.store.models import ModelsParams
from pipeline.store.params import PARAMS_FILE, ParamError, parse, read_params

OUTPUT = "metrics/params_check.json"
SECTIONS = {"data": DataParams, "models": ModelsParams, "train": TrainParams, "extract": ExtractParams,
            "fit": FitParams, "select": SelectParams, "controls": ControlsParams, "evaluate": EvaluateParams,
            "candidates": CandidatesParams, "calibration": CalibrationParams, "report": ReportParams,
            "length": LengthParams, "latency": LatencyParams, "tolerances": ToleranceParams}
PLAIN = {"profile": str}  # top-level values that are not sections


def check(params: dict) -> list[str]:
    """Validate every section; returns the names checked. Raises ParamError naming the first bad key."""
    for key in params:
        if key not in SECTIONS and key not in PLAIN:
            raise ParamError(f"{key}: unknown section of {PARAMS_FILE} (known: {', '.join([*PLAIN, *SECTIONS])})")
    for key, kind in PLAIN.items():
        if not isinstance(params.get(key), kind):
            raise ParamError(f"{key}: expected a {kind.__name__}, got {params.get(key)!r}")
    for name, cls in SECTIONS.items():
        if name not in params:
            raise ParamError(f"{name}: missing section of {PARAMS_FILE}")
        parse(cls, params[name], name)
    return [*PLAIN, *SECTIONS]


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.check_params", __doc__, argv)
    result = {"valid": True, "checked": check(read_params())}
    write_json_atomic(OUTPUT, result)
    print(json.dumps(result))


if __name__ == "__main__":
    entry(main)
