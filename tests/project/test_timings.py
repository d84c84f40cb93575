"""tools/timings.py reads per-stage times from dvc's streamed output and the slowest tests from pytest's; no clone."""
from __future__ import annotations

from timings import slowest_tests, stage_times, summary

DVC_OUTPUT = [
    (1.2, "Stage 'check_params' didn't change, skipping"),
    (1.3, "Running stage 'prepare_data':"),
    (1.3, "> python -m pipeline.prepare_data"),
    (7.9, "Running stage 'pin_models':"),
    (12.6, "Stage 'prepare_models' didn't change, skipping"),
    (12.6, "Stage 'score_models' didn't change, skipping"),
    (12.7, "Running stage 'calibrate@10':"),
    (31.0, '  "wall_s": 10.44,'),
    (33.3, "Updating lock file 'dvc.lock'"),
    (33.9, "Running stage 'extract@target':"),
    (54.0, "Updating lock file 'dvc.lock'"),
]


def test_a_stage_runs_from_its_running_line_to_the_next_line_naming_a_stage_or_the_end():
    assert stage_times(DVC_OUTPUT, end=60.0) == [
        ("prepare_data", 6.6), ("pin_models", 4.7), ("calibrate@10", 21.2), ("extract@target", 26.1)]


def test_a_run_where_every_stage_is_skipped_has_no_stage_times():
    assert stage_times([(0.5, "Stage 'fit' didn't change, skipping")], end=1.0) == []


def test_the_durations_section_and_the_closing_line_are_read_from_pytest_output():
    lines = [
        "........................................................ [ 98%]",
        "============================= slowest 3 durations =============================",
        "95.12s call     tests/test_pipeline.py::test_tiny_pipeline_runs_end_to_end",
        "4.00s setup    tests/test_fit.py::test_fit[k1]",
        "0.51s teardown tests/test_pair.py::test_x",
        "=============== 536 passed, 3 deselected in 721.10s (0:12:01) ===============",
    ]
    assert slowest_tests(lines) == [(95.12, "call", "tests/test_pipeline.py::test_tiny_pipeline_runs_end_to_end"),
                                    (4.0, "setup", "tests/test_fit.py::test_fit[k1]"),
                                    (0.51, "teardown", "tests/test_pair.py::test_x")]
    assert summary(lines) == "536 passed, 3 deselected in 721.10s (0:12:01)"
