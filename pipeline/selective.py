"""Stage `selective`: per request, trust the mapped cache or fall back to the target's own prefill.

    python -m pipeline.selective

Each map of `selective.maps` runs ungated beside the oracle on every task item (dev and eval parts) and eval prompt;
each score of `selective.scores` (`kv.gate`; the `probe` learns from dev items only) gets its AUROC for "the map
changes the decision", its curve of quality against fallback rate and a threshold chosen on dev, reported on eval.
"""
from __future__ import annotations

from dataclasses import asdict

from pipeline.kv.flops import handoff_macs, mapper_macs_per_token, target_prefill_macs
from pipeline.kv.gate import REFERENCES, Probe, Scorer, fit_probe
from pipeline.kv.handoff import Handoff
from pipeline.kv.pair import Pair
from pipeline.kv.router import Router
from pipeline.kv.scores import FEATURES, SCORES, score_macs
from pipeline.kv.scoring import truncate
from pipeline.measure import gating
from pipeline.measure.compare import read_prompts
from pipeline.measure.confident import MARGINS, confident_prompts
from pipeline.measure.evaluation import evaluate
from pipeline.measure.latency import handoff_first_token, measure
from pipeline.measure.retention import gap_closure_interval, retention_interval
from pipeline.measure.settings import MeasureParams
from pipeline.measure.stats import paired_bootstrap
from pipeline.measure.timing import median_seconds
from pipeline.schema.selective import SelectiveParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, load_artifact, require_controls_passed
from pipeline.store.cli import entry, no_arguments
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import load_section
from pipeline.store.ranks import stage_ranks
from pipeline.store.shapes import bound_configs
from pipeline.store.splits import TASKS

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

METRIC = "acc_norm"  # the retention metric the threshold is chosen for (report.retention_metric's default)


def column(name: str) -> str:
    """A request frame's column: `score_<name>` of a score (curves, AUROC, threshold), else `feature_<name>`."""
    return f"score_{name}" if name in SCORES else f"feature_{name}"


def probe_features(disagree) -> tuple[str, ...]:
    """The probe's features: all of `kv.gate.FEATURES`, `disagree` only where its two maps are given."""
    return tuple(name for name in FEATURES if name != "disagree" or disagree)


def measured(params: SelectiveParams, disagree) -> list[str]:
    """What the scorer computes per request: the scores but the probe, and the probe's features."""
    scores = [name for name in params.scores if name != "probe"]
    return list(dict.fromkeys([*scores, *(probe_features(disagree) if "probe" in params.scores else ())]))


def train_probe(rows: pd.DataFrame, features: tuple[str, ...], l2: float) -> Probe:
    """The probe of "the map changes the decision" trained on `rows`, all dev items: the eval part is what it is
    judged on."""
    others = sorted(set(rows.part) - {"dev"})
    if others or rows.empty:
        raise ValueError(f"the probe trains on dev items only; given rows of {others or 'no part'}: pass "
                         f"items[items.part == 'dev']")
    return fit_probe({name: rows[column(name)].to_numpy() for name in features}, rows.changed.to_numpy(), features,
                     l2)


def probe_score(probe: Probe, frame: pd.DataFrame, features: tuple[str, ...]) -> np.ndarray:
    return probe({feature: frame[column(feature)].to_numpy() for feature in features}).numpy()


def add_probe(items: pd.DataFrame, prompts: pd.DataFrame, params: SelectiveParams, disagree) -> dict[str, Probe]:
    """Per map, the probe trained on its dev items, and its `score_probe` of every item and prompt. A dev item's
    score is out-of-fold (item i in fold i mod `probe_folds`, scored by the probe trained on the other folds), so the
    threshold chosen on dev sees scores of unlearned items, as eval's are; eval gets the probe of every dev item."""
    features, probes = probe_features(disagree), {}
    for name in params.maps:
        dev = items[(items.part == "dev") & (items["map"] == name)]
        probes[name] = train_probe(dev, features, params.probe_l2)
        judged = (items["map"] == name) & (items.part != "dev")
        items.loc[judged, "score_probe"] = probe_score(probes[name], items.loc[judged], features)
        own = prompts["map"] == name
        prompts.loc[own, "score_probe"] = probe_score(probes[name], prompts.loc[own], features)
        fold = np.arange(len(dev)) % params.probe_folds
        for held in range(params.probe_folds):
            learned = train_probe(dev[fold != held], features, params.probe_l2)
            items.loc[dev.index[fold == held], "score_probe"] = probe_score(learned, dev[fold == held], features)
    return probes


def task_frame(pair: Pair, router: Router, files: dict, items: int | None = None) -> pd.DataFrame:
    """Per task item: lm-eval's outcome, log-likelihoods and choices through `router`, and `tokens`, the context its
    first choice was scored after, as the router truncated it."""
    rows = evaluate(router, tasks=files, tokenizer=pair.target_tokenizer, task_limit=items).item_rows
    window = router.handoff.decoder.config.max_position_embeddings  # the router's (`measure.adapter.HandoffLM`)
    rows["tokens"] = [truncate(contexts[0], continuations[0], window)
                      for contexts, continuations in zip(rows.context_ids, rows.continuation_ids)]
    return rows


def item_rows(part: str, name: str, frame: pd.DataFrame, base: dict, scores: dict) -> pd.DataFrame:
    rows = pd.DataFrame({"part": part, "map": name, "task": frame.task, "item": frame.item,
                         "mapped": frame[METRIC], "oracle": base["oracle"][METRIC].to_numpy(),
                         "changed": gating.decisions(frame, METRIC) != gating.decisions(base["oracle"], METRIC)})
    if "source" in base:
        rows["source"] = base["source"][METRIC].to_numpy()
    return rows.assign(**{column(score): values.numpy() for score, values in scores.items()})


def score_requests(pair: Pair, params: SelectiveParams, routers: dict[str, Router], disagree,
                   study_items: int | None = None) -> tuple[pd.DataFrame, ...]:
    """Per-request rows of every map: task items of both parts (each eval task's first `study_items`), eval
    prompts."""
    oracle = pair.router(mode="oracle", batch_size=params.batch_size)
    items = []
    for part in ("dev", "eval"):
        files = {task: paths.task_items(task, part) for task in TASKS}
        limit = study_items if part == "eval" else None
        base = {"oracle": task_frame(pair, oracle, files, limit)}
        if part == "eval":
            base["source"] = task_frame(pair, pair.router(mode="source", batch_size=params.batch_size),
                                        files, limit)
        for name, router in routers.items():
            frame = task_frame(pair, router, files, limit)
            scores = Scorer(router.handoff, disagree).scores(list(frame.tokens), measured(params, disagree),
                                                             params.batch_size)
            items.append(item_rows(part, name, frame, base, scores))
    prompts, stored = read_prompts(paths.EVAL_PROMPTS), load_artifact(paths.ORACLE_OUTPUTS)[0]
    rows = []
    for name, router in routers.items():
        frame = evaluate(router, prompts, stored, progress=False).prompt_rows
        contexts = [context for context, _ in prompts]
        scores = Scorer(router.handoff, disagree).scores(contexts, measured(params, disagree), params.batch_size)
        rows.append(frame[["prompt", "first_agree", "rollout_agree", "horizon", MARGINS]].assign(
            map=name, changed=frame.first_agree == 0, **{column(s): v.numpy() for s, v in scores.items()}))
    return pd.concat(items, ignore_index=True), pd.concat(rows, ignore_index=True)


def request_times(handoff: Handoff, disagree, params: SelectiveParams, probe: Probe | None) -> dict[str, float]:
    """Per-request milliseconds at `params.length` tokens: target prefill, handoff, and each score's extra (its
    scorer's whole path less the handoff's)."""
    row = measure(handoff, [params.length], params.warmup, params.repeats, memory=False, progress=False)[0]
    ids = torch.randint(0, handoff.decoder.config.vocab_size, (1, params.length),
                        generator=torch.Generator().manual_seed(params.seed)).to(handoff.device)
    scorer, context = Scorer(handoff, disagree, probe), [ids[0].tolist()]
    handoff_ms = 1e3 * median_seconds(lambda: handoff_first_token(handoff, ids), params.repeats, handoff.device)
    times = {"target_ms": row["target_ms"], "handoff_ms": row["handoff_ms"]}
    for score in params.scores:
        for _ in range(params.warmup):
            scorer.scores(context, [score], 1)
        whole = 1e3 * median_seconds(lambda: scorer.scores(context, [score], 1), params.repeats, handoff.device)
        times[f"{score}_ms"] = max(whole - handoff_ms, 0.0)
    return times


def bound_costs(params: SelectiveParams, loaded: tuple, handoff: Handoff, disagree) -> dict[str, float]:
    """Multiply-adds per request at the bound pair's shapes: target prefill, the handoff, and each score's extra
    (`disagree`: a second linear map of the larger k of its two); `loaded`: the pair's own (source, target) configs."""
    source, target = bound_configs(params.bound_pair, loaded)
    mapper = handoff.mapper
    macs = mapper_macs_per_token(source, target, mapper.k, mapper.family, mapper.width)
    second_k = max(other.mapper.k for other in disagree) if disagree else 1
    second = mapper_macs_per_token(source, target, second_k, "linear")
    costs = {"target": target_prefill_macs(target, params.length),
             "handoff": sum(handoff_macs(source, target, macs, params.length).values())}
    return costs | {score: score_macs(score, source, target, second, params.length, probe_features(disagree))
                    for score in params.scores}


def chosen_row(dev: pd.DataFrame, items: pd.DataFrame, prompts: pd.DataFrame, score: str,
               params: SelectiveParams, measure: MeasureParams, costs: dict) -> dict:
    """The threshold chosen on the dev items for `params.target_retention`, and what it gave on the eval part
    (paired bootstrap 95% intervals), the effective speedup measured and bounded."""
    column = f"score_{score}"
    threshold = gating.choose_threshold(dev[column], lambda fallback: gating.item_quality(dev, fallback)["retention"],
                                        params.target_retention)
    fallback, prompt_fallback = items[column].to_numpy() > threshold, prompts[column].to_numpy() > threshold
    iters, seed = measure.bootstrap
    frames = {name: items[["task", "item"]].assign(**{METRIC: values}) for name, values in
              (("gated", gating.gated(items, fallback)), ("oracle", items.oracle), ("source", items.source))}
    rate = paired_bootstrap(fallback, np.zeros(len(fallback)), iters, seed)
    kept = retention_interval(frames, "gated", METRIC, iters, seed)
    closed = gap_closure_interval(frames, "gated", METRIC, iters, seed)
    first = paired_bootstrap(np.where(prompt_fallback, 1, prompts.first_agree), np.zeros(len(prompts)), iters, seed)
    row = {"threshold": threshold, "dev_fallback_rate": float((dev[column] > threshold).mean()),
           "fallback_rate": rate["diff"], "fallback_rate_low": rate["low"], "fallback_rate_high": rate["high"],
           "retention": kept["retention"], "retention_low": kept["low"], "retention_high": kept["high"],
           "gap_closure": closed["gap_closure"], "gap_closure_low": closed["low"], "gap_closure_high": closed["high"],
           "prompt_fallback_rate": float(prompt_fallback.mean()), "next_token_top1": first["diff"],
           "next_token_top1_low": first["low"], "next_token_top1_high": first["high"],
           "rollout_agreement": gating.prompt_quality(prompts, prompt_fallback)["rollout_agreement"]}
    row.update(confident_row(prompts, prompt_fallback, iters, seed))
    row["speedup"] = gating.effective_speedup(costs["target_ms"], costs["handoff_ms"], costs[f"{score}_ms"],
                                              row["fallback_rate"])
    row["speedup_bound"] = gating.effective_speedup(costs["target"], costs["handoff"], costs[score],
                                                    row["fallback_rate"])
    return row


def confident_row(prompts: pd.DataFrame, fallback: np.ndarray, iters: int, seed: int) -> dict:
    """The gated system's top-1 over the prompts where the oracle is sure (column `confident`), with a bootstrap 95%
    interval; None for each where there is none."""
    sure = prompts.confident.to_numpy(bool)
    if not sure.any():
        return dict.fromkeys(["confident_top1", "confident_top1_low", "confident_top1_high"])
    top1 = paired_bootstrap(gating.gated_first(prompts, fallback)[sure], np.zeros(int(sure.sum())), iters, seed)
    return {"confident_top1": top1["diff"], "confident_top1_low": top1["low"], "confident_top1_high": top1["high"]}


def ungated(ev: pd.DataFrame, pr: pd.DataFrame, file: str, iters: int, seed: int) -> dict:
    """A map's facts without a gate: its quality and the share of requests where it changes the decision."""
    kept = np.zeros(len(pr), bool)
    return {**gating.item_quality(ev, np.zeros(len(ev), bool)), **gating.prompt_quality(pr, kept),
            **confident_row(pr, kept, iters, seed), "changed_items": float(ev.changed.mean()),
            "changed_prompts": float(pr.changed.mean()), "items": len(ev), "prompts": len(pr),
            "changed_item_count": int(ev.changed.sum()), "confident_prompts": int(pr.confident.sum()), "file": file}


def summarize(items: pd.DataFrame, prompts: pd.DataFrame, params: SelectiveParams, costs: dict,
              measure: MeasureParams) -> tuple[dict, pd.DataFrame]:
    """metrics/selective.json (per map: ungated quality, per score AUROC and the chosen threshold's row) and the
    curves (map, score, requests: items or prompts, fallback_rate, quality)."""
    margin = measure.confident_margin
    rates = np.linspace(0, 1, params.rates + 1)
    metrics: dict = {"target_retention": params.target_retention, "confident_margin": margin, "length": params.length,
                     **({"probe_l2": params.probe_l2, "probe_folds": params.probe_folds}
                        if "probe" in params.scores else {}),
                     "bound_pair": params.bound_pair, "maps": {}}
    curves = []
    for name in params.maps:
        dev, ev, pr = (frame[frame["map"] == name].reset_index(drop=True)
                       for frame in (items[items.part == "dev"], items[items.part == "eval"], prompts))
        pr["confident"] = confident_prompts(pr, margin)
        references = {"items": gating.reference_scores(ev.changed, params.seed),
                      "prompts": gating.reference_scores(pr.changed, params.seed)}
        facts = {**ungated(ev, pr, params.maps[name], *measure.bootstrap),
                 **{key: round(value, 4) for key, value in costs[name].items()}, "scores": {}}
        for score in [*params.scores, *REFERENCES]:
            for kind, frame, quality in (("items", ev, gating.item_quality), ("prompts", pr, gating.prompt_quality)):
                values = frame[f"score_{score}"] if score in params.scores else references[kind][score]
                curves += [{"map": name, "score": score, "requests": kind, **row}
                           for row in gating.curve(frame, values, quality, rates, params.seed)]
            if score in params.scores:
                low, high = gating.auroc_interval(ev[f"score_{score}"], ev.changed, *measure.bootstrap)
                facts["scores"][score] = {"auroc_items": gating.auroc(ev[f"score_{score}"], ev.changed),
                                          "auroc_items_low": low, "auroc_items_high": high,
                                          "auroc_prompts": gating.auroc(pr[f"score_{score}"], pr.changed),
                                          **chosen_row(dev, ev, pr, score, params, measure, costs[name])}
        metrics["maps"][name] = facts
    return metrics, pd.DataFrame(curves)


def run(params: SelectiveParams, models: ModelsParams, device: str, measure: MeasureParams) -> dict:
    """Every map of `params.maps` scored, gated and timed, measured as `measure` says."""
    require_controls_passed()
    pair = Pair.load(models, device)
    routers = {name: pair.router(mode="mapped", mapper=file, batch_size=params.batch_size)
               for name, file in params.maps.items()}
    two_maps = "disagree" in params.scores or ("probe" in params.scores and len(params.disagree) == 2)
    # the disagree score's two maps: handoffs the scorer reads beside each map's, never a route of their own
    disagree = tuple(pair.router(mode="mapped", mapper=file).handoff
                     for file in params.disagree) if two_maps else None
    items, prompts = score_requests(pair, params, routers, disagree, measure.study_items)
    probes = add_probe(items, prompts, params, disagree) if "probe" in params.scores else {}
    costs = {name: request_times(router.handoff, disagree, params, probes.get(name))
             | bound_costs(params, pair.configs, router.handoff, disagree) for name, router in routers.items()}
    metrics, curves = summarize(items, prompts, params, costs, measure)
    for name, probe in probes.items():
        metrics["maps"][name]["probe_fit"] = asdict(probe)  # its features, standardisation and weights
    with atomic_dir(paths.SELECTIVE) as staging:
        items.to_parquet(staging / "items.parquet", index=False)
        prompts.to_parquet(staging / "prompts.parquet", index=False)
        curves.to_parquet(staging / paths.SELECTIVE_CURVES.name, index=False)
    return metrics


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.selective", __doc__, argv)
    params, models = load_section(SelectiveParams, "selective"), load_section(ModelsParams, "models")
    machine, measure = load_section(MachineParams, "machine"), load_section(MeasureParams, "measure")
    with stage_ranks(machine.torch_device, threads=machine.threads) as stage:
        stage.write_metrics(paths.SELECTIVE_METRICS, run(params, models, stage.device, measure))


if __name__ == "__main__":
    entry(main)
