"""Stage `sibling`: models/sibling, a real smaller model of the target's family, cut from the target and healed by
distillation from its logits, when `models.source` names that folder; otherwise a marker file alone.

    dvc exp run -S profile=smol-sibling     # the smol profile with models.source: models/sibling

`sibling.shape` says what it keeps (`schema.sibling`): fewer decoder layers (depth: `sibling.keep`, a list, or
`influence`: the first and last and those of highest block influence), fewer MLP channels and query heads in every
layer (width: those of highest activation importance, the heads within each KV group, so the KV geometry is the
target's and direct injection is defined for the pair), or both. The windows of data/calibration.parquet (the fit
stream of the corpus, disjoint by document from the select and eval splits) are cut into rows of
`sibling.row_length` tokens; the rankings read the first `sibling.ranking_sequences` rows (`fitting.importance`,
`fitting.prune`); every weight is then trained on KL(target || sibling) over all the rows, against the target's
top-k log-probabilities computed once (`fitting.heal`). The folder is a Hugging Face checkpoint
(`store.checkpoints`: float32 safetensors, config, the target's tokenizer files copied byte for byte, sibling.json
with the cut and the healing settings), so `pin_models` pins it by content like any local checkpoint and every map
binds to it. metrics/sibling.json gives the shape kept
(layers, widths), the select perplexity of the sibling and of the target (never eval) and their KL before and after
healing, the healing curve, steps, tokens, the build's seconds and the prefill cost ratio at
`sibling.prefill_length` tokens (`kv.flops`). Any other source (the tiny pair, `self:<n>`) costs nothing here: the
folder holds sibling.json saying so.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.fitting.heal import Teacher, TopTeacher, batches_of, cut_rows, heal, padded, scored
from pipeline.fitting.importance import importance
from pipeline.fitting.prune import choose_cut, choose_layers, pruned
from pipeline.kv.flops import handoff_macs, target_prefill_macs
from pipeline.kv.geometry import kv_geometry
from pipeline.schema.sibling import INFLUENCE, Counts, SiblingParams, names_sibling
from pipeline.store import paths
from pipeline.store.artifacts import read_table, write_json_atomic
from pipeline.store.checkpoints import write_checkpoint, write_marker
from pipeline.store.cli import entry, no_arguments
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams, load_config, load_model, model_folder
from pipeline.store.params import ParamError, load_section

torch = lazy("torch")

SIBLING_PROVENANCE = "sibling.json"


def sequences(path: Path) -> list[list[int]]:
    return [list(map(int, ids)) for ids in read_table(path, columns=["token_ids"])["token_ids"]]


def cut_of(params: SiblingParams, counts: Counts, target, rows: list[list[int]]):
    """(the cut, what it was chosen by): the rankings on the first `ranking_sequences` rows, then the kept layers
    (declared, by influence, or all), and in them the channels and heads of highest importance."""
    total = target.config.num_hidden_layers
    calibration = list(range(min(params.ranking_sequences, len(rows))))
    ranked = importance(target, (padded(rows, chunk) for chunk in batches_of(calibration, params.batch_sequences)))
    if counts.layers == total:
        layers, rule = list(range(total)), "all"
    elif params.keep == INFLUENCE:
        layers, rule = choose_layers(ranked.influence, counts.layers), INFLUENCE
    else:
        layers, rule = list(params.keep), "declared"
    chosen = {"layers_rule": rule, "influence": [round(value, 6) for value in ranked.influence]}
    return choose_cut(ranked, layers, counts.mlp, counts.heads, kv_geometry(target.config)["kv_heads"]), chosen


def prefill_ratio(sibling_config, target_config, length: int) -> float:
    """The sibling's prefill of a `length`-token prompt over the target's, in multiply-adds (`kv.flops`)."""
    return handoff_macs(sibling_config, target_config, 0, length)["source"] / target_prefill_macs(target_config, length)


def shape_of(config, text: str, layers: list[int]) -> dict:
    """What the sibling keeps: the shape's text, the kept target layers, and its widths."""
    geometry = kv_geometry(config)
    return {"shape": text, "layers": layers, "intermediate_size": config.intermediate_size,
            "query_heads": config.num_attention_heads, "kv_heads": geometry["kv_heads"],
            "head_dim": geometry["head_dim"], "hidden_size": config.hidden_size}


def build(params: SiblingParams, models: ModelsParams, threads: int, pool: Path, select: Path, out: Path) -> dict:
    started = time.perf_counter()
    torch.set_num_threads(threads)
    torch.manual_seed(params.seed)
    counts = params.within(load_config(models.target, models.target_revision), models.target)  # before weights
    target = load_model(models.target, models.target_revision, dtype="float32", device="cpu")
    rows, held_out = cut_rows(sequences(pool), params.row_length), sequences(select)
    cut, chosen = cut_of(params, counts, target, rows)
    sibling = pruned(target, cut)
    select_teacher, every_row = Teacher(target, held_out), list(range(len(held_out)))
    before = scored(sibling, select_teacher, every_row, params.batch_sequences)
    healing = heal(sibling, TopTeacher(target, rows, params.top_k, params.batch_sequences), select_teacher, params,
                   started)
    after = scored(sibling, select_teacher, every_row, params.batch_sequences)
    shape = shape_of(sibling.config, params.shape, cut.layers)
    write_checkpoint(out, sibling, Path(model_folder(models.target, models.target_revision)), SIBLING_PROVENANCE,
                     {"built": True, "target": models.target, "shape": shape, "heads": cut.heads,
                      "channels": cut.channels, "steps": healing["steps"], "settings": params.model_dump()})
    return {"built": True, "shape": shape, **chosen, "select_perplexity": after["perplexity"],
            "target_select_perplexity": after["target_perplexity"],
            "select_perplexity_ratio": after["perplexity"] / after["target_perplexity"],
            "prefill_ratio": round(prefill_ratio(sibling.config, target.config, params.prefill_length), 4),
            "prefill_length": params.prefill_length, "build_seconds": round(time.perf_counter() - started, 1),
            **{key: healing[key] for key in ("steps", "tokens", "stopped_by")}, "healing_rows": len(rows),
            "select_rows": len(held_out),
            "select": {"pruned_perplexity": before["perplexity"], "pruned_kl": before["kl"], "healed_kl": after["kl"]},
            "curve": healing["curve"]}


def run(params: SiblingParams, models: ModelsParams, threads: int, pool: Path, select: Path, out: Path) -> dict:
    """The sibling built into `out` when `models.source` names it; else `out` holds the marker alone."""
    if not names_sibling(models.source):
        write_marker(out, SIBLING_PROVENANCE, {"built": False})
        return {"built": False, "source": models.source}
    if models.kind != "hub":
        raise ParamError(f"models.source: {models.source} is the sibling, cut from a checkpoint target, but "
                         f"models.kind is {models.kind!r}; set models.kind: hub and models.target to a checkpoint")
    return build(params, models, threads, pool, select, out)


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.sibling", __doc__, argv)
    threads = load_section(MachineParams, "machine").threads
    result = run(load_section(SiblingParams, "sibling"), load_section(ModelsParams, "models"), threads,
                 paths.CALIBRATION_POOL, paths.split("select"), paths.SIBLING)
    write_json_atomic(paths.SIBLING_METRICS, result)
    print(json.dumps({key: value for key, value in result.items() if key not in ("curve", "influence")}, indent=2))


if __name__ == "__main__":
    entry(main)
