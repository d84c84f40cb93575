"""Stage `operating@<n>`: the handoff where prefill costs, quality and time to first token from the same prompts.

    python -m pipeline.operating <n>

At prompt length n (a key of data.long.lengths) two sets of prompts: the eval prompts of data/long/eval_<n>.parquet
(real text, n tokens and a continuation) and the pass-key items of data/long/retrieval_<n>.parquet (a key stated once
at a seeded depth, asked for at the end). Every variant is evaluated timed on both (`measure.evaluation.evaluate`,
`timed=True`: each prompt alone at batch 1, its time to first token measured in the pass that scores it, its prefix
cache built once for its teacher-forced continuation and its greedy rollout):

    oracle              the target's own prefill: its outputs are stored first, every variant is compared with them
    baselines           operating.baselines (`source`, the source model alone; `zero`, the null cache)
    maps                operating.maps: each map's handoff
    repaired            operating.repaired: a map under a repair setting (`selected`: select's choice)
    gated               operating.gated: a map behind a gate whose threshold sends `fallback` of the select split's
                        prompts at n back to the target's prefill (chosen there, never on the eval prompts)
    truncated_<name>    the truncated prompt (the target's own prefill of the prompt's last tokens) at the budget of
                        each repaired variant at n (operating.truncated)

Per variant: the per-position figures against the oracle (`measure.prompt_metrics`: confident-position agreement,
KL, perplexity ratio, ...), agreement on recall positions against the others (`measure.retrieval`), the pass-key
exact match, the measured speedup (the oracle's mean time to first token over the variant's, on the same eval
prompts) and the FLOP bound at n (`kv.flops`, at the pair's own configs). Writes
eval/operating/<n>/<variant>/{prompts,retrieval}.parquet and metrics/eval/operating/<n>.json.
"""
from __future__ import annotations

import json
import sys

from pipeline.kv.flops import (
    handoff_macs,
    repair_budget,
    source_alone_bound,
    speedup_bound,
    target_prefill_macs,
    truncated_bound,
)
from pipeline.kv.gate import score_macs
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.router import Router
from pipeline.measure.evaluation import OracleStore, evaluate
from pipeline.measure.retrieval import recall_agreement, recall_positions, retrieval_rows, retrieval_summary
from pipeline.schema.operating import SELECTED, OperatingParams
from pipeline.store import paths
from pipeline.store.artifacts import ArtifactError, atomic_dir, require_controls_passed
from pipeline.store.cli import entry, parser
from pipeline.store.lazy import lazy
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, load_section, load_value
from pipeline.store.ranks import stage_ranks

np = lazy("numpy")
pd = lazy("pandas")


def read_prompts(path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, continuation ids) per row of a part of data/long/."""
    frame = pd.read_parquet(path, columns=["prompt_ids", "continuation_ids"])
    return [(list(p), list(c)) for p, c in zip(frame.prompt_ids, frame.continuation_ids)]


def select_contexts(length: int) -> list[list[int]]:
    """The select split's contexts at `length`: each select sequence's first `length` tokens, where it holds them."""
    contexts = [list(ids)[:length] for ids in pd.read_parquet(paths.split("select")).token_ids if len(ids) >= length]
    if not contexts:
        raise ParamError(f"operating.gated: no select sequence holds {length} tokens to choose the gate's threshold "
                         f"on; raise data.sequence_length to at least the operating length")
    return contexts


def selected_repair() -> Repair:
    """The repair setting select chose beside the selected map (models/mapper_repair.json)."""
    if not paths.SELECTED_REPAIR.is_file():
        raise ArtifactError(f"operating.repaired: {paths.SELECTED_REPAIR} not found; run the select stage")
    return Repair.parse(json.loads(paths.SELECTED_REPAIR.read_text())["repair"])


def routers(params: OperatingParams, pair: Pair, length: int) -> dict[str, tuple[Router, float]]:
    """Every variant but the oracle, in the report's order: its router and its FLOP bound at `length`."""
    source, target = pair.source.config, pair.target.config
    prefill = target_prefill_macs(target, length)
    out = {}
    for name in params.baselines:
        bound = (source_alone_bound(source, target, length) if name == "source"
                 else prefill / handoff_macs(source, target, 0, length)["step"])  # nothing to prefill, map or repair
        out[name] = Router(pair.handoff(name)), bound
    handoffs = {name: pair.handoff("mapped", path) for name, path in params.maps.items()}
    for name, handoff in handoffs.items():
        out[name] = Router(handoff), speedup_bound(source, target, handoff.mapper.macs_per_token(), length)
    budgets = {}
    for name, entry in params.repaired.items():
        setting = selected_repair() if entry.repair == SELECTED else Repair.parse(entry.repair)
        handoff = pair.handoff("mapped", params.maps[entry.map], repair=setting)
        out[name] = Router(handoff), speedup_bound(source, target, handoff.mapper.macs_per_token(), length, setting)
        budgets[name] = repair_budget(target, setting, length)
    for name, entry in params.gated.items():
        handoff = handoffs[entry.map]
        gate = pair.gate(handoff, entry.score, float("inf"))
        scores = gate.scorer.scores(select_contexts(length), [entry.score])[entry.score]
        gate.threshold = float(np.quantile(scores.numpy(), 1 - entry.fallback))
        cost = (sum(handoff_macs(source, target, handoff.mapper.macs_per_token(), length).values())
                + score_macs(entry.score, source, target, 0, length))
        out[name] = Router(handoff, gate), (cost, prefill)  # the bound waits for the measured fallback share
    if params.truncated:
        for name, budget in budgets.items():
            out[f"truncated_{name}"] = Router(pair.handoff("oracle", keep=budget)), truncated_bound(target, budget,
                                                                                                     length)
    return out


def run(params: OperatingParams, pair: Pair, length: int, margin: float) -> dict:
    """The study at `length`: every variant's figures (metrics/eval/operating/<n>.json) and rows."""
    require_controls_passed()
    prompts = read_prompts(paths.long_part("eval", length))
    items = pd.read_parquet(paths.long_part("retrieval", length)) if paths.long_part("retrieval", length).is_file() \
        else None
    retrieval = [] if items is None else [(list(p), list(c)) for p, c in zip(items.prompt_ids, items.continuation_ids)]
    recall = [recall_positions(p, c, params.recall_ngram) for p, c in prompts]
    store = OracleStore(params.top_k, params.horizon)
    folder = paths.operating_rows(length)
    metrics: dict = {"length": length, "prompts": len(prompts), "retrieval_items": len(retrieval),
                     "recall_ngram": params.recall_ngram, "variants": {}}
    with atomic_dir(folder) as staging:
        oracle_router = Router(pair.handoff("oracle"))
        oracle = evaluate(oracle_router, prompts, store=store, margin=margin, timed=True, warmup=1)
        oracle_items = evaluate(oracle_router, retrieval, store=store, timed=True) if retrieval else None
        variants = {"oracle": (oracle_router, 1.0), **routers(params, pair, length)}
        for name, (router, bound) in variants.items():
            if name == "oracle":
                evaluation, on_items = oracle, oracle_items
            else:
                evaluation = evaluate(router, prompts, oracle.oracle, margin=margin, timed=True, warmup=1)
                on_items = evaluate(router, retrieval, oracle_items.oracle, timed=True) if retrieval else None
            rows = evaluation.prompt_rows.assign(recall_by_position=recall)
            figures = evaluation.figures(oracle=oracle)["prompts"]
            speedup = oracle.prompt_rows.ttft_ms.mean() / rows.ttft_ms.mean()
            if isinstance(bound, tuple):  # a gate: its measured fallback share decides its cost
                cost, prefill = bound
                share = float((rows.way == "fell back").mean())
                bound = prefill / (cost + share * prefill)
                figures["fallback_share"] = share
            entry = {**figures, **recall_agreement(rows.agree_by_position, rows.recall_by_position),
                     "speedup_measured": float(speedup), "flop_bound": float(bound)}
            write = {"prompts": rows}
            if on_items is not None:
                found = retrieval_rows(items, on_items.prompt_rows.greedy)
                entry["retrieval"] = retrieval_summary(found, retrieval_rows(items, oracle_items.prompt_rows.greedy))
                write["retrieval"] = found
            for table, frame in write.items():
                path = staging / name / f"{table}.parquet"
                path.parent.mkdir(parents=True, exist_ok=True)
                frame.to_parquet(path, index=False)
            metrics["variants"][name] = entry
    return metrics


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.operating", __doc__)
    cli.add_argument("length", type=int, help="the operating length: a key of data.long.lengths")
    length = cli.parse_args(sys.argv[1:] if argv is None else argv).length
    params, models = load_section(OperatingParams, "operating"), load_section(ModelsParams, "models")
    if length not in params.lengths:
        raise ParamError(f"pipeline.operating: {length} is not one of operating.lengths ({params.lengths})")
    margin = load_value(float, "report.confident_margin")  # check_params holds it within [0, 1]
    with stage_ranks(models.torch_device, threads=params.threads) as stage:
        pair = Pair.load(models, stage.device)
        stage.write_metrics(paths.operating_metrics(length), run(params, pair, length, margin))


if __name__ == "__main__":
    entry(main)
