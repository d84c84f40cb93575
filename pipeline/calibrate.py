"""Stage `calibrate`: one point of the calibration curve, a few candidates fitted on the first n pool sequences.

    python -m pipeline.calibrate N

How much calibration does a map need, and from how much on does a larger k pay off? V0 fitted on 50 x 256
tokens, the closed-form study on 500 x 1024. `dvc.yaml` runs this stage once per `calibration.sizes` entry
(`calibrate@<n>`), so adding a size runs only that size's stage (and the report).

For n: the first n sequences of `data/calibration.parquet` (the fit split's own draw continued, so n =
`data.fit_sequences` is the main fit's data) become the fit split of a scratch folder beside the select
split; the `extract` stage's own command extracts both models' caches there (once, untimed) and the `fit`
stage's own narrow refit fits exactly `calibration.candidates` (fit's names: e.g. linear k=1, linear k=max and
the MLP, with fit's settings); then each map is evaluated on the eval tasks as `evaluate` scores a mapped
variant. Writes eval/calibration/<n>/<candidate>.parquet (per item) and metrics/calibration/<n>.json
(sequences, tokens, each candidate's held-out R² and task accuracies); the report draws the curve.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import load_mapper
from pipeline.lm_eval_model import KVTransferLM
from pipeline.measure.taskeval import evaluate_tasks
from pipeline.store.artifacts import atomic_dir, require_controls_passed, write_json_atomic
from pipeline.store.cli import entry, parser
from pipeline.store.devices import StageUsage
from pipeline.store.models import ModelsParams, load_model, load_tokenizer
from pipeline.store.params import ParamError, load_section, spec
from pipeline.store.splits import TASKS

POOL = Path("data/calibration.parquet")


@dataclass
class CalibrationParams:
    sizes: list[int] = spec(min=2, nonempty=True)  # fit sequences per point; one calibrate@<n> stage each
    candidates: list[str] = spec(nonempty=True)  # names of fit's candidates (linear_k1_lam0.001, mlp_k3, ...)
    batch_size: int = spec(positive=True)  # task requests per forward
    threads: int = spec(positive=True)


def scratch_split(pool: pd.DataFrame, size: int, folder: Path) -> int:
    """Write the first `size` pool sequences as folder/fit.parquet beside a copy of the select split; returns
    their tokens."""
    folder.mkdir(parents=True)
    first = pool.head(size)
    first.to_parquet(folder / "fit.parquet", index=False)
    shutil.copyfile("data/select.parquet", folder / "select.parquet")
    return int(sum(len(ids) for ids in first.token_ids))


def run(size: int, params: CalibrationParams, models: ModelsParams) -> dict:
    require_controls_passed()
    pool = pd.read_parquet(POOL)
    if size > len(pool):
        raise ParamError(f"calibration.sizes: {size} sequences, but {POOL} holds {len(pool)}; raise "
                         f"data.calibration_sequences or drop the size")
    torch.set_num_threads(params.threads)
    usage = StageUsage(models.torch_device)
    metrics: dict[str, float | int | str] = {"sequences": size}
    with atomic_dir(Path("eval/calibration") / str(size)) as staging:
        work = staging / ".work"
        metrics["tokens"] = scratch_split(pool, size, work / "data")
        # the other stages' own commands, in their narrow forms (a failure stops this stage)
        for model in ("source", "target"):
            subprocess.run([sys.executable, "-m", "pipeline.extract", model, "--data", str(work / "data"),
                            "--out", str(work / "caches" / model)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, "-m", "pipeline.fit", "--caches", str(work / "caches"), "--out",
                        str(work / "mappers"), "--only", ",".join(params.candidates)], check=True,
                       stdout=subprocess.DEVNULL)
        fitted = json.loads((work / "mappers" / "fit.json").read_text())
        device = models.torch_device
        load = lambda name: load_model(f"models/{name}", dtype=models.dtype, device=device,  # noqa: E731
                                        device_map=models.device_map)
        target, source = load("target"), load("source")
        tokenizers = (load_tokenizer("models/source"), load_tokenizer("models/target"))
        files = {task: Path(f"data/{task}_eval.parquet") for task in TASKS}
        for name in tqdm(params.candidates, desc=f"calibration n={size}", unit="candidate"):
            mapper = load_mapper(work / "mappers" / f"{name}.safetensors", device=device)
            handoff = Handoff(target, source, "mapped", mapper, tokenizers=tokenizers)
            lm = KVTransferLM.from_handoff(handoff, tokenizers[1], batch_size=params.batch_size)
            tasks, items = evaluate_tasks(lm, files)
            items.to_parquet(staging / f"{name}.parquet", index=False)
            metrics.update({f"{name}/r2_{kind}_select": fitted[f"{name}/r2_{kind}_select"]
                            for kind in ("keys", "values")})
            metrics[f"{name}/params_per_token"] = round(fitted[f"{name}/params"] / metrics["tokens"], 6)
            for task, result in tasks.items():
                metrics.update({f"{name}/{task}_{metric}": round(result[metric], 6) for metric in ("acc", "acc_norm")})
        shutil.rmtree(work)
    metrics.update(usage.figures())
    return metrics


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.calibrate", __doc__)
    cli.add_argument("size", type=int, help="fit sequences of this point (an entry of calibration.sizes)")
    size = cli.parse_args(sys.argv[1:] if argv is None else argv).size
    metrics = run(size, load_section(CalibrationParams, "calibration"), load_section(ModelsParams, "models"))
    write_json_atomic(Path("metrics/calibration") / f"{size}.json", metrics)
    print(json.dumps({k: v for k, v in metrics.items() if "/" not in k}, indent=2))


if __name__ == "__main__":
    entry(main)
