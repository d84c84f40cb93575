"""One evaluation (`measure.evaluation`): timed and untimed give the same figures, a timed prompt's time to first
token is the whole first step, the oracle's outputs come from the same single pass, the figures nest, and the
refusals name what is missing."""
import json
import time

import pytest
import torch
from helpers import periodic_batch

from pipeline.kv.handoff import Handoff
from pipeline.kv.pair import Pair
from pipeline.kv.router import Router
from pipeline.measure.compare import FIRST_STEP_PARTS
from pipeline.measure.evaluation import Evaluation, OracleStore, PromptFigures, TaskFigures, evaluate
from pipeline.measure.prompt_metrics import PROMPT_METRICS
from pipeline.store.ranks import Ranks

MARGIN = 0.2
STORE = OracleStore(top_k=64, horizon=5)
# the metrics these rows measure: none that needs a column only some rows hold (attention outputs, recall positions)
FIGURES = [name for name, metric in PROMPT_METRICS.items() if metric.needs is None]


@pytest.fixture(scope="module")
def pair(periodic_model) -> Pair:
    return Pair.of(periodic_model, periodic_model)


@pytest.fixture(scope="module")
def prompts():
    """Prompts of different lengths (12..33 tokens), so the untimed batches pad their prefixes."""
    sequences = periodic_batch(torch.Generator().manual_seed(5), 8, 44, 32).tolist()
    return [(s[: 12 + 3 * i], s[12 + 3 * i : 22 + 3 * i]) for i, s in enumerate(sequences)]


@pytest.fixture(scope="module")
def stored(pair, prompts) -> dict:
    return evaluate(Router(pair.handoff("oracle"), batch_size=4), prompts, margin=MARGIN, store=STORE,
                    progress=False).oracle


def same_figures(timed: PromptFigures, untimed: PromptFigures) -> None:
    assert (timed.n, timed.tokens, timed.counts) == (untimed.n, untimed.tokens, untimed.counts)
    for name in FIGURES:
        assert timed.metrics[name] == pytest.approx(untimed.metrics[name], abs=1e-5), name


@pytest.mark.parametrize("mode", ["oracle", "direct", "shuffled"])
def test_a_timed_evaluation_gives_the_untimed_figures_within_float_tolerance(pair, prompts, stored, mode):
    router = Router(Handoff(pair.target, None if mode == "oracle" else pair.source, mode), batch_size=4)
    untimed = evaluate(router, prompts, stored, margin=MARGIN, progress=False)
    timed = evaluate(router, prompts, stored, margin=MARGIN, timed=True, progress=False)
    same_figures(timed.prompts, untimed.prompts)
    for column in ("first_agree", "agree", "rollout_agree"):
        assert timed.prompt_rows[column].tolist() == untimed.prompt_rows[column].tolist(), column
    assert timed.prompt_rows.nll.tolist() == pytest.approx(untimed.prompt_rows.nll.tolist(), abs=1e-4)
    assert untimed.prompts.ttft is None and "ttft_ms" not in untimed.prompt_rows
    assert set(timed.prompt_rows.way) == {mode}  # every context hands off: each prompt's route is the mode's own


def test_the_timed_oracle_stores_from_one_pass_what_the_batched_oracle_stores(pair, prompts, stored):
    timed = evaluate(Router(pair.handoff("oracle"), batch_size=4), prompts, margin=MARGIN, store=STORE, timed=True,
                     progress=False)
    assert torch.equal(timed.oracle["top_ids"], stored["top_ids"]) and torch.equal(timed.oracle["greedy"],
                                                                                  stored["greedy"])
    assert torch.allclose(timed.oracle["top_logprobs"], stored["top_logprobs"], atol=1e-4)
    assert torch.equal(timed.oracle["lengths"], stored["lengths"])
    assert timed.prompts.metrics["next_token_top1"] == 1.0 and timed.prompts.metrics["agreement"] == 1.0


def test_ttft_is_positive_its_parts_tile_it_and_the_oracles_is_a_prefills_order_of_magnitude(pair, prompts, stored):
    oracle = evaluate(Router(pair.handoff("oracle"), batch_size=4), prompts, stored, margin=MARGIN, timed=True,
                      warmup=1, progress=False)
    rows = oracle.prompt_rows
    assert (rows.ttft_ms > 0).all() and (rows.prefill_ms > 0).all() and (rows.step_ms > 0).all()
    assert (rows.map_ms == 0).all()  # the oracle maps nothing
    parts = rows[[f"{part}_ms" for part in FIRST_STEP_PARTS]].sum(axis=1)
    assert parts.tolist() == pytest.approx(rows.ttft_ms.tolist(), rel=1e-9)
    # the oracle's first step is its own prefill and one step: between a tenth of the fastest of five timed prefills
    # and ten times the slowest (a busy machine stretches a run, never shortens it; one slow run flaked the bound)
    model, (context, _) = pair.target, prompts[-1]
    ids = torch.tensor([context])
    runs = []
    with torch.no_grad():
        model(input_ids=ids)  # warm
        for _ in range(5):
            start = time.perf_counter()
            model(input_ids=ids)
            runs.append(1e3 * (time.perf_counter() - start))
    assert 0.1 * min(runs) < float(rows.ttft_ms.iloc[-1]) < 10 * max(runs) + 50
    figures = oracle.prompts.ttft
    assert figures["median_ms"] > 0 and set(figures["parts_ms"]) == set(FIRST_STEP_PARTS)


def test_the_figures_nest_prompts_and_tasks_and_round_every_float():
    prompts = PromptFigures(10, 160, {"perplexity": 3.14159265, "confident_top1": None},
                            {"confident_prompts": 4, "confident_prompt_share": 0.4}, [0.9876543, 0.5])
    tasks = {"piqa": TaskFigures(0.123456789, 0.5, 0.01, 0.02, 200, {"recall": {"acc": 0.3333333, "acc_norm": 0.5}})}
    figures = Evaluation(prompts, tasks, None, None).figures(digits=4)
    assert figures == {
        "prompts": {"n": 10, "tokens": 160, "perplexity": 3.1416, "confident_top1": None, "confident_prompts": 4,
                    "confident_prompt_share": 0.4, "attention_cosine_layers": [0.9877, 0.5]},
        "tasks": {"piqa": {"acc": 0.1235, "acc_norm": 0.5, "acc_stderr": 0.01, "acc_norm_stderr": 0.02, "n": 200,
                           "kinds": {"recall": {"acc": 0.3333, "acc_norm": 0.5}}}}}
    assert json.loads(json.dumps(figures)) == figures
    oracle = Evaluation(PromptFigures(10, 160, {"perplexity": 2.0}, {}), {}, None, None)
    assert Evaluation(prompts, {}, None, None).figures(oracle=oracle)["prompts"]["ppl_ratio"] == 1.570796


def test_what_an_evaluation_cannot_do_is_refused_naming_the_fix(pair, prompts, stored):
    router = Router(pair.handoff("direct"), batch_size=4)
    with pytest.raises(ValueError, match="say how to store them"):
        evaluate(router, prompts, margin=MARGIN)
    with pytest.raises(ValueError, match="a timed evaluation runs in one process"):
        evaluate(router, prompts, stored, margin=MARGIN, timed=True, ranks=Ranks(0, 2, 0))
    with pytest.raises(ValueError, match="oracle outputs must come from the oracle handoff"):
        evaluate(router, prompts, margin=MARGIN, store=STORE, timed=True)
    with pytest.raises(ValueError, match="a timed evaluation reads no attention outputs"):
        evaluate(router, prompts, margin=MARGIN, store=STORE._replace(attention=True), timed=True)
