"""Stage `select`: score every fitted mapper on the select split and choose one by the declared rule.

Each select sequence is cut into a context (the first `prompt_fraction` of its tokens) and a continuation
(the rest); every candidate runs the handoff (last-token protocol) and is compared with the oracle's stored
outputs (`pipeline.measure.compare`): agreement over all continuation positions, perplexity ratio to the oracle,
mean KL, and per target layer the cosine between the oracle's attention output and the candidate's (a cheap
proxy for task retention; the report correlates every proxy with retention). The rule (default: highest
agreement, ties by lower perplexity) picks `models/mapper.safetensors`;
for each k of the linear family the best ridge strength gives `models/best/mapped_k<k>.safetensors`, the
V0 rows k=1 and k=4 whatever the rule picks.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd
import torch
from tqdm.auto import tqdm

from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import load_mapper
from pipeline.measure.compare import oracle_outputs, summarize, variant_rows
from pipeline.store.artifacts import atomic_dir, atomic_path, load_artifact, write_json_atomic
from pipeline.store.cli import entry, no_arguments
from pipeline.store.devices import StageUsage, usage_of_ranks
from pipeline.store.models import ModelsParams, load_model, load_tokenizer
from pipeline.store.params import load_section, spec
from pipeline.store.ranks import SINGLE, World, join, leave, relaunch

MAPPERS = Path("models/mappers")
SELECTED = Path("models/mapper.safetensors")
BEST = Path("models/best")


@dataclass
class SelectParams:
    prompt_fraction: float = spec(min=0.05, max=0.95)
    top_k: int = spec(positive=True)
    horizon: int = spec(positive=True)
    rule: Literal["agreement", "perplexity", "kl", "attention_cosine"]
    batch_size: int = spec(positive=True)  # select prompts per forward
    threads: int = spec(positive=True)
    processes: int = spec(min=1)  # torchrun processes, sharing out the oracle's prompts, then the candidates


def select_prompts(token_lists, prompt_fraction: float) -> list[tuple[list[int], list[int]]]:
    prompts = []
    for ids in token_lists:
        ids = list(ids)
        cut = max(2, int(len(ids) * prompt_fraction))
        if len(ids) - cut >= 1:
            prompts.append((ids[:cut], ids[cut:]))
    if not prompts:
        raise ValueError("no select sequence is long enough to split into context and continuation")
    return prompts


def rank_key(rule: str):
    """Sort key: best first. Ties always go to lower perplexity, then to fewer parameters."""
    primary = {"agreement": lambda s: -s["agreement"], "perplexity": lambda s: s["perplexity"],
               "kl": lambda s: s["mean_kl"], "attention_cosine": lambda s: -s["attention_cosine"]}[rule]
    return lambda s: (primary(s), s["perplexity"], s["parameters"])


def score_candidates(target, source, prompts, params: SelectParams, candidates: list[Path],
                     tokenizers: tuple | None, world: World = SINGLE) -> tuple[dict, list[dict]] | None:
    """Every candidate's agreement with the oracle on the select prompts; `tokenizers` (source, target) are
    compared by the architecture contract. Under several processes the oracle's prompts and then the
    candidates are shared out (every N-th), and rank 0 gets the scores in candidate order (the others None)."""
    oracle_handoff = Handoff(target)
    oracle = oracle_outputs(oracle_handoff, prompts, params.top_k, params.horizon, params.batch_size, world=world,
                            attention=True)
    oracle_rows = variant_rows(oracle_handoff, prompts, oracle, params.batch_size, world=world)
    scores = []
    mine = [candidates[i] for i in world.share(len(candidates))]
    for path in tqdm(mine, desc="score candidates", unit="candidate", disable=not world.main):
        mapper = load_mapper(path, device=target.device)
        summary = summarize(variant_rows(Handoff(target, source, "mapped", mapper, tokenizers=tokenizers),
                                               prompts, oracle, params.batch_size))
        summary.update(
            name=path.stem, family=mapper.family, k=mapper.k, ridge_lambda=mapper.ridge_lambda,
            parameters=mapper.parameter_count(),
        )
        scores.append(summary)
    ranks = world.gather(scores)
    if not world.main:
        return None
    oracle_summary = summarize(oracle_rows)
    order = {path.stem: index for index, path in enumerate(candidates)}
    scores = sorted((score for part in ranks for score in part), key=lambda score: order[score["name"]])
    for score in scores:
        score["ppl_ratio"] = score["perplexity"] / oracle_summary["perplexity"]
    return oracle_summary, scores


def choose(scores: list[dict], rule: str) -> tuple[dict, dict[int, dict]]:
    ranked = sorted(scores, key=rank_key(rule))
    best_per_k: dict[int, dict] = {}
    for score in ranked:
        if score["family"] == "linear":
            best_per_k.setdefault(score["k"], score)
    return ranked[0], best_per_k


def copy_verified(source: Path, destination: Path) -> None:
    load_artifact(source)  # refuses a corrupted candidate before it is promoted
    with atomic_path(destination) as tmp:
        shutil.copyfile(source, tmp)


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.select", __doc__, argv)
    params = load_section(SelectParams, "select")
    if relaunch(params.processes, "pipeline.select", []):
        return
    models = load_section(ModelsParams, "models")
    torch.set_num_threads(params.threads)
    candidates = sorted(MAPPERS.glob("*.safetensors"))
    if not candidates:
        raise FileNotFoundError(f"no mapper candidates in {MAPPERS}: run the fit stage first")
    world = join(models.torch_device)
    device = world.device(models.torch_device)
    usage = StageUsage(device)
    target = load_model("models/target", dtype=models.dtype, device=device, device_map=models.device_map)
    source = load_model("models/source", dtype=models.dtype, device=device, device_map=models.device_map)
    prompts = select_prompts(pd.read_parquet("data/select.parquet").token_ids, params.prompt_fraction)
    tokenizers = (load_tokenizer("models/source"), load_tokenizer("models/target"))
    scored = score_candidates(target, source, prompts, params, candidates, tokenizers, world)
    figures = world.gather(usage.figures())
    if not world.main:
        leave(world)
        return
    oracle_summary, scores = scored
    chosen, best_per_k = choose(scores, params.rule)
    copy_verified(MAPPERS / f"{chosen['name']}.safetensors", SELECTED)
    with atomic_dir(BEST) as staging:  # replaced whole, so a k dropped from the grid leaves no stale file
        for k, score in best_per_k.items():
            copy_verified(MAPPERS / f"{score['name']}.safetensors", staging / f"mapped_k{k}.safetensors")
    metrics: dict[str, float | int | str] = {"selected": chosen["name"], "rule": params.rule, "prompts": len(prompts),
                                             "oracle_perplexity": round(oracle_summary["perplexity"], 4),
                                             "oracle_attention_cosine": round(oracle_summary["attention_cosine"], 4)}
    for score in scores:
        for key in ("agreement", "next_token_top1", "ppl_ratio", "mean_kl", "rollout_agreement", "attention_cosine"):
            metrics[f"{score['name']}_{key}"] = round(score[key], 4)
        for key in sorted((k for k in score if k.startswith("attention_cosine_layer")), key=lambda k: int(k[22:])):
            metrics[f"{score['name']}_{key}"] = round(score[key], 4)
    for k, score in best_per_k.items():
        metrics[f"best_k{k}"] = score["name"]
    metrics.update(usage_of_ranks(figures))
    write_json_atomic("metrics/select.json", metrics)
    print(json.dumps(metrics, indent=2))
    leave(world)


if __name__ == "__main__":
    entry(main)
