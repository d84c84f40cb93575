"""Stage `extract`: one model's KV caches over the fit and select sequences, sharded on disk (`store.cachefiles`).

    python -m pipeline.extract source|target [--data FOLDER --out FOLDER]

Only the decoder body runs (no logits), in `models.dtype`; keys are RoPE-stripped in float32 (content space), values
kept as cached, both stored in `extract.dtype`. Shards are hashed and written on a background thread while the model
computes the next ones, so extraction should cost little more than the slower of its two floors, measured in the same
run: a plain forward (timed on one batch, scaled to every token) and a plain write of the same bytes to the same disk.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.kv.contract import pair_contract
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.kvcache import cache_to_layers
from pipeline.kv.rope import RotarySpec, Rotation
from pipeline.schema.extract import ExtractParams
from pipeline.store import paths
from pipeline.store.artifacts import read_table, write_json_atomic
from pipeline.store.cachefiles import MANIFEST, ShardWriter
from pipeline.store.cli import entry, parser
from pipeline.store.devices import no_grad, parse_dtype
from pipeline.store.inputs import out_folder
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams, load_config, load_model
from pipeline.store.params import ParamError, load_section
from pipeline.store.ranks import ONE_PROCESS, Ranks, stage_ranks

pd = lazy("pandas")
torch = lazy("torch")

SIDES = ("source", "target")


def read_sequences(path: Path) -> pd.DataFrame:
    frame = read_table(path, columns=["doc_id", "token_ids", "content_hash"])
    empty = frame.index[frame.token_ids.map(len) == 0].tolist()
    if empty:
        raise ValueError(f"{path}: sequence {frame.doc_id[empty[0]]!r} has no tokens")
    return frame


KEY_SPACE_WORDS = {"content": "content (RoPE stripped)", "rotated": "rotated (RoPE kept: the no-strip ablation)"}


@no_grad
def content_caches(model, rotation: Rotation, batch: list, strip: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence of `batch` (one length, one forward), on the CPU: (layers, tokens, kv_heads, head_dim) keys in
    content space, float32 (`strip` False: rotated as cached), and values in the model dtype. All layers are stripped
    in one call: at small shapes the per-call overhead, not the arithmetic, is what extraction adds."""
    ids = torch.tensor([list(token_ids) for token_ids in batch], dtype=torch.long, device=model.device)  # (B, T)
    layers = cache_to_layers(model.model(input_ids=ids, use_cache=True).cache)  # (B, H, T, D) each
    keys = torch.stack([k for k, _ in layers]).float()  # (layers, B, H, T, D)
    if strip:
        keys = rotation.first(ids.shape[1]).strip(keys)
    keys_content = keys.transpose(2, 3).cpu()  # (layers, B, T, H, D)
    values = torch.stack([v for _, v in layers]).transpose(2, 3).cpu()  # (layers, B, T, H, D)
    return [(keys_content[:, row], values[:, row]) for row in range(ids.shape[0])]


def batches(lengths: list[int], size: int) -> list[range]:
    """Consecutive runs of at most `size` sequences of equal length, in order: the order of the shards is kept."""
    runs, start = [], 0
    for index in range(1, len(lengths) + 1):
        if index == len(lengths) or lengths[index] != lengths[start] or index - start == size:
            runs.append(range(start, index))
            start = index
    return runs


@no_grad
def forward_floor(model, sequences: list, batch_sequences: int) -> float:
    """Seconds for the plain decoder-body forward over `sequences`, in the batches extraction uses, nothing kept."""
    start = time.perf_counter()
    for run in batches([len(ids) for ids in sequences], batch_sequences):
        ids = torch.tensor([list(sequences[i]) for i in run], dtype=torch.long, device=model.device)  # (B, T)
        model.model(input_ids=ids, use_cache=True)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def write_floor(folder: Path, sizes: list[int], rank: int = 0) -> float:
    """Seconds to write files of `sizes` bytes into `folder` (same disk), each flushed to disk like a shard."""
    block = os.urandom(1 << 24)
    path = folder / f".write-floor-{rank}.tmp"
    start = time.perf_counter()
    try:
        for size in sizes:
            with open(path, "wb") as out:
                for offset in range(0, size, len(block)):
                    out.write(block[: min(len(block), size - offset)])
                out.flush()
                os.fsync(out.fileno())
    finally:
        path.unlink(missing_ok=True)
    return time.perf_counter() - start


def rank_shards(count: int, shard_sequences: int, ranks: Ranks) -> list[tuple[int, range]]:
    """This rank's shards (r, r+N, ... under N processes) as (global shard number, its sequences)."""
    runs = [range(start, min(start + shard_sequences, count)) for start in range(0, count, shard_sequences)]
    return [(index, runs[index]) for index in ranks.share(len(runs))]


def extract_splits(model, rotation: Rotation, frames: dict[str, pd.DataFrame], out_dir: Path, base: dict,
                   params: ExtractParams, bar, ranks: Ranks = ONE_PROCESS) -> dict:
    """This rank's shards of every split written; their records per split. Batches never cross a shard, so a
    shard's bytes do not depend on how many processes wrote the split."""
    writer = ShardWriter(out_dir, base, params.shard_sequences, parse_dtype(params.dtype))
    try:
        for split, frame in frames.items():
            lengths = [len(ids) for ids in frame.token_ids]
            for index, members in rank_shards(len(lengths), params.shard_sequences, ranks):
                writer.begin(split, [lengths[i] for i in members], first_shard=index)
                for run in batches([lengths[i] for i in members], params.batch_sequences):
                    run = [members[i] for i in run]
                    caches = content_caches(model, rotation, [frame.token_ids[i] for i in run],
                                            strip=base["keys"] == KEY_SPACE_WORDS["content"])
                    for i, (keys_content, values) in zip(run, caches):
                        writer.add(str(frame.doc_id[i]), str(frame.content_hash[i]), keys_content, values)
                    bar.update(len(run))
    except BaseException:  # Ctrl-C among them: the shard being written is finished or removed before the exit
        writer.abort()
        raise
    return writer.close()


def manifest_splits(frames: dict[str, pd.DataFrame], records: list[dict]) -> dict:
    """The manifest's `splits` entry from every rank's shard records, in shard order."""
    splits = {}
    for split, frame in frames.items():
        shards = sorted((r for part in records for r in part.get(split, [])), key=lambda r: r["file"])
        splits[split] = {"sequences": len(frame), "tokens": sum(r["tokens"] for r in shards), "shards": shards}
    return splits


def timed_repeats(model, rotation: Rotation, frames: dict, out_dir: Path, base: dict, params: ExtractParams,
                  ranks: Ranks, name: str) -> tuple[dict[str, list[float]], dict, list[int]]:
    """Each kind's times over `params.repeats`, the last repeat's shard records and the byte sizes it wrote. The
    forward floor is timed on one extraction batch and scaled to every token (a real model's floor over all of them
    cost as much as the extraction)."""
    mine = [frame.token_ids[i] for frame in frames.values()
            for _, members in rank_shards(len(frame), params.shard_sequences, ranks) for i in members]
    sample = mine[: params.batch_sequences]
    scale = sum(map(len, mine)) / sum(map(len, sample))
    times = {"forward": [], "extract": [], "write": []}
    bar = tqdm(total=len(mine) * params.repeats, desc=f"extract {name}", unit="seq", disable=not ranks.main)
    for repeat in range(params.repeats):
        if repeat % 2 == 0:  # alternate which of the two runs first, so neither always follows the other
            times["forward"].append(forward_floor(model, sample, params.batch_sequences) * scale)
        start = time.perf_counter()
        records = extract_splits(model, rotation, frames, out_dir, base, params, bar, ranks)
        times["extract"].append(time.perf_counter() - start)
        if repeat % 2 == 1:
            times["forward"].append(forward_floor(model, sample, params.batch_sequences) * scale)
        sizes = [r["bytes"] for split in records.values() for r in split]
        times["write"].append(write_floor(out_dir, sizes, ranks.rank))
    bar.close()
    return times, records, sizes


def run(model_dir: Path, name: str, data_dir: Path, out_dir: Path, params: ExtractParams,
        model_dtype: str = "float32", device: str | None = None, ranks: Ranks = ONE_PROCESS,
        device_map: str | None = None, keep_rope: bool = False) -> dict:
    """Extract, timed beside both floors, in turn repeat by repeat so drift and noise hit all three alike (medians
    reported). Each rank times its own shards; rank 0 writes the manifest and reports the slowest rank's times. The
    model runs in `models.dtype`, as later stages run it, so the map is fitted on the caches it will be given."""
    frames = {split: read_sequences(data_dir / f"{split}.parquet") for split in params.splits}
    all_ids = [ids for frame in frames.values() for ids in frame.token_ids]
    # the contract, from the config: a model whose cache cannot be stripped is refused before it is loaded
    pair_contract(load_config(str(model_dir)), max_tokens=max(len(ids) for ids in all_ids)).require("oracle")
    model = load_model(str(model_dir), dtype=model_dtype, device=ranks.device(device) if device else None,
                       device_map=device_map)
    spec = RotarySpec.from_model(model)
    rotation = Rotation(spec, torch.arange(max(len(ids) for ids in all_ids), device=model.device))
    base = {"model": name, "model_path": str(model_dir), "geometry": kv_geometry(model.config),
            "rotary": spec.to_dict(), "dtype": params.dtype, "model_dtype": model_dtype,
            "keys": KEY_SPACE_WORDS["rotated" if keep_rope else "content"]}
    if ranks.main:
        for split in frames:
            for stale in (out_dir / split).glob("shard-*.safetensors"):
                stale.unlink()  # a previous run with more shards must not leave files the manifest does not name
    ranks.barrier()
    forward_floor(model, all_ids[:1], 1)  # warm-up, so neither timing below pays first-call costs
    times, records, sizes = timed_repeats(model, rotation, frames, out_dir, base, params, ranks, name)
    median = {kind: statistics.median(values) for kind, values in times.items()}
    per_rank = ranks.gather({"records": records, "median": median, "bytes": sum(sizes)})
    if not ranks.main:
        return {}
    write_json_atomic(out_dir / MANIFEST, dict(base, splits=manifest_splits(frames, [r["records"] for r in per_rank])))
    slowest = {kind: max(r["median"][kind] for r in per_rank) for kind in median}
    return {
        "sequences": len(all_ids),
        "tokens": sum(len(ids) for ids in all_ids),
        "bytes_written": sum(r["bytes"] for r in per_rank),
        "repeats": params.repeats,
        "processes": ranks.size,
        "extract_s": round(slowest["extract"], 4),
        "forward_floor_s": round(slowest["forward"], 4),
        "write_floor_s": round(slowest["write"], 4),
        "ratio_to_floor": round(slowest["extract"] / max(slowest["forward"], slowest["write"]), 4),
        "target_ratio": params.target_ratio,
    }


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.extract", __doc__)
    cli.add_argument("model", choices=SIDES, help="which prepared model's caches to extract")
    cli.add_argument("--data", type=Path, help="read the splits' sequence files from this folder instead of data/")
    cli.add_argument("--out", type=Path, help="write the caches here instead of caches/<model> (untimed: once)")
    cli.add_argument("--keep-rope", action="store_true",
                     help="with --out: keys as cached, RoPE not stripped (the length study's ablation)")
    argv = sys.argv[1:] if argv is None else argv
    args = cli.parse_args(argv)
    out_folder(args.out, "--out")  # refused now, not after the work
    name = args.model
    params = load_section(ExtractParams, "extract")
    if args.keep_rope and not args.out:
        raise ParamError("extract --keep-rope: writes the ablation's caches, which must not replace caches/<model>; "
                         "give --out")
    if args.out:
        params = params.model_copy(update={"repeats": 1})
    models, machine = load_section(ModelsParams, "models"), load_section(MachineParams, "machine")
    out = args.out or paths.CACHES / name
    with stage_ranks(machine.torch_device, params.processes, "pipeline.extract", argv, machine.threads) as stage:
        metrics = run(paths.model(name), name, args.data or paths.DATA, out, params, models.dtype,
                      machine.torch_device, stage.ranks, models.device_map, args.keep_rope)
        stage.write_metrics(out.with_suffix(".json") if args.out else paths.METRICS / f"extract_{name}.json",
                            metrics)


if __name__ == "__main__":
    entry(main)
