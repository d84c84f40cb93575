"""Stage report: a variant the contract skipped is named with its reason and not compared."""
import json

import numpy as np
from helpers import measure_params
from helpers.report import _fake_variant, report_params

from pipeline.report import markdown
from pipeline.studies import variants
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
    text = markdown(report, run, context)
    assert f"Not run for this pair: Direct source-cache injection — {reason}." in text
    assert "| Direct source-cache injection |" not in text
