"""Stage `sibling`: models/sibling, a real smaller model of the target's family, cut from the target in depth and
healed by distillation from its logits, when `models.source` names that folder; otherwise a marker file alone.

    dvc exp run -S profile=smol -S models.source=models/sibling

The sibling keeps `sibling.layers` of the target's decoder layers (`sibling.keep`: a list, or `influence`: the first
and last and those of highest block influence on the healing rows, `fitting.prune`), and every weight is trained on
KL(target || sibling) over the rows of data/calibration.parquet, the fit stream of the corpus, disjoint by document
from the select and eval splits (`fitting.heal`). Its prefill costs about layers / L of the target's (`kv.flops`).
The folder is a Hugging Face checkpoint (float32 safetensors, config, the target's tokenizer files copied byte for
byte, sibling.json with the kept layers and the healing settings), so `pin_models` pins it by content like any local
checkpoint and every map binds to it. metrics/sibling.json gives the kept layers (and each layer's influence), the
steps, tokens and seconds, the sibling's and the target's perplexity and their KL on the select split (never eval)
before and after healing, the healing curve and the prefill cost ratio. Any other source (the tiny pair, `self:<n>`)
costs nothing here: the folder holds sibling.json saying so.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from pipeline.fitting.heal import Healing, Teacher, heal, padded, scored
from pipeline.fitting.prune import block_influence, check_layers, choose_layers, pruned
from pipeline.kv.flops import handoff_macs, target_prefill_macs
from pipeline.schema.sibling import INFLUENCE, SiblingParams, names_sibling
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, write_json_atomic
from pipeline.store.cli import entry, no_arguments
from pipeline.store.lazy import lazy
from pipeline.store.models import ModelsParams, load_model, model_folder
from pipeline.store.params import ParamError, load_section

pd = lazy("pandas")
torch = lazy("torch")

PROVENANCE = "sibling.json"
# what the sibling's folder takes from the target's besides its own weights and config: the tokenizer byte for byte
# (so the pair's tokenizers are identical), the generation settings and the chat template
TARGET_FILES = ("generation_config.json", "tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "*.model",
                "chat_template*")


def sequences(path: Path) -> list[list[int]]:
    return [list(map(int, ids)) for ids in pd.read_parquet(path, columns=["token_ids"])["token_ids"]]


def kept_layers(params: SiblingParams, target, rows: list[list[int]], where: str) -> dict:
    total = target.config.num_hidden_layers
    if params.keep != INFLUENCE:
        return {"rule": "declared", "layers": check_layers(params.keep, total, where)}
    chunks = [list(range(start, min(start + params.batch_sequences, params.influence_sequences, len(rows))))
              for start in range(0, min(params.influence_sequences, len(rows)), params.batch_sequences)]
    influence = block_influence(target, (padded(rows, chunk) for chunk in chunks))
    return {"rule": INFLUENCE, "layers": choose_layers(influence, params.layers),
            "influence": [round(value, 6) for value in influence]}


def prefill_cost_ratio(sibling_config, target_config, length: int) -> float:
    """The sibling's prefill of a `length`-token prompt over the target's, in multiply-adds (`kv.flops`)."""
    return handoff_macs(sibling_config, target_config, 0, length)["source"] / target_prefill_macs(target_config, length)


def write_folder(sibling, target_folder: Path, provenance: dict, out: Path) -> None:
    with atomic_dir(out) as staging:
        sibling.save_pretrained(staging)
        for pattern in TARGET_FILES:
            for path in sorted(target_folder.glob(pattern)):
                shutil.copyfile(path, staging / path.name)
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")


def build(params: SiblingParams, models: ModelsParams, pool: Path, select: Path, out: Path) -> dict:
    started = time.perf_counter()
    torch.set_num_threads(params.threads)
    torch.manual_seed(params.seed)
    target = load_model(models.target, models.target_revision, dtype="float32", device="cpu")
    rows, held_out = sequences(pool), sequences(select)
    kept = kept_layers(params, target, rows, models.target)
    sibling = pruned(target, kept["layers"])
    teacher, select_teacher = Teacher(target, rows), Teacher(target, held_out)
    every_row = list(range(len(held_out)))
    before = scored(sibling, select_teacher, every_row, params.batch_sequences)
    settings = Healing(**params.model_dump(include=set(Healing.__dataclass_fields__)))
    healing = heal(sibling, teacher, select_teacher, settings, started)
    after = scored(sibling, select_teacher, every_row, params.batch_sequences)
    write_folder(sibling, Path(model_folder(models.target, models.target_revision)),
                 {"built": True, "target": models.target, **kept, "steps": healing["steps"],
                  "settings": params.model_dump()}, out)
    length = max(map(len, rows))
    return {"built": True, **kept, **{key: healing[key] for key in ("steps", "tokens", "stopped_by")},
            "seconds": round(time.perf_counter() - started, 1), "healing_rows": len(rows), "select_rows": len(held_out),
            "prefill_cost_ratio": round(prefill_cost_ratio(sibling.config, target.config, length), 4),
            "prefill_cost_length": length,
            "select": {"target_perplexity": after["target_perplexity"], "pruned_perplexity": before["perplexity"],
                       "healed_perplexity": after["perplexity"], "pruned_kl": before["kl"], "healed_kl": after["kl"],
                       "healed_over_target": after["perplexity"] / after["target_perplexity"]},
            "curve": healing["curve"]}


def run(params: SiblingParams, models: ModelsParams, pool: Path, select: Path, out: Path) -> dict:
    """The sibling built into `out` when `models.source` names it; else `out` holds the marker alone."""
    if not names_sibling(models.source):
        with atomic_dir(out) as staging:
            (staging / PROVENANCE).write_text(json.dumps({"built": False}) + "\n")
        return {"built": False, "source": models.source}
    if models.kind != "hub":
        raise ParamError(f"models.source: {models.source} is the sibling, cut from a checkpoint target, but "
                         f"models.kind is {models.kind!r}; set models.kind: hub and models.target to a checkpoint")
    return build(params, models, pool, select, out)


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.sibling", __doc__, argv)
    result = run(load_section(SiblingParams, "sibling"), load_section(ModelsParams, "models"),
                 paths.CALIBRATION_POOL, paths.split("select"), paths.SIBLING)
    write_json_atomic(paths.SIBLING_METRICS, result)
    print(json.dumps({key: value for key, value in result.items() if key != "curve"}, indent=2))


if __name__ == "__main__":
    entry(main)
