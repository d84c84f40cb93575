"""Stage `select`: score every fitted and distilled mapper on the select split and choose one by the declared rule.

Each select sequence is cut into a context (the first `prompt_fraction` of its tokens) and a continuation
(the rest); every candidate runs the handoff (last-token protocol) and is compared with the oracle's stored
outputs (`pipeline.measure.compare`): agreement over all continuation positions, perplexity ratio to the oracle,
mean KL, and per target layer the cosine between the oracle's attention output and the candidate's (a cheap
proxy for task retention; the report correlates every proxy with retention). The rule (default: highest
agreement, ties by lower perplexity) picks `models/mapper.safetensors`;
for each k of the linear family the best ridge strength gives `models/best/mapped_k<k>.safetensors`, the
V0 rows k=1 and k=4 whatever the rule picks (closed-form maps only: V0's method; a distilled map, from
models/distilled/, competes for the selected map).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.kv.pair import Pair
from pipeline.measure.compare import oracle_outputs, summarize, variant_rows
from pipeline.schema.select import SelectParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, atomic_path, load_artifact
from pipeline.store.cli import entry, no_arguments
from pipeline.store.lazy import lazy
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, load_section
from pipeline.store.ranks import ONE_PROCESS, Ranks, stage_ranks

pd = lazy("pandas")

MAPPERS, DISTILLED, SELECTED, BEST = paths.MAPPERS, paths.DISTILLED, paths.SELECTED_MAPPER, paths.BEST


def select_prompts(token_lists, prompt_fraction: float) -> list[tuple[list[int], list[int]]]:
    prompts = []
    for ids in token_lists:
        ids = list(ids)
        cut = max(2, int(len(ids) * prompt_fraction))
        if len(ids) - cut >= 1:
            prompts.append((ids[:cut], ids[cut:]))
    if not prompts:
        raise ParamError("select.prompt_fraction: no select sequence is long enough to split into context and "
                         "continuation; raise data.sequence_length")
    return prompts


def rank_key(rule: str):
    """Sort key: best first. Ties always go to lower perplexity, then to fewer parameters."""
    primary = {"agreement": lambda s: -s["agreement"], "perplexity": lambda s: s["perplexity"],
               "kl": lambda s: s["mean_kl"], "attention_cosine": lambda s: -s["attention_cosine"]}[rule]
    return lambda s: (primary(s), s["perplexity"], s["parameters"])


def score_candidates(pair: Pair, prompts, params: SelectParams, candidates: list[Path],
                     ranks: Ranks = ONE_PROCESS) -> tuple[dict, list[dict]] | None:
    """Every candidate's agreement with the oracle on the select prompts, each a handoff of `pair`. Under several
    processes the oracle's prompts and then the candidates are shared out (every N-th), and rank 0 gets the
    scores in candidate order (the others None)."""
    oracle_handoff = pair.handoff("oracle")
    oracle = oracle_outputs(oracle_handoff, prompts, params.top_k, params.horizon, params.batch_size, ranks=ranks,
                            attention=True)
    oracle_rows = variant_rows(oracle_handoff, prompts, oracle, params.batch_size, ranks=ranks)
    scores = []
    mine = [candidates[i] for i in ranks.share(len(candidates))]
    for path in tqdm(mine, desc="score candidates", unit="candidate", disable=not ranks.main):
        handoff = pair.handoff("mapped", path)
        mapper = handoff.mapper
        summary = summarize(variant_rows(handoff, prompts, oracle, params.batch_size))
        summary.update(
            name=path.stem, family=mapper.family, k=mapper.k, ridge_lambda=mapper.ridge_lambda,
            parameters=mapper.parameter_count(), distilled=mapper.distilled is not None,
        )
        scores.append(summary)
    per_rank = ranks.gather(scores)
    if not ranks.main:
        return None
    oracle_summary = summarize(oracle_rows)
    order = {path.stem: index for index, path in enumerate(candidates)}
    scores = sorted((score for part in per_rank for score in part), key=lambda score: order[score["name"]])
    for score in scores:
        score["ppl_ratio"] = score["perplexity"] / oracle_summary["perplexity"]
    return oracle_summary, scores


def choose(scores: list[dict], rule: str) -> tuple[dict, dict[int, dict]]:
    ranked = sorted(scores, key=rank_key(rule))
    best_per_k: dict[int, dict] = {}
    for score in ranked:
        if score["family"] == "linear" and not score["distilled"]:  # V0's rows: its closed-form maps
            best_per_k.setdefault(score["k"], score)
    return ranked[0], best_per_k


def candidate_path(name: str) -> Path:
    """A candidate's file: fit's (models/mappers/) or a distilled one (models/distilled/)."""
    return next(path for path in (paths.fitted_map(name), paths.distilled_map(name)) if path.is_file())


def copy_verified(source: Path, destination: Path) -> None:
    load_artifact(source)  # refuses a corrupted candidate before it is promoted
    with atomic_path(destination) as tmp:
        shutil.copyfile(source, tmp)


def promote(scored: tuple[dict, list[dict]], params: SelectParams, prompts: int) -> dict:
    """Copy the chosen candidate to models/mapper.safetensors and the best of each k to models/best/; the
    stage's metrics (every candidate's scores beside the oracle's)."""
    oracle_summary, scores = scored
    chosen, best_per_k = choose(scores, params.rule)
    copy_verified(candidate_path(chosen["name"]), SELECTED)
    with atomic_dir(BEST) as staging:  # replaced whole, so a k dropped from the grid leaves no stale file
        for k, score in best_per_k.items():
            copy_verified(candidate_path(score["name"]), paths.best_map(k, staging))
    metrics: dict[str, float | int | str] = {"selected": chosen["name"], "rule": params.rule, "prompts": prompts,
                                             "oracle_perplexity": round(oracle_summary["perplexity"], 4),
                                             "oracle_attention_cosine": round(oracle_summary["attention_cosine"], 4)}
    for score in scores:
        for key in ("agreement", "next_token_top1", "ppl_ratio", "mean_kl", "rollout_agreement", "attention_cosine"):
            metrics[f"maps/{score['name']}/{key}"] = round(score[key], 4)
        layers = sum(key.startswith("attention_cosine_layer") for key in score)  # compare.attention_summary's
        for key in (f"attention_cosine_layer{layer}" for layer in range(layers)):
            metrics[f"maps/{score['name']}/{key}"] = round(score[key], 4)
    for k, score in best_per_k.items():
        metrics[f"best_k{k}"] = score["name"]
    return metrics


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.select", __doc__, argv)
    params, models = load_section(SelectParams, "select"), load_section(ModelsParams, "models")
    candidates = sorted(MAPPERS.glob("*.safetensors")) + sorted(DISTILLED.glob("*.safetensors"))
    if not candidates:
        raise FileNotFoundError(f"no mapper candidates in {MAPPERS}: run the fit stage first")
    with stage_ranks(models.torch_device, params.processes, "pipeline.select", [], params.threads) as stage:
        prompts = select_prompts(pd.read_parquet(paths.split("select")).token_ids, params.prompt_fraction)
        scored = score_candidates(Pair.load(models, stage.device), prompts, params, candidates, stage.ranks)
        stage.write_metrics(paths.SELECT, promote(scored, params, len(prompts)) if stage.ranks.main else {})


if __name__ == "__main__":
    entry(main)
