"""lm-eval's stored results are portable: no absolute working-directory paths, no memory addresses."""
from pathlib import Path

from pipeline.measure.taskeval import portable


def process_docs(dataset):
    return dataset


def test_stored_results_carry_no_machine_or_run_specific_text(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    files = {"validation": str(tmp_path / "data" / "p.parquet")}
    raw = {"configs": {"kvh_piqa": {"dataset_kwargs": {"data_files": files},
                                    "fewshot_config": {"process_docs": process_docs}, "num_fewshot": 0},
                       "kvh_hellaswag": {"n": (1, 2.5, None, True),
                                         "config_source": "eval/.z.ab1.tmp/.tasks-x/h.yaml"}}}
    clean = portable(raw, {"eval/.z.ab1.tmp/.tasks-x": "tasks"})
    assert clean["configs"]["kvh_piqa"]["dataset_kwargs"]["data_files"]["validation"] == "data/p.parquet"
    assert clean["configs"]["kvh_piqa"]["fewshot_config"]["process_docs"] == "<function process_docs>"
    assert clean["configs"]["kvh_hellaswag"]["n"] == [1, 2.5, None, True]
    assert clean["configs"]["kvh_hellaswag"]["config_source"] == "tasks/h.yaml"
    assert str(Path.cwd()) not in str(clean)
