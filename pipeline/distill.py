"""Stage `distill`: fitted maps trained further through the frozen target (`pipeline.fitting.distill`).

    python -m pipeline.distill [--only NAME[,NAME...]] [--mappers DIR] [--caches DIR] [--data DIR] [--out DIR]

Each map named in `distill.start` starts a `<start>+kl` map of its family and size, trained on the fit split's
sequences cut at each of `distill.context_lengths`; both models enter as their stored caches (the target's oracle
prefills no prefix again), the target also through its steps. Bit-identical on one CPU device, whatever
`distill.processes`, so the determinism control can refit the selected map (`--only NAME ...`).
"""
from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.fitting.distill import TIMED_PARTS, Clock, distill
from pipeline.fitting.distill_rows import CacheRows, Splits, with_oracles
from pipeline.kv.mapnames import MapName
from pipeline.kv.mapper import load_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.schema.distill import DistillParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, atomic_path, read_table
from pipeline.store.cachefiles import open_split, read_manifest
from pipeline.store.cli import entry, parser
from pipeline.store.inputs import out_folder
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, load_section
from pipeline.store.ranks import ONE_PROCESS, Ranks, stage_ranks


def cache_groups(caches: Path, data_folder: Path, split: str, params: DistillParams) -> list[CacheRows]:
    """One row group per context length, cut from the split's stored caches (source and target) and its token ids."""
    data = read_table(data_folder / f"{split}.parquet")
    shards, geometries = {}, {}
    for side in ("source", "target"):
        geometry = read_manifest(caches / side)["geometry"]
        shards[side] = open_split(caches / side, split)
        geometries[side] = (geometry["layers"], geometry["kv_heads"], geometry["head_dim"])
        if [doc for shard in shards[side] for doc in shard.doc_ids] != data.doc_id.tolist():
            raise ValueError(f"{caches / side / split} and {data_folder / split}.parquet hold different sequences: "
                             "re-extract the caches (dvc repro extract)")
    groups = [CacheRows(shards, data.token_ids.tolist(), n, params.horizon, geometries)
              for n in params.context_lengths]
    if not any(len(group) for group in groups):
        raise ParamError(f"distill.context_lengths: no {split} sequence has {min(params.context_lengths)} + "
                         f"distill.horizon tokens; lower them")
    return [group for group in groups if len(group)]


def write_curve(path: Path, history: list[dict]) -> None:
    fields = ["epoch", "fit_loss", "fit_kl", "fit_kv", "select_kl", "select_agreement"]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows({key: round(value, 6) if isinstance(value, float) else value
                          for key, value in row.items()} for row in history)


def run(params: DistillParams, models: ModelsParams, device: str, names: list[str], inputs: dict[str, Path],
        ranks: Ranks = ONE_PROCESS) -> tuple[dict, dict] | None:
    """The metrics and, per name, (distilled map, per-epoch history) on rank 0 (the others None)."""
    oracle = Pair.load(models, ranks.device(device), source=False).router(mode="oracle").handoff
    oracle.decoder.requires_grad_(False).eval()  # frozen: the gradient reaches the map alone
    groups = {split: cache_groups(inputs["caches"], inputs["data"], split, params)
              for split in ("select", "fit")}
    # the oracles kept up to distill.oracle_gib, the select rows' first (they are scored after every epoch)
    kept_clock = Clock()
    with kept_clock.timed("oracle", oracle.device):
        kept = with_oracles(groups["select"] + groups["fit"], oracle, params.batch_size, params.oracle_gib * 2**30)
    splits = Splits(fit=kept[len(groups["select"]):], select=kept[: len(groups["select"])])
    share = {}  # this rank's maps: name -> (map, history, seconds, seconds per part)
    for index in tqdm(ranks.share(len(names)), desc="distill", unit="map", disable=not ranks.main):
        started, name, clock = time.perf_counter(), names[index], Clock()
        start = load_mapper(paths.fitted_map(name, inputs["mappers"]))
        label = name if ranks.size == 1 else f"[{ranks.rank}] {name}"
        mapper, history = distill(start, splits, oracle, params, clock, label)
        share[name] = (mapper, history, time.perf_counter() - started, dict(clock.seconds))
    shares = ranks.gather((share, dict(kept_clock.seconds)))
    if not ranks.main:
        return None
    done = {name: result for share, _ in shares for name, result in share.items()}
    metrics: dict = {"rows_fit": sum(map(len, splits.fit)), "rows_select": sum(map(len, splits.select))}
    # the stage's time per part, summed over ranks: each rank keeps its own oracles, then distils its maps
    metrics.update({f"cost_s/{part}": round(sum(kept[part] for _, kept in shares)
                                            + sum(done[name][3][part] for name in names), 1) for part in TIMED_PARTS})
    for name in names:
        mapper, history, seconds, parts = done[name]
        figures = {**map_figures(name, mapper.distilled, history), "seconds": round(seconds, 1),
                   **{f"cost_s/{part}": round(parts[part], 1) for part in TIMED_PARTS}}
        metrics.update({f"maps/{MapName.parse(name).distilled_name}/{key}": value for key, value in figures.items()})
    return metrics, {name: done[name][:2] for name in names}


def kl_figure(value: float) -> float | None:
    """None for a diverged (NaN or infinite) KL, which JSON cannot hold."""
    return round(value, 5) if math.isfinite(value) else None


def map_figures(name: str, facts: dict, history: list[dict]) -> dict:
    """One distilled map's untimed figures; `probes/<rate>/<kv_weight>` is a probe's select KL (a probe that names
    no weight used the one weight declared, the facts' own)."""
    best = history[facts["best_epoch"]]
    return {"start": name, "lr": facts["lr"], "kv_weight": facts["kv_weight"], "probe_steps": facts["probe_steps"],
            **{f"probes/{row['lr']:g}/{row.get('kv_weight', facts['kv_weight']):g}": kl_figure(row["select_kl"])
               for row in facts["probes"]},
            "select_kl_start": kl_figure(history[0]["select_kl"]), "select_kl": kl_figure(best["select_kl"]),
            "select_agreement_start": round(history[0]["select_agreement"], 4),
            "select_agreement": round(best["select_agreement"], 4), "best_epoch": facts["best_epoch"],
            "epochs": facts["epochs"], "steps": facts["steps"],
            "select_kl_curve": [kl_figure(row["select_kl"]) for row in history]}


def write(distilled: dict, out: Path, curves: Path) -> None:
    for name, (mapper, history) in distilled.items():
        stem = str(MapName.parse(name).distilled_name)
        save_mapper(mapper, paths.distilled_map(stem, out))
        write_curve(paths.distill_curve(stem, curves), history)


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.distill", __doc__)
    cli.add_argument("--only", metavar="NAME[,NAME...]", type=lambda text: text.split(","),
                     help="distil only these start maps (the determinism control's refit)")
    cli.add_argument("--mappers", type=Path, help="read the start maps from this folder (default models/mappers)")
    cli.add_argument("--caches", type=Path, help="read both models' caches from this folder (default caches)")
    cli.add_argument("--data", type=Path, help="read <split>.parquet from this folder (default data)")
    cli.add_argument("--out", type=Path, help="write maps, curves and metrics here instead")
    argv = sys.argv[1:] if argv is None else argv
    args = cli.parse_args(argv)
    out_folder(args.out, "--out")  # refused now, not after the distillation
    params, models = load_section(DistillParams, "distill"), load_section(ModelsParams, "models")
    machine = load_section(MachineParams, "machine")
    names = args.only or params.start
    mappers = args.mappers or paths.MAPPERS
    missing = [name for name in names if not paths.fitted_map(name, mappers).is_file()]
    if missing:
        raise ParamError(f"distill.start: no fitted map {mappers / missing[0]}.safetensors; name one of fit's "
                         "candidates (models/mappers) or rerun fit")
    inputs = {"mappers": mappers, "caches": args.caches or paths.CACHES, "data": args.data or paths.DATA}
    processes = min(params.processes, len(names))  # a process without a map would only wait
    with stage_ranks(machine.torch_device, processes, "pipeline.distill", argv, machine.threads) as stage:
        found = run(params, models, stage.device, names, inputs, stage.ranks)
        metrics = {}  # rank 0's, written below; the other ranks' maps went to it
        if found is not None:
            metrics, distilled = found
            if args.out:  # a refit beside the pipeline's outputs: maps, curves and metrics in one folder
                args.out.mkdir(parents=True, exist_ok=True)
                write(distilled, args.out, args.out)
            else:
                with atomic_dir(paths.DISTILLED) as out, atomic_dir(paths.DISTILL_CURVES) as curves:
                    write(distilled, out, curves)
        stage.write_metrics(args.out / "distill.json" if args.out else paths.DISTILL, metrics)


if __name__ == "__main__":
    entry(main)
