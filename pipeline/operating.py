"""Stage `operating@<n>`: the handoff where prefill costs, quality and time to first token from the same prompts.

    python -m pipeline.operating <n>

At prompt length n the oracle and every variant of the `operating` section are evaluated on data/long/'s eval prompts
and pass-key items, each prompt alone at batch 1, timed in the pass that scores it. Per variant: figures against the
oracle, pass-key match and recall, measured speedup over the oracle and the FLOP bound at n. One request under two
names (the `selected` repair where select chose a listed setting, and their truncated prompts) is evaluated once.
"""
from __future__ import annotations

from dataclasses import dataclass

from tqdm.auto import tqdm

from pipeline.kv.flops import (
    handoff_macs,
    repair_budget,
    source_alone_bound,
    source_scores_macs,
    speculative_bound,
    speedup_bound,
    target_prefill_macs,
    truncated_bound,
)
from pipeline.kv.modes import MODES
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.router import Router
from pipeline.kv.speculative import SpeculativeParams, chosen_lookahead
from pipeline.measure.compare import read_prompts
from pipeline.measure.evaluation import OracleStore, PromptFigures, evaluate, rounded
from pipeline.measure.retrieval import RECALL, recall_positions, retrieval_rows, retrieval_summary
from pipeline.schema.evaluate import SELECTED, selected_repair
from pipeline.schema.operating import OperatingParams
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, read_table, require_controls_passed
from pipeline.store.cli import entry, parser
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, load_section, load_value
from pipeline.store.ranks import stage_ranks

pd = lazy("pandas")


@dataclass
class Variant:
    router: Router
    bound: float


def baseline_bound(name: str, source, target, length: int) -> float:
    """By what the mode's entry reads: the source alone against the target's prefill; else the target's step, after
    the source's prefill where its cache is handed over (`direct`), after nothing where not (`zero`)."""
    mode = MODES[name]
    if not mode.reads.target:
        return source_alone_bound(source, target, length)
    parts = handoff_macs(source, target, 0, length)  # no map, no repair
    return target_prefill_macs(target, length) / (parts["step"] + (parts["source"] if mode.hands_over else 0))


def variants(params: OperatingParams, pair: Pair, length: int, lookahead: SpeculativeParams | None
             ) -> dict[str, Variant]:
    """Every variant but the oracle, in the report's order; `lookahead`: select's look-ahead settings."""
    source, target = pair.source.config, pair.target.config
    out = {}
    for name in params.baselines:
        out[name] = Variant(pair.router(mode=name), baseline_bound(name, source, target, length))
    for name, path in params.maps.items():
        router = pair.router(mode="mapped", mapper=path)
        out[name] = Variant(router, speedup_bound(source, target, router.handoff.mapper.macs_per_token(), length))
    repaired, budgets = repaired_variants(params, pair, length, lookahead)
    out.update(repaired)
    for name, share in params.speculative_variants().items():
        router = pair.router(mode="speculative", share=share, speculative=lookahead)
        out[name] = Variant(router, speculative_bound(source, target, lookahead, share, length))
    if params.truncated:
        routers = {}  # keep -> its router: two repairs of one budget truncate alike, and are evaluated once
        for name, budget in budgets.items():  # a repair dearer than the target's prefill: the whole prompt kept
            keep = min(budget, 1.0)
            if keep not in routers:
                routers[keep] = pair.router(mode="oracle", keep=keep)
            out[f"truncated_{name}"] = Variant(routers[keep], truncated_bound(target, keep, length))
    return out


def repaired_variants(params: OperatingParams, pair: Pair, length: int, lookahead: SpeculativeParams | None
                      ) -> tuple[dict[str, Variant], dict[str, float]]:
    """Each repaired variant at `length`, and its budget (its multiply-adds over the target's prefill)."""
    source, target = pair.source.config, pair.target.config
    out, budgets, routers = {}, {}, {}
    for name, repaired in params.repaired.items():
        if repaired.repair == SELECTED:  # with the look-ahead settings select scored it under, where it reads them
            setting, reads = selected_repair(f"operating.repaired.{name}")
        else:
            setting = Repair.parse(repaired.repair)
            reads = lookahead if setting.reads_source else None
        # one request under two names (`selected` where select chose a listed setting) shares one router
        request = (params.maps[repaired.map], str(setting), None if reads is None else reads.model_dump_json())
        if request not in routers:  # built only once: a handoff with a map file loads and binds the map
            routers[request] = pair.router(mode="mapped", mapper=params.maps[repaired.map], repair=setting,
                                           speculative=reads)
        router = routers[request]
        scores = source_scores_macs(source, setting, reads, length)
        out[name] = Variant(router, speedup_bound(source, target, router.handoff.mapper.macs_per_token(), length,
                                                  setting, scores))
        budgets[name] = repair_budget(target, setting, length, scores)
    return out, budgets


def run(params: OperatingParams, pair: Pair, length: int, margin: float, prompts: pd.DataFrame,
        items: pd.DataFrame | None, out, lookahead: SpeculativeParams | None = None) -> dict:
    """Every variant's figures at `length` on the data/long/ eval `prompts` and pass-key `items`; rows under `out`."""
    texts = read_prompts(prompts)
    keys = [] if items is None else read_prompts(items)
    recall = [recall_positions(p, c, params.recall_ngram) for p, c in texts]
    store = OracleStore(params.top_k, params.horizon)
    metrics: dict = {"length": length, "prompts": len(texts), "retrieval_items": len(keys),
                     "recall_ngram": params.recall_ngram, "variants": {}}
    oracle_router = pair.router(mode="oracle")
    oracle = evaluate(oracle_router, texts, store=store, margin=margin, timed=True, warmup=1, progress=False)
    oracle_keys = evaluate(oracle_router, keys, store=store, timed=True, progress=False) if keys else None
    reference = retrieval_rows(items, oracle_keys.prompt_rows.greedy) if keys else None
    everything = {"oracle": Variant(oracle_router, 1.0), **variants(params, pair, length, lookahead)}
    evaluated = {id(oracle_router): (oracle, oracle_keys)}  # a router's evaluations: variants sharing it, once
    for name, variant in tqdm(everything.items(), desc=f"operating n={length}", unit="variant"):
        if id(variant.router) not in evaluated:
            evaluated[id(variant.router)] = (
                evaluate(variant.router, texts, oracle.oracle, margin=margin, timed=True, warmup=1, progress=False),
                evaluate(variant.router, keys, oracle_keys.oracle, timed=True, progress=False) if keys else None)
        on_texts, on_keys = evaluated[id(variant.router)]
        rows = on_texts.prompt_rows.assign(**{RECALL: recall})
        figures = PromptFigures.of(rows, margin).as_json(oracle.prompts)
        figures.update(speedup_measured=float(oracle.prompt_rows.ttft_ms.mean() / rows.ttft_ms.mean()),
                       flop_bound=float(variant.bound))
        tables = {"prompts": rows}
        if keys:
            tables["retrieval"] = retrieval_rows(items, on_keys.prompt_rows.greedy, on_keys.prompt_rows.get("selected"))
            figures["retrieval"] = retrieval_summary(tables["retrieval"], reference)
        (out / name).mkdir(parents=True, exist_ok=True)
        for table, frame in tables.items():
            frame.to_parquet(out / name / f"{table}.parquet", index=False)
        metrics["variants"][name] = rounded(figures, 6)
    return metrics


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.operating", __doc__)
    cli.add_argument("length", type=int, help="the operating length: one of operating.lengths")
    length = cli.parse_args(argv).length
    params, models = load_section(OperatingParams, "operating"), load_section(ModelsParams, "models")
    if length not in params.lengths:
        raise ParamError(f"pipeline.operating: {length} is not one of operating.lengths ({params.lengths})")
    machine = load_section(MachineParams, "machine")
    margin = load_value(float, "measure.confident_margin")  # check_params holds it within [0, 1]
    lookahead = chosen_lookahead(paths.LOOKAHEAD)
    require_controls_passed()
    prompts = read_table(paths.long_part("eval", length))
    retrieval = paths.long_part("retrieval", length)
    items = read_table(retrieval) if retrieval.is_file() else None
    with stage_ranks(machine.torch_device, threads=machine.threads) as stage:
        pair = Pair.load(models, stage.device)
        with atomic_dir(paths.operating_rows(length)) as staging:
            metrics = run(params, pair, length, margin, prompts, items, staging, lookahead)
        stage.write_metrics(paths.operating_metrics(length), metrics)


if __name__ == "__main__":
    entry(main)
