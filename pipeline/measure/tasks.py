"""lm-eval's own HellaSwag and PIQA task definitions (`include`d), overriding only where the documents come from."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from pipeline.store.lazy import lazy

lm_eval = lazy("lm_eval")

BUILTIN = {"hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml"}  # lm-eval's own definitions
CHANCE = {"hellaswag": 0.25, "piqa": 0.5}  # accuracy of a uniform guess: 4 and 2 choices


def write_task_config(folder: str | Path, task: str, name: str, data_file: str | Path) -> Path:
    """`<folder>/<name>.yaml`: lm-eval's `task` reading `data_file` (.jsonl/.json/.parquet), for TaskManager's
    include_path. No absolute path is written, so two clones write the same bytes: the data file relative to the
    working directory, lm-eval's definition relative to `folder` (the .venv is in the clone)."""
    data_file = Path(data_file).resolve()
    if not data_file.is_file():
        raise FileNotFoundError(f"task data file {data_file} not found (task {task})")
    if data_file.is_relative_to(Path.cwd()):
        data_file = data_file.relative_to(Path.cwd())
    kind = "parquet" if data_file.suffix == ".parquet" else "json"
    config = {
        "task": name,
        "include": os.path.relpath(Path(lm_eval.__file__).parent / "tasks" / BUILTIN[task], Path(folder).absolute()),
        "tag": [],
        "dataset_path": kind,
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"validation": str(data_file)}},
        "training_split": None,
        "validation_split": "validation",
        "test_split": None,
    }
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
