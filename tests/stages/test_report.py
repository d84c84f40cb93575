"""Stage report: a variant the contract skipped is named with its reason and not compared; the run record."""
import json

import numpy as np
from helpers import measure_params
from helpers.report import _fake_variant, report_params

from pipeline.report import dtype_phrase, run_record
from pipeline.studies import render, variants
from pipeline.studies.run import Run


def test_a_variant_the_contract_skipped_is_named_with_its_reason_and_not_compared(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics/eval").mkdir(parents=True)
    for name, args in {"oracle": (0.9, 0.95, 1.0), "selected": (0.85, 0.9, 0.9)}.items():
        metrics, items, prompt_rows = _fake_variant(rng, *args)
        (tmp_path / "eval" / name).mkdir(parents=True)
        items.to_parquet(tmp_path / "eval" / name / "items.parquet")
        prompt_rows.to_parquet(tmp_path / "eval" / name / "prompts.parquet")
        (tmp_path / "metrics/eval" / f"{name}.json").write_text(json.dumps(metrics))
    reason = "direct injection needs equal KV geometry, but ..."
    (tmp_path / "metrics/eval/direct.json").write_text(json.dumps({"skipped": reason}))
    (tmp_path / "metrics/controls.json").write_text(json.dumps({"compatibility": {"passed": True}}))
    run = Run.load(["oracle", "direct", "selected"], [], [])
    assert run.skipped == {"direct": reason} and set(run.metrics) == {"oracle", "selected"}
    report = variants.compute(report_params(), measure_params(), run)
    context = {"profile": "llama-shapes", "data_kind": "generated", "source": "s", "target": "t",
               "dtype": "bfloat16", "device": "cpu", "environment": {}, "pair": run.pair, "selected_name": "selected"}
    text = render.report(report, run, context)
    assert f"Not run for this pair: Direct source-cache injection — {reason}." in text
    assert "| Direct source-cache injection |" not in text


def test_the_run_record_sums_the_wall_time_of_this_runs_stages_only_and_names_its_dtype(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics/eval/operating").mkdir(parents=True)
    times = {"fit.json": 10.5, "eval/oracle.json": 20.0, "eval/operating/1024.json": 30.25, "latency.json": 4.0}
    for name, seconds in times.items():
        (tmp_path / "metrics" / name).write_text(json.dumps({"wall_s": seconds, "other": 1.0}))
    (tmp_path / "metrics/eval/mapped_k3.json").write_text(json.dumps({"wall_s": 99.0}))  # a variant of another run
    (tmp_path / "metrics/eval/direct.json").write_text(json.dumps({"skipped": "unequal geometry"}))  # no time
    auto = {"choice": "float32", "device": "cpu", "threads": 2, "float32_ms": 6.7, "bfloat16_ms": 227.5}
    record = run_record({"models.dtype": "float32", "latency.dtype": "float32", "auto": auto}, ["oracle", "direct"],
                        [], [1024])
    assert record == {"dtype": "float32", "dtype_auto": auto, "wall_s": 64.8, "stages_wall_s": times}
    assert dtype_phrase({"models.dtype": "float32", "auto": auto}) == (
        "float32 (`auto`: a matmul took 227.5 ms in bfloat16 against 6.7 ms in float32 on this CPU)")
    assert dtype_phrase({"models.dtype": "bfloat16", "auto": None}) == "bfloat16"
    assert list(record["stages_wall_s"]) == ["fit.json", "eval/oracle.json", "eval/operating/1024.json",
                                             "latency.json"]  # in the recipe's order
