"""Stage `fit`: per-layer maps from the source's content-space cache to the target's, one file per candidate.

    python -m pipeline.fit [--caches FOLDER] [--out FOLDER] [--only CANDIDATE[,CANDIDATE...]]

Single-layer probes rank the source layers for every target layer (a map reads the k best); per target layer every
ridge candidate is solved from shared moments and every MLP candidate trained, then each is written and timed against
the source's prefill. A family the pair's contract leaves undefined is skipped, its reason in fit.json.
"""
from __future__ import annotations

import csv
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.fitting.families import MlpSettings, Parts, R2Table, fit_mlp_unit, fit_ridge_layer, mlp_candidates
from pipeline.fitting.probes import holdout_sequences, probe_r2, ranking, stored_bytes
from pipeline.kv.contract import pair_contract
from pipeline.kv.families import Geometry
from pipeline.kv.mapnames import MapName
from pipeline.kv.mapper import Mapper, save_mapper
from pipeline.measure.timing import prefill_seconds, time_against_prefill
from pipeline.schema.fit import FitParams
from pipeline.store import paths
from pipeline.store.artifacts import ArtifactError, atomic_path, read_table
from pipeline.store.cachefiles import KINDS, first_sequence, paired_split, read_manifest
from pipeline.store.cli import entry, parser
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.inputs import out_folder
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams, load_config, load_model
from pipeline.store.params import ParamError, load_section
from pipeline.store.ranks import ONE_PROCESS, Ranks, stage_ranks

pd = lazy("pandas")
torch = lazy("torch")


def run(source_root: Path, target_root: Path, source_model_dir: Path, select_data: Path, out_dir: Path,
        metrics_dir: Path, params: FitParams, skipped: dict[str, str], device: str, model_dtype: str,
        only: list[str] | None = None, ranks: Ranks = ONE_PROCESS) -> dict:
    """Fit every candidate (`only`: those named, each byte-identical to its file from the full fit); `skipped`: the
    families the contract leaves undefined, to why. Rank r of N fits every N-th target layer (and probe group) with
    one process's sums; rank 0 writes and times the mappers and returns the metrics (the others {})."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS needs
    torch.use_deterministic_algorithms(True)
    source_manifest, target_manifest = manifests(source_root, target_root, params)
    geo_s, geo_t = source_manifest["geometry"], target_manifest["geometry"]
    geometry = Geometry.of(geo_s, geo_t)
    fit_pairs = paired_split(source_root, target_root, "fit")
    select_pairs = paired_split(source_root, target_root, "select")
    held = holdout_sequences(fit_pairs, params.probe_holdout, params.seed)
    scores = probe_r2(fit_pairs, held, geo_s["layers"], geo_t["layers"], geometry.heads_s * geometry.dim_s,
                      geometry.heads_t * geometry.dim_t, params.probe_lambda, params.accumulator_gib * 2**30, device,
                      ranks, params.probe_rows_gib * 2**30)
    # what the probes read from the source's fit split, in units of the split's size (keys and values)
    probe_reads = (sum(s.bytes_read for s, _ in fit_pairs)
                   / max(1, stored_bytes(fit_pairs, geo_s["layers"], geometry.heads_s * geometry.dim_s)))
    orders = ranking(scores)

    closed = params.closed_form([family for family in params.families if family not in skipped])
    depth = max((c.k for c in closed), default=0)
    closed, mlp_ks = narrowed(closed, params.mlp.ks, only)
    # the parts' folder is a temporary (`.*.tmp`: ignored by git and dvc), removed when the block ends, done or not
    with Parts(out_dir / ".parts.tmp", fresh=ranks.main) as parts:
        ranks.barrier()  # the parts folder exists before any rank writes into it
        fitted = fit_layers(list(ranks.share(geo_t["layers"])), orders, (fit_pairs, select_pairs), held, closed,
                            depth, mlp_ks, geometry, parts, params, device, ranks)
        if not ranks.main:
            return {}
        table, mlp_facts = fitted
        timing = None if only is not None else timing_input(source_model_dir, select_data, select_pairs[0][0], geo_s,
                                                             params.timing_repeats, model_dtype, device)
        fit_tokens = sum(s.tokens for s, _ in fit_pairs)
        metrics = {"fit_sequences": sum(len(s.doc_ids) for s, _ in fit_pairs), "fit_tokens": fit_tokens,
                   "select_tokens": sum(s.tokens for s, _ in select_pairs), "probe_heldout_sequences": len(held),
                   "probe_source_reads": round(probe_reads, 3),
                   **{f"skipped/{family}": reason for family, reason in skipped.items()}}
        if timing is not None:
            metrics["source_prefill_s"] = round(timing[1], 6)  # what each time_vs_source_prefill divides by
        metrics.update(write_mappers(closed + mlp_candidates(mlp_ks), orders, parts, table.heldout, mlp_facts,
                                     (source_manifest, target_manifest), params, fit_tokens, out_dir, timing))
    metrics.update(chosen_lambdas(table, closed, params.lambda_scale))
    write_tables(metrics_dir, table, scores, geo_s["layers"], geo_t["layers"])
    return metrics


def fit_layers(layers: list[int], orders: list[list[int]], splits: tuple, held: set[str], closed: list[MapName],
               depth: int, mlp_ks: list[int], geometry: Geometry, parts: Parts, params: FitParams, device: str,
               ranks: Ranks) -> tuple[R2Table, dict] | None:
    """Every candidate's tensors for this rank's target `layers`, spilled to `parts`: closed-form ones solved here
    while the MLP maps train in `fit.mlp.workers` threads (the bytes of one thread). A failure cancels the trainings
    not started, so its error is not queued behind every map. Rank 0 gets the merged R² table and the MLP training
    facts per (k, layer); the other ranks None."""
    fit_pairs, select_pairs = splits
    table, mlp_facts = R2Table(), {}
    mlp = MlpSettings(params.mlp.hidden, params.mlp.lr, params.mlp.batch_rows, params.mlp.max_epochs,
                      params.mlp.patience, seed=params.seed)
    units = [(k, layer, kind) for layer in layers for k in mlp_ks for kind in KINDS]

    def train(unit: tuple[int, int, str]):  # (k, layer, kind)
        return fit_mlp_unit(unit[1], orders[unit[1]], unit[0], unit[2], fit_pairs, select_pairs, held, mlp,
                            geometry.heads_t, parts, device)

    pool = ThreadPoolExecutor(params.mlp.workers)
    try:
        training = {unit: pool.submit(train, unit) for unit in units}
        for layer in tqdm(layers, desc="fit layers", unit="layer", disable=not ranks.main):
            if closed:
                fit_ridge_layer(layer, orders[layer], fit_pairs, select_pairs, closed, depth, geometry, parts, table,
                                device, params.lambda_scale)
            for k in mlp_ks:
                for kind in KINDS:
                    mlp_facts.setdefault((k, layer), {})[kind], unit_table = training[(k, layer, kind)].result()
                    table.extend(unit_table)
    finally:
        pool.shutdown(cancel_futures=True)
    per_rank = ranks.gather((table, mlp_facts))
    if not ranks.main:
        return None
    return (R2Table.merged([rank_table for rank_table, _ in per_rank]),
            {key: facts for _, rank_facts in per_rank for key, facts in rank_facts.items()})


def timing_input(source_model_dir: Path, select_data: Path, first_shard, geo_s: dict, repeats: int, model_dtype: str,
                 device: str) -> tuple:
    """The first select sequence's content-space cache, the source's prefill seconds over it, the device."""
    source_model = load_model(str(source_model_dir), dtype=model_dtype, device=device)
    token_ids = read_table(select_data, columns=["token_ids"]).token_ids[0].tolist()
    first = first_sequence(first_shard, geo_s["layers"], geo_s["kv_heads"], geo_s["head_dim"])
    content = [tuple(t.to(device) for t in layer) for layer in first]
    return content, prefill_seconds(source_model, token_ids, repeats), device


def write_tables(metrics_dir: Path, table: R2Table, scores: dict, source_layers: int, target_layers: int) -> None:
    _write_csv(metrics_dir / "fit_layers.csv", table.rows)
    # the header alone when no linear candidate is fitted, so the declared output always exists
    _write_csv(metrics_dir / "fit_lambda_scale.csv", table.scale_rows, R2Table.SCALE_FIELDS)
    _write_csv(metrics_dir / "fit_probe.csv", [
        {"target_layer": tl, "source_layer": sl, "r2_keys_heldout": round(scores["keys"][tl, sl].item(), 6),
         "r2_values_heldout": round(scores["values"][tl, sl].item(), 6)}
        for tl in range(target_layers) for sl in range(source_layers)])


def manifests(source_root: Path, target_root: Path, params: FitParams) -> tuple[dict, dict]:
    """Both caches' manifests, refused when extracted differently or a k of the fit params exceeds the source's."""
    source_manifest, target_manifest = read_manifest(source_root), read_manifest(target_root)
    if source_manifest["keys"] != target_manifest["keys"]:
        raise ArtifactError(f"fit: {source_root} holds {source_manifest['keys']} keys, {target_root} "
                            f"{target_manifest['keys']}; extract both the same way")
    layers = source_manifest["geometry"]["layers"]
    for k in params.ks + params.mlp.ks:
        if k > layers:
            raise ParamError(f"fit.ks: k={k} exceeds the source's {layers} layers; lower fit.ks / fit.mlp.ks")
    return source_manifest, target_manifest


def narrowed(closed: list[MapName], mlp_ks: list[int], only: list[str] | None) -> tuple[list[MapName], list[int]]:
    """The closed-form candidates and MLP k's `--only` names (all without it); an unknown name is refused."""
    if only is None:
        return closed, mlp_ks
    known = [str(c) for c in closed + mlp_candidates(mlp_ks)]
    for name in only:
        if name not in known:
            raise ParamError(f"fit --only {name}: not a candidate of the fit params (candidates: {', '.join(known)})")
    return [c for c in closed if str(c) in only], [k for k in mlp_ks if str(MapName("mlp", k)) in only]


def write_mappers(candidates: list[MapName], orders: list[list[int]], parts: Parts, heldout: dict, mlp_facts: dict,
                  manifests: tuple[dict, dict], params: FitParams, fit_tokens: int, out_dir: Path,
                  timing: tuple | None) -> dict:
    """Each candidate's mapper file and figures; `timing` (`timing_input`'s), None for a narrow refit."""
    source_manifest, target_manifest = manifests
    geo_s, geo_t = source_manifest["geometry"], target_manifest["geometry"]
    # fitted on keys with RoPE kept (the length study's ablation): the handoff must not strip
    key_space = "rotated" if source_manifest["keys"].startswith("rotated") else "content"
    # the pair the caches were extracted from, by content: every map is bound to it (kv.pair.Pair.handoff)
    models = pair_fingerprints(source_manifest["model_path"], target_manifest["model_path"])
    metrics = {}
    for candidate in tqdm(candidates, desc="write mappers", unit="mapper"):
        name, family, k = str(candidate), candidate.family, candidate.k
        extra = {"probe_lambda": params.probe_lambda, "lambda_scale": params.lambda_scale, "fit_tokens": fit_tokens,
                 "seed": params.seed}
        if family == "mlp":  # its training facts per layer, for the record
            extra["mlp"] = {"hidden": params.mlp.hidden,
                            "epochs": [mlp_facts[(k, layer)] for layer in range(geo_t["layers"])]}
        mapper = Mapper(family, source_manifest["model_path"], target_manifest["model_path"], geo_s, geo_t,
                        source_manifest["rotary"], target_manifest["rotary"], k=k,
                        ridge_lambda=candidate.ridge_lambda or 0.0,
                        source_layers=[sorted(order[:k]) for order in orders],
                        keys=parts.take(name, geo_t["layers"], "keys"),
                        values=parts.take(name, geo_t["layers"], "values"), extra=extra, key_space=key_space,
                        models=models)
        save_mapper(mapper, paths.fitted_map(name, out_dir))
        metrics[f"maps/{name}/r2_keys_select"] = round(statistics.mean(heldout[(name, "keys")]), 6)
        metrics[f"maps/{name}/r2_values_select"] = round(statistics.mean(heldout[(name, "values")]), 6)
        metrics[f"maps/{name}/family"], metrics[f"maps/{name}/k"] = family, k
        metrics[f"maps/{name}/params"] = mapper.parameter_count()
        metrics[f"maps/{name}/macs_per_token"] = mapper.macs_per_token()
        if timing is not None:
            content, prefill_s, device = timing
            metrics[f"maps/{name}/time_vs_source_prefill"] = round(
                time_against_prefill(mapper.to(device), content, prefill_s, params.timing_repeats), 4)
        del mapper
    return metrics


def chosen_lambdas(table: R2Table, closed: list[MapName], scale: str) -> dict:
    """Per lambda group: the lambda with the best mean select R², its R² per layer and kind, and per lambda scale
    the worst layer's R² at its best lambda (a layer whose map collapses shows here)."""
    out: dict[str, float | str] = {"lambda_scale": scale}
    heldout = table.heldout
    groups: dict[str, list[MapName]] = {}
    for candidate in closed:
        groups.setdefault(candidate.lambda_group, []).append(candidate)
    for group_name, group in groups.items():
        best = max(group, key=lambda c: (statistics.mean(heldout[(str(c), "keys")] + heldout[(str(c), "values")]),
                                         -c.ridge_lambda))
        out[f"chosen/{group_name}/lambda"] = best.ridge_lambda
        for kind in ("keys", "values"):
            for layer, r2 in enumerate(table.heldout_by_layer(str(best), kind)):
                out[f"chosen/{group_name}/r2_{kind}_layer{layer}"] = round(r2, 6)
    rows = pd.DataFrame(table.scale_rows)
    if not rows.empty:
        named = {str(c): c for c in closed}
        rows["k"] = [named[name].k for name in rows.candidate]
        rows["group"] = [named[name].lambda_group for name in rows.candidate]
        for (group_name, scale_, kind), group in rows.groupby(["group", "lambda_scale", "kind"]):
            best_by_layer = group.groupby("layer").r2_heldout.max()  # each layer at its best lambda on this scale
            out[f"lambda_scale_check/{group_name}/{scale_}/{kind}_worst_layer_r2"] = round(best_by_layer.min(), 6)
    return out


def _write_csv(path: Path, rows: list[dict], fields: list[str] | None = None) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else fields)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.fit", __doc__)
    cli.add_argument("--caches", type=Path, help="read caches/source and caches/target's layout from this folder")
    cli.add_argument("--out", type=Path, help="write mappers and tables here instead (the controls' refit)")
    cli.add_argument("--only", metavar="CANDIDATE[,CANDIDATE...]", type=lambda text: text.split(","),
                     help="refit only these candidates (e.g. linear_k1_lam1): the determinism control's narrow "
                          "refit, the calibration curve's fits")
    argv = sys.argv[1:] if argv is None else argv
    args = cli.parse_args(argv)
    out_folder(args.out, "--out")  # refused now, not after the work
    params, models = load_section(FitParams, "fit"), load_section(ModelsParams, "models")
    machine = load_section(MachineParams, "machine")
    out, metrics_dir = (args.out, args.out) if args.out else (paths.MAPPERS, paths.METRICS)
    caches = args.caches or paths.CACHES
    with stage_ranks(machine.torch_device, params.processes, "pipeline.fit", argv, machine.threads) as stage:
        contract = pair_contract(load_config(paths.model("target")), load_config(paths.model("source")))
        skipped = {family: contract.families[family] for family in params.families
                   if not contract.family_defined(family)}
        metrics = run(caches / "source", caches / "target", paths.model("source"), paths.split("select"),
                      out, metrics_dir, params, skipped, stage.device, models.dtype, args.only, stage.ranks)
        stage.write_metrics(paths.fit_metrics(metrics_dir), metrics)


if __name__ == "__main__":
    entry(main)
