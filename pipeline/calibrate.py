"""Stage `calibrate`: one point of the calibration curve, a few candidates fitted on the first n pool sequences.

    python -m pipeline.calibrate N

How much calibration does a map need, and from how much on does a larger k pay off? Each of `calibration.candidates`
is fitted (or distilled) on the n sequences and scored on the eval tasks. The pool continues the fit split's own draw,
so the point at n = data.fit_sequences reuses the main fit's caches and maps (a refit would make the same bytes).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.kv.mapnames import MapName
from pipeline.kv.pair import Pair
from pipeline.measure.evaluation import evaluate
from pipeline.measure.settings import MeasureParams
from pipeline.schema.calibrate import CalibrationParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, read_table, require_controls_passed
from pipeline.store.cli import entry, parser, run_stage
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, load_section
from pipeline.store.ranks import stage_ranks

pd = lazy("pandas")


def is_fit_split(first: pd.DataFrame) -> bool:
    """Whether a point's sequences are the fit split itself (n = data.fit_sequences, the pool unchanged)."""
    return first.reset_index(drop=True).equals(read_table(paths.split("fit")))


def fit_maps(first: pd.DataFrame, fits: list[str], work: Path) -> tuple[Path, Path, Path, dict]:
    """The caches, data and maps folders of a point's fits, and fit's figures of them: the main fit's own when
    `first` is the fit split, else extracted and fitted in `work` (a failure stops this stage)."""
    if is_fit_split(first):
        return paths.CACHES, paths.DATA, paths.MAPPERS, json.loads(paths.FIT.read_text())
    (work / "data").mkdir(parents=True)
    first.to_parquet(work / "data" / "fit.parquet", index=False)
    shutil.copyfile(paths.split("select"), work / "data" / "select.parquet")
    for model in ("source", "target"):
        run_stage("pipeline.extract", model, "--data", str(work / "data"), "--out", str(work / paths.CACHES / model))
    run_stage("pipeline.fit", "--caches", str(work / paths.CACHES), "--out", str(work / "mappers"), "--only",
              ",".join(fits))
    return (work / paths.CACHES, work / "data", work / "mappers",
            json.loads(paths.fit_metrics(work / "mappers").read_text()))


def run(size: int, params: CalibrationParams, models: ModelsParams, device: str, items: int | None = None) -> dict:
    require_controls_passed()
    pool = read_table(paths.CALIBRATION_POOL)
    if size > len(pool):
        raise ParamError(f"calibration.sizes: {size} sequences, but {paths.CALIBRATION_POOL} holds {len(pool)}; raise "
                         f"data.calibration_sequences or drop the size")
    first = pool.head(size)
    metrics: dict[str, float | int | str] = {"sequences": size,
                                             "tokens": int(sum(len(ids) for ids in first.token_ids))}
    with atomic_dir(paths.calibration_items(size)) as staging:
        work = staging / ".work"
        starts = {name: str(MapName.parse(name).start) if MapName.parse(name).distilled else None
                  for name in params.candidates}
        fits = list(dict.fromkeys(start or name for name, start in starts.items()))
        caches, data, mappers, fitted = fit_maps(first, fits, work)
        distilled, distilled_maps = [start for start in starts.values() if start], work / "distilled"
        if distilled:  # from the maps just fitted, on the same n sequences
            run_stage("pipeline.distill", "--only", ",".join(distilled), "--caches", str(caches), "--data", str(data),
                      "--mappers", str(mappers), "--out", str(distilled_maps))
        pair = Pair.load(models, device)
        for name in tqdm(params.candidates, desc=f"calibration n={size}", unit="candidate"):
            mapper = paths.distilled_map(name, distilled_maps) if starts[name] else paths.fitted_map(name, mappers)
            router = pair.router(mode="mapped", mapper=mapper, batch_size=params.batch_size)
            evaluation = evaluate(router, tasks=pair.eval_tasks, tokenizer=pair.target_tokenizer, task_limit=items)
            evaluation.write_rows(items=paths.candidate_items(name, staging))
            fit = fitted["maps"][starts[name] or name]  # a distilled map: its start's family, k and size
            if not starts[name]:  # the held-out R² is the fitted map's own
                metrics.update({f"maps/{name}/r2_{kind}_select": fit[f"r2_{kind}_select"]
                                for kind in ("keys", "values")})
            metrics.update({f"maps/{name}/{key}": fit[key] for key in ("family", "k")})
            metrics[f"maps/{name}/distilled"] = bool(starts[name])
            metrics[f"maps/{name}/params_per_token"] = round(fit["params"] / metrics["tokens"], 6)
            metrics[f"maps/{name}/tasks"] = evaluation.figures()["tasks"]
        if work.exists():  # none when the maps were the main fit's
            shutil.rmtree(work)
    return metrics


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.calibrate", __doc__)
    cli.add_argument("size", type=int, help="fit sequences of this point (an entry of calibration.sizes)")
    size = cli.parse_args(argv).size
    params, models = load_section(CalibrationParams, "calibration"), load_section(ModelsParams, "models")
    machine = load_section(MachineParams, "machine")
    with stage_ranks(machine.torch_device, threads=machine.threads) as stage:
        stage.write_metrics(paths.calibration_point(size), run(size, params, models, stage.device,
                                                                 load_section(MeasureParams, "measure").study_items))


if __name__ == "__main__":
    entry(main)
