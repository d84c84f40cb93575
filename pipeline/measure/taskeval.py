"""Task accuracy through lm-eval's own HellaSwag / PIQA definitions on the pipeline's data files: lm-eval's aggregates,
and one row per item for paired statistics (with per choice the token ids lm-eval encoded, before any truncation)."""
from __future__ import annotations

import functools
import json
import os
import re
import tempfile
from pathlib import Path

from pipeline.measure.tasks import write_task_config
from pipeline.store.artifacts import read_table
from pipeline.store.lazy import lazy

pd = lazy("pandas")
lm_eval = lazy("lm_eval")
lm_eval_metrics = lazy("lm_eval.api.metrics")
lm_eval_tasks = lazy("lm_eval.tasks")
lm_eval_utils = lazy("lm_eval.utils")
collect_env = lazy("torch.utils.collect_env")

PREFIX = "kvh_"
NUM_FEWSHOT = 0  # the protocol scores the tasks zero-shot (the study protocol's "Tasks"), as V0 did
# > 0 asks lm-eval for each metric's stderr; acc and acc_norm are means, whose stderr lm-eval computes in
# closed form, so the count itself changes no figure: a switch, not a parameter
STDERR_BOOTSTRAP = 1000
ADDRESS = re.compile(r" at 0x[0-9a-f]+>")


def portable(value, folders: dict[str, str] | None = None):
    """`value` without what differs between machines: the working directory, `folders` renamed, memory addresses."""
    if isinstance(value, dict):
        return {k: portable(v, folders) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v, folders) for v in value]
    if isinstance(value, str):
        value = value.replace(str(Path.cwd()) + os.sep, "")
        for folder, name in (folders or {}).items():
            value = value.replace(folder, name)
        return ADDRESS.sub(">", value)
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return portable(str(value), folders)


@functools.cache
def compiled_template(template: str):
    return lm_eval_utils.env.from_string(template)


def render_template(template: str, doc: dict) -> str:
    """`lm_eval.utils.apply_template` with the compiled template kept."""
    return compiled_template(template).render(**doc)


def without_repeated_work() -> None:
    """Two costs lm-eval 0.4.13 pays every evaluation, paid once per process, same results: a Jinja compilation per
    document (lm-evaluation-harness issue #1286: 0.6 s per tiny evaluation) and torch's environment report (0.25 s)."""
    lm_eval_utils.apply_template = render_template
    if not hasattr(collect_env.get_pretty_env_info, "cache_info"):  # the machine does not change in one process
        collect_env.get_pretty_env_info = functools.cache(collect_env.get_pretty_env_info)


def evaluate_tasks(lm, files: dict[str, Path], raw_to: Path | None = None, limit: int | None = None
                   ) -> tuple[dict | None, pd.DataFrame | None]:
    """({task: metrics}, per-item frame) of `lm` zero-shot on each task's first `limit` items; (None, None) on a rank
    other than 0. The task configs live beside `raw_to` (lm-eval's raw output) so a killed run leaves no temp files."""
    scratch = None if raw_to is None else raw_to.parent
    without_repeated_work()
    with tempfile.TemporaryDirectory(prefix=".tasks-", dir=scratch) as folder:
        for task, path in files.items():
            write_task_config(folder, task, PREFIX + task, path)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=[PREFIX + task for task in files],
            # our task files only: lm-eval's own catalogue (~14,700 tasks) costs 4.3 s per evaluation to index
            task_manager=lm_eval_tasks.TaskManager(include_path=folder, include_defaults=False),
            num_fewshot=NUM_FEWSHOT,
            log_samples=True,
            cache_requests=False,
            bootstrap_iters=STDERR_BOOTSTRAP,
            limit=limit,
        )
    if out is None:  # a rank other than 0: lm-eval gathered this rank's samples there
        return None, None
    samples = {task: sorted(out["samples"][PREFIX + task], key=lambda sample: sample["doc_id"]) for task in files}
    if raw_to is not None:
        write_raw(out, samples, raw_to, {folder: "tasks"})
    summary, rows = {}, []
    tokens = lm.ledger.tokens  # (task, doc id, choice) -> (context ids, continuation ids), every rank's
    for task, path in files.items():
        # lm-eval's own aggregation (mean and its closed-form stderr), on the items in document order: the
        # same figures whichever process scored which item
        summary[task] = {}
        for metric in ("acc", "acc_norm"):
            values = [float(sample[metric]) for sample in samples[task]]
            summary[task][metric] = lm_eval_metrics.mean(values)
            summary[task][f"{metric}_stderr"] = lm_eval_metrics.mean_stderr(values)
        summary[task]["n"] = len(samples[task])
        items = read_table(path)
        for sample in samples[task]:
            item = items.iloc[sample["doc_id"]]
            scored = [tokens[PREFIX + task, sample["doc_id"], choice] for choice in range(len(sample["arguments"]))]
            rows.append({
                "task": task,
                "item": int(sample["doc_id"]),
                "doc_id": str(item.get("doc_id", sample["doc_id"])),
                "kind": item.get("kind") if isinstance(item.get("kind"), str) else None,
                "acc": float(sample["acc"]),
                "acc_norm": float(sample["acc_norm"]),
                "loglikelihoods": [float(r[0][0]) for r in sample["resps"]],
                "context": str(sample["arguments"][0][0]),
                "choices": [str(argument[1]) for argument in sample["arguments"]],
                "context_ids": [context for context, _ in scored],
                "continuation_ids": [continuation for _, continuation in scored],
            })
    return summary, pd.DataFrame(rows)


def write_raw(out: dict, samples: dict[str, list[dict]], raw_to: Path, folders: dict[str, str]) -> None:
    raw_to.mkdir(parents=True, exist_ok=True)
    stored = {key: out[key] for key in ("results", "configs", "versions", "n-shot", "n-samples") if key in out}
    if "kv_transfer" in out.get("config", {}):
        stored["config"] = {"kv_transfer": out["config"]["kv_transfer"]}
    (raw_to / "lm_eval_results.json").write_text(json.dumps(portable(stored, folders), indent=2))
    for task, rows in samples.items():
        with open(raw_to / f"lm_eval_samples_{task}.jsonl", "w") as handle:
            for sample in rows:
                handle.write(json.dumps(portable(sample, folders)) + "\n")
