"""lm-eval's stored results are portable (no absolute working-directory paths, no memory addresses); what lm-eval
repeats at every evaluation is done once per process, with the same results."""
from pathlib import Path

import lm_eval.utils
import pandas as pd
from helpers import hellaswag_rows, piqa_rows
from torch.utils import collect_env

from pipeline.kv.pair import Pair
from pipeline.kv.router import Router
from pipeline.lm_eval_model import KVTransferLM
from pipeline.measure import taskeval
from pipeline.measure.taskeval import evaluate_tasks, portable


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


def test_evaluations_compile_each_of_lm_evals_templates_once_and_render_what_lm_eval_renders(tiny_pair, tmp_path,
                                                                                            monkeypatch):
    for module, name in ((lm_eval.utils, "apply_template"), (collect_env, "get_pretty_env_info")):
        monkeypatch.setattr(module, name, getattr(module, name))  # lm-eval's and torch's own, back after the test
    own_render, compiles, rendered, reports = lm_eval.utils.apply_template, [], [], []
    taskeval.compiled_template.cache_clear()
    from_string = lm_eval.utils.env.from_string
    monkeypatch.setattr(lm_eval.utils.env, "from_string", lambda source: compiles.append(source) or from_string(source))
    render = taskeval.render_template

    def recorded(template, doc):
        rendered.append((template, doc, render(template, doc)))
        return rendered[-1][2]

    monkeypatch.setattr(taskeval, "render_template", recorded)
    report = collect_env.get_pretty_env_info
    monkeypatch.setattr(collect_env, "get_pretty_env_info", lambda: reports.append(1) or report())
    files = {"hellaswag": tmp_path / "h.parquet", "piqa": tmp_path / "p.parquet"}
    pd.DataFrame(hellaswag_rows(5)).to_parquet(files["hellaswag"])
    pd.DataFrame(piqa_rows(5)).to_parquet(files["piqa"])
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), "float32", "cpu")
    lm = KVTransferLM(Router(pair.handoff("oracle"), batch_size=4), pair.target_tokenizer)
    first, _ = evaluate_tasks(lm, files)
    second, _ = evaluate_tasks(lm, files)
    assert first == second
    assert len(rendered) > 4 * len(compiles) > 0  # rendered per document, compiled once per template and process
    assert sorted(compiles) == sorted(set(compiles)) == sorted({template for template, _, _ in rendered})
    assert all(text == own_render(template, doc) for template, doc, text in rendered)
    assert len(reports) == 1  # torch's environment report once in this process, however many evaluations
