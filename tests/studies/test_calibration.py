"""The calibration study (`studies.calibration`): the size from which the larger k pays off, and the section
without a calibration size."""
import numpy as np
from helpers import measure_params
from helpers.report import _fake_variant, report_params

from pipeline.studies import calibration, render


def test_the_calibration_curve_names_the_size_from_which_the_larger_k_pays_off():
    rng = np.random.default_rng(5)
    items = {name: _fake_variant(rng, *acc, 1.0)[1] for name, acc in {"oracle": (0.9, 0.95),
                                                                     "source": (0.6, 0.7)}.items()}
    # k=3 overfits the small calibration sets and overtakes k=1 from 50 sequences on
    accuracy = {10: {"linear_k1_lam0.001": (0.75, 0.8), "linear_k3_lam0.001": (0.5, 0.6)},
                25: {"linear_k1_lam0.001": (0.75, 0.8), "linear_k3_lam0.001": (0.75, 0.8)},
                50: {"linear_k1_lam0.001": (0.75, 0.8), "linear_k3_lam0.001": (0.88, 0.93)},
                100: {"linear_k1_lam0.001": (0.76, 0.81), "linear_k3_lam0.001": (0.9, 0.95)}}
    point_items = {size: {name: _fake_variant(rng, *acc, 1.0)[1] for name, acc in by_name.items()}
                   for size, by_name in accuracy.items()}
    points = {size: {"tokens": 100 * size, "maps": {name: {"family": "linear", "k": int(name[8]),
                                                           "params_per_token": 1.0 / size} for name in accuracy[size]}}
              for size in accuracy}
    study = calibration.compute(report_params(), measure_params(bootstrap_iters=300),
                                calibration.Inputs(items, points, point_items))
    assert len(study["rows"]) == 8 and study["rows"][0]["tokens"] == 1000
    by_size = study["larger_k"]["by_size"]
    assert by_size[10]["high"] < 0 and by_size[100]["low"] > 0
    assert study["larger_k"]["larger"] == "linear_k3_lam0.001" and study["larger_k_pays_from"] == 50
    assert "pays off (interval above 0 at this size and every larger one) from 50 sequences on" in \
        render.section("calibration", study)


def test_without_a_calibration_size_the_section_says_so_and_the_declared_plot_files_are_written(tmp_path):
    study = calibration.compute(report_params(), measure_params(), calibration.Inputs({}, {}, {}))
    assert study["rows"] == [] and study["larger_k"] is None and study["larger_k_pays_from"] is None
    assert "No calibration point in this profile" in render.section("calibration", study)
    tables = calibration.figure(study, tmp_path)  # dvc.yaml declares plots/calibration.csv and the figure
    assert list(tables["calibration"].columns) == calibration.COLUMNS and tables["calibration"].empty
    assert (tmp_path / "calibration.png").stat().st_size > 0
