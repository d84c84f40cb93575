"""Stage `select`: score every fitted and distilled mapper on the select split and choose one by the declared rule.

Select prompts are cut at `prompt_fraction`, or at each of `prompt_lengths` (the operating lengths: a map and its repair
are chosen where they will be used). `select.rule` ranks every candidate against the oracle, then the best `repair_maps`
maps again at each setting of `select.repairs` within `max_recompute`, and speculative prefill's look-ahead candidates.
The chosen map, its repair and the look-ahead go to models/, with the best closed-form linear map per k (V0's rows).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

from tqdm.auto import tqdm

from pipeline.kv.flops import repair_budget, source_scores_macs
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.speculative import SpeculativeParams
from pipeline.measure.evaluation import Evaluation, OracleStore, evaluate
from pipeline.measure.prompt_metrics import CONFIDENT, PROMPT_METRICS
from pipeline.schema.select import SelectParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, atomic_path, load_artifact, read_table, write_json_atomic
from pipeline.store.cli import entry, no_arguments
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, load_section, load_value
from pipeline.store.ranks import ONE_PROCESS, Ranks, stage_ranks
from pipeline.store.shapes import bound_configs

DIGITS = 4  # metrics/select.json's figures


class Scored(NamedTuple):
    """`lookahead`: the look-ahead settings chosen (None where none were declared)."""
    reference: Evaluation
    scores: list[dict]
    costs: dict[str, float]
    lookahead: SpeculativeParams | None
    looked: list[dict]


def select_prompts(token_lists, params: SelectParams) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) per sequence cut at `prompt_fraction`, or per n of `prompt_lengths` it holds."""
    prompts = []
    for ids in map(list, token_lists):
        if params.prompt_lengths:
            prompts += [(ids[:n], ids[n : n + params.continuation]) for n in params.prompt_lengths
                        if len(ids) >= n + params.continuation]
            continue
        cut = max(2, int(len(ids) * params.prompt_fraction))
        if len(ids) - cut >= 1:
            prompts.append((ids[:cut], ids[cut:]))
    if not prompts:
        key = "select.prompt_lengths" if params.prompt_lengths else "select.prompt_fraction"
        raise ParamError(f"{key}: no select sequence is long enough to split into context and continuation; raise "
                         f"data.sequence_length")
    return prompts


def rank_key(rule: str):
    """Sort key: best first by the prompt metric `rule` in its direction (one undefined on the select prompts was
    refused); ties go to lower perplexity, then fewer parameters, then the smaller repair budget."""
    metric = PROMPT_METRICS[rule]
    return lambda s: (-metric.better(s[rule]), s["perplexity"], s["parameters"], s["budget"])


def budgets(params: SelectParams, loaded: tuple, lookahead: SpeculativeParams | None = None) -> dict[str, float]:
    """Per setting, its multiply-adds over the target's prefill at `bound_pair`'s shapes for `length` tokens."""
    source, target = bound_configs(params.bound_pair, loaded)
    return {str(setting): repair_budget(target, setting, params.length,
                                        source_scores_macs(source, setting, lookahead, params.length))
            for setting in params.settings()}


def score_jobs(pair: Pair, prompts, params: SelectParams, oracle, jobs: list[tuple[Path, Repair]], costs: dict,
               margin: float, ranks: Ranks, lookahead: SpeculativeParams | None = None) -> list[dict]:
    """Each (map file, repair setting)'s prompt metrics against the oracle, what it is, and its evaluation, on every
    rank in job order."""
    def score(path: Path, setting: Repair) -> dict:
        router = pair.router(mode="mapped", mapper=path, repair=setting,
                             speculative=lookahead if setting.reads_source else None, batch_size=params.batch_size)
        mapper = router.handoff.mapper
        return {"evaluation": evaluate(router, prompts, oracle, margin=margin), "name": path.stem,
                "family": mapper.family, "k": mapper.k, "ridge_lambda": mapper.ridge_lambda,
                "parameters": mapper.parameter_count(), "distilled": mapper.distilled is not None,
                "repair": str(setting), "budget": costs[str(setting)]}

    return shared_out(jobs, score, ranks, "score candidates", "candidate")


def shared_out(jobs: list, score, ranks: Ranks, desc: str, unit: str) -> list[dict]:
    """`score(*job)` with its evaluation's prompt metrics, each of N ranks running every N-th job; every rank gets
    all scores in job order."""
    scores = []
    for index in tqdm(ranks.share(len(jobs)), desc=desc, unit=unit, disable=not ranks.main):
        scored = score(*jobs[index])
        scores.append({**scored["evaluation"].prompts.metrics, **scored, "job": index})
    return sorted((score for part in ranks.all_gather(scores) for score in part), key=lambda score: score["job"])


def score_lookahead(pair: Pair, prompts, params: SelectParams, oracle, declared: SpeculativeParams, margin: float,
                    ranks: Ranks) -> tuple[SpeculativeParams, list[dict]]:
    """Speculative prefill keeping `lookahead_share` of each select prompt under each candidate of `select.lookahead`
    (`declared` with its layers and pooling; []: `declared` alone): the best by the rule (ties: lower perplexity,
    then the first listed) and every candidate's score, on every rank."""
    candidates = [declared.reading(choice) for choice in params.lookahead] or [declared]
    scores = shared_out([(c,) for c in candidates], lambda c: {"evaluation": evaluate(
        pair.router(mode="speculative", share=params.lookahead_share, speculative=c,
                    batch_size=params.batch_size), prompts, oracle, margin=margin)},
        ranks, "score look-ahead", "setting")
    confident_scores(scores, params.rule, margin)
    better = PROMPT_METRICS[params.rule].better
    best = min(scores, key=lambda score: (-better(score[params.rule]), score["perplexity"], score["job"]))
    return candidates[best["job"]], scores


def score_candidates(pair: Pair, prompts, params: SelectParams, candidates: list[Path], margin: float,
                     ranks: Ranks = ONE_PROCESS, declared: SpeculativeParams | None = None) -> Scored | None:
    """Every candidate against the oracle; with `declared` (params' `speculative`) the look-ahead chosen; then the
    best `repair_maps` maps at every setting within `max_recompute`. `margin`: the oracle's top-2 margin from which a
    position is confident. Rank 0 gets the scores, the others None."""
    store = OracleStore(params.top_k, params.horizon, attention=True)
    reference = evaluate(pair.router(mode="oracle", batch_size=params.batch_size), prompts, margin=margin,
                         store=store, ranks=ranks)
    oracle = reference.oracle
    scores = score_jobs(pair, prompts, params, oracle, [(path, Repair()) for path in candidates], {"none": 0.0},
                        margin, ranks)
    confident_scores(scores, params.rule, margin)
    lookahead, looked = (declared, []) if declared is None else score_lookahead(pair, prompts, params, oracle,
                                                                                declared, margin, ranks)
    costs = budgets(params, pair.configs, lookahead)
    settings = [s for s in params.settings() if not s.empty and costs[str(s)] <= params.max_recompute]
    best = sorted(scores, key=rank_key(params.rule))[: params.repair_maps] if settings else []
    by_name = {path.stem: path for path in candidates}
    jobs = [(by_name[score["name"]], setting) for score in best for setting in settings]
    scores += score_jobs(pair, prompts, params, oracle, jobs, costs, margin, ranks, lookahead)
    if not ranks.main:
        return None
    for score in scores:
        score.update(score["evaluation"].prompts.ratios(reference.prompts))
    return Scored(reference, scores, costs, lookahead, looked)


def confident_scores(scores: list[dict], rule: str, margin: float) -> None:
    """Refuse a rule that is undefined on the select prompts for some candidate: a confident figure where no position
    (or, for confident top-1, no first position) has the oracle sure ranks nothing."""
    if any(score[rule] is None for score in scores):
        where = (f"no select prompt has an oracle top-2 margin >= measure.confident_margin {margin} where it counts; "
                 f"lower measure.confident_margin or choose another select.rule" if PROMPT_METRICS[rule].group ==
                 CONFIDENT else "it is undefined on the select prompts; choose another select.rule")
        raise ParamError(f"select.rule {rule}: {where}")


def choose(scores: list[dict], rule: str, max_recompute: float) -> tuple[dict, dict[int, dict]]:
    """The best (map, setting) by `rule` within `max_recompute`, and per k the best closed-form linear map
    unrepaired (V0's rows)."""
    ranked = sorted((score for score in scores if score["budget"] <= max_recompute), key=rank_key(rule))
    best_per_k: dict[int, dict] = {}
    for score in ranked:
        if score["family"] == "linear" and not score["distilled"] and score["repair"] == "none":
            best_per_k.setdefault(score["k"], score)
    return ranked[0], best_per_k


def candidate_path(name: str) -> Path:
    return next(path for path in (paths.fitted_map(name), paths.distilled_map(name)) if path.is_file())


def copy_verified(source: Path, destination: Path) -> None:
    load_artifact(source)  # refuses a corrupted candidate before it is promoted
    with atomic_path(destination) as tmp:
        shutil.copyfile(source, tmp)


def promote(scored: Scored, params: SelectParams, prompts: int) -> dict:
    """The chosen map, its repair setting, the look-ahead and the best map of each k under models/; the metrics."""
    reference, scores, costs, lookahead = scored.reference, scored.scores, scored.costs, scored.lookahead
    chosen, best_per_k = choose(scores, params.rule, params.max_recompute)
    copy_verified(candidate_path(chosen["name"]), paths.SELECTED_MAPPER)
    reads = {"speculative": lookahead.model_dump()} if Repair.parse(chosen["repair"]).reads_source else {}
    write_json_atomic(paths.SELECTED_REPAIR, {"map": chosen["name"], "repair": chosen["repair"],
                                              "budget": round(chosen["budget"], 6), **reads})
    if lookahead is not None:
        write_json_atomic(paths.LOOKAHEAD, lookahead.model_dump())
    with atomic_dir(paths.BEST) as staging:  # replaced whole, so a k dropped from the grid leaves no stale file
        for k, score in best_per_k.items():
            copy_verified(candidate_path(score["name"]), paths.best_map(k, staging))
    metrics: dict = {"selected": chosen["name"], "rule": params.rule, "prompts": prompts,
                     "oracle": reference.figures(DIGITS), "selected_repair": chosen["repair"],
                     "selected_repair_budget": round(chosen["budget"], 6), "max_recompute": params.max_recompute}
    if scored.looked:
        metrics["selected_lookahead"] = lookahead.label
        for choice, score in zip(params.lookahead or [lookahead], scored.looked):
            metrics[f"lookahead/{choice.label}"] = score["evaluation"].figures(DIGITS, reference)
    for setting, budget in costs.items():
        metrics[f"repairs/{setting}/budget"] = round(budget, 6)
    for score in scores:
        where = f"maps/{score['name']}" if score["repair"] == "none" else f"repaired/{score['name']}/{score['repair']}"
        metrics[where] = score["evaluation"].figures(DIGITS, reference)
    for k, score in best_per_k.items():
        metrics[f"best_k{k}"] = score["name"]
    return metrics


def run(params: SelectParams, pair: Pair, candidates: list[Path], margin: float, ranks: Ranks = ONE_PROCESS,
        declared: SpeculativeParams | None = None) -> dict:
    """Score `candidates` on the select split's prompts and promote the choice; the metrics on rank 0 ({} else)."""
    prompts = select_prompts(read_table(paths.split("select")).token_ids, params)
    scored = score_candidates(pair, prompts, params, candidates, margin, ranks, declared)
    return promote(scored, params, len(prompts)) if ranks.main else {}


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.select", __doc__, argv)
    params, models = load_section(SelectParams, "select"), load_section(ModelsParams, "models")
    machine = load_section(MachineParams, "machine")
    margin = load_value(float, "measure.confident_margin")  # check_params holds it within [0, 1]
    declared = load_section(SpeculativeParams, "speculative")
    candidates = paths.map_candidates()
    with stage_ranks(machine.torch_device, params.processes, "pipeline.select", [], machine.threads) as stage:
        stage.write_metrics(paths.SELECT, run(params, Pair.load(models, stage.device), candidates, margin,
                                              stage.ranks, declared))


if __name__ == "__main__":
    entry(main)
