"""Stage `length`: a map fitted at one length, used on prompts 2x and 4x longer, with and without RoPE stripping.

    python -m pipeline.length

One candidate of the fit grid (`length.candidate`) is refitted on sequences cut to `length.fit_tokens`, twice: on keys
with RoPE stripped, as the pipeline does, and on keys as cached (`extract --keep-rope`). Both maps are scored against
the oracle on eval prompts of each of `length.prompt_lengths`, and on the task items, each with its context's length in
target tokens (HellaSwag's `ctx`, PIQA's `goal`) so the report can compare the two maps within bins of that length.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.kv.pair import Pair
from pipeline.measure.evaluation import OracleStore, evaluate
from pipeline.measure.settings import MeasureParams
from pipeline.schema.length import LengthParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, read_table, require_controls_passed
from pipeline.store.cli import entry, no_arguments, run_stage
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, load_section
from pipeline.store.ranks import stage_ranks

KEY_SPACE_FLAGS = {"stripped": [], "rotated": ["--keep-rope"]}  # the maps compared, and extract's flag for each
CONTEXT = {"hellaswag": "ctx", "piqa": "goal"}  # the field of a task item that the context is made of


def scratch_data(fit_tokens: int, folder: Path) -> None:
    folder.mkdir(parents=True)
    for split in ("fit", "select"):
        frame = read_table(paths.split(split))
        frame["token_ids"] = [list(ids)[:fit_tokens] for ids in frame.token_ids]
        frame.to_parquet(folder / f"{split}.parquet", index=False)


def long_sequences(params: LengthParams) -> list[list[int]]:
    needed = max(params.prompt_lengths) + params.continuation
    found = [list(ids) for ids in read_table(paths.EVAL_PROMPTS).token_ids if len(ids) >= needed]
    if len(found) < 2:
        raise ParamError(f"length.prompt_lengths: only {len(found)} eval sequences hold {needed} tokens (the longest "
                         f"prompt and its continuation); shorten the prompts or the continuation")
    return found


def run(params: LengthParams, models: ModelsParams, device: str, study_items: int | None = None) -> dict:
    require_controls_passed()
    sequences = long_sequences(params)
    metrics: dict[str, float | int | str] = {"fit_tokens": params.fit_tokens, "candidate": params.candidate,
                                             "prompts": len(sequences)}
    with atomic_dir(paths.LENGTH_ROWS) as staging:
        work = staging / ".work"
        scratch_data(params.fit_tokens, work / "data")
        for space, flag in KEY_SPACE_FLAGS.items():  # the other stages' own commands (a failure stops this one)
            for model in ("source", "target"):
                run_stage("pipeline.extract", model, "--data", str(work / "data"), "--out", str(work / space / model),
                          *flag)
            run_stage("pipeline.fit", "--caches", str(work / space), "--out", str(work / space / "maps"), "--only",
                      params.candidate)
        pair = Pair.load(models, device)
        routers = {space: pair.router(mode="mapped", mapper=work / space / "maps" / f"{params.candidate}.safetensors",
                                      batch_size=params.batch_size)
                   for space in KEY_SPACE_FLAGS}
        oracle = pair.router(mode="oracle", batch_size=params.batch_size)
        for length in tqdm(params.prompt_lengths, desc="lengths", unit="length"):
            prompts = [(ids[:length], ids[length : length + params.continuation]) for ids in sequences]
            reference = evaluate(oracle, prompts, store=OracleStore(params.top_k, params.horizon), progress=False)
            metrics[f"oracle/by_length/{length}"] = reference.figures()
            for space, router in routers.items():
                evaluation = evaluate(router, prompts, reference.oracle, progress=False)
                evaluation.write_rows(paths.length_rows(space, length, staging))
                metrics[f"{space}/by_length/{length}"] = evaluation.figures(oracle=reference)
        tokens = {task: [len(pair.target_tokenizer.encode(text, add_special_tokens=False))
                         for text in read_table(path)[CONTEXT[task]]] for task, path in pair.eval_tasks.items()}
        for space, router in routers.items():
            evaluation = evaluate(router, tasks=pair.eval_tasks, tokenizer=pair.target_tokenizer,
                                  task_limit=study_items)
            items = evaluation.item_rows
            items["context_tokens"] = [tokens[task][item] for task, item in zip(items.task, items["item"])]
            items.to_parquet(paths.length_tasks(space, staging), index=False)
            metrics[f"{space}/tasks"] = evaluation.figures()["tasks"]
        shutil.rmtree(work)
    return metrics


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.length", __doc__, argv)
    params, models = load_section(LengthParams, "length"), load_section(ModelsParams, "models")
    machine = load_section(MachineParams, "machine")
    with stage_ranks(machine.torch_device, threads=machine.threads) as stage:
        stage.write_metrics(paths.LENGTH, run(params, models, stage.device,
                                              load_section(MeasureParams, "measure").study_items))


if __name__ == "__main__":
    entry(main)
