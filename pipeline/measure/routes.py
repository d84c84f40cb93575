"""Every request's route through the `kv-transfer` lm-eval model: how each of lm-eval's requests was served, counted
per task, gathered over ranks and written into lm-eval's logged samples.

A route's way is the handoff's own mode (`mapped`, `direct`, ...; REPAIRED under a repair setting), FELL_BACK to the
target's prefill (a gate's score above its threshold) or EMPTY_PREFIX (a one-token context hands nothing off: the
target reads it alone, as the oracle would). No way is `refused`: a request the handoff cannot serve (a sequence
longer than a sliding window) stops the run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from pipeline.store.lazy import lazy

lm_eval_evaluator = lazy("lm_eval.evaluator")

FELL_BACK, EMPTY_PREFIX, REPAIRED = "fell_back", "empty_prefix", "repaired"  # ways besides the handoff's mode


@dataclass(frozen=True)
class Route:
    """How one request was served: its `way` and, under a gate, its context's score."""

    way: str
    score: float | None = None


class Ledger:
    """The route of every lm-eval Instance a model served: (task, doc id, request index) -> (route, repr of its
    args). A request seen twice (lm-eval pads a rank's requests with copies of its last one) is one entry."""

    def __init__(self):
        self.entries: dict[tuple, tuple[Route, str]] = {}

    def record(self, request, route: Route) -> None:
        """`route` as the route of lm-eval's Instance `request`."""
        self.entries[(request.task_name, request.doc_id, request.idx)] = (route, repr(request.args))

    def counts(self, ways: list[str]) -> dict[str, dict[str, int]]:
        """Per task: its requests and how many went each way (every one of `ways`, zeros included: a gate that never
        fires shows `fell_back: 0`)."""
        counts: dict[str, dict[str, int]] = {}
        for (task, _, _), (route, _) in self.entries.items():
            tally = counts.setdefault(str(task), dict.fromkeys(["requests", *ways], 0))
            tally["requests"] += 1
            tally[route.way] = tally.get(route.way, 0) + 1
        return dict(sorted(counts.items()))

    def gather(self, ranks) -> None:
        """Every rank's entries merged into rank 0's (`ranks`: a `store.ranks.Ranks`; lm-eval gives each rank every
        N-th document); in one process, nothing changes."""
        ledgers = ranks.gather(self.entries)
        if ledgers is not None:
            self.entries = {key: value for entries in ledgers for key, value in entries.items()}

    def mark_samples(self, samples: dict[str, list[dict]], gated: bool) -> None:
        """Each of lm-eval's logged samples (task -> samples) given `route`, one way per request in the order of its
        `arguments` (None for one this model did not see: lm-eval's own cache answered it), and when `gated`
        `gate_score`."""
        by_args = {(str(task), args): route for (task, _, _), (route, args) in self.entries.items()}
        for task, rows in samples.items():
            for sample in rows:
                routes = [by_args.get((task, repr(args))) for args in sample["arguments"]]
                sample["route"] = [None if route is None else route.way for route in routes]
                if gated:
                    sample["gate_score"] = [None if route is None else route.score for route in routes]


def count_lines(setting: str, counts: dict[str, dict[str, int]]) -> list[str]:
    """The counts as the `run` command prints them: one line for the `setting`, one per task."""
    lines = [f"kv-transfer routes ({setting}):"]
    for task, tally in counts.items():
        ways = ", ".join(f"{count} {way}" for way, count in tally.items() if way != "requests")
        lines.append(f"  {task}: {tally['requests']} requests: {ways}")
    return lines


@contextlib.contextmanager
def recording_routes() -> Iterator[list]:
    """While open, lm-eval's `evaluate` of a model that keeps a `ledger` (kv-transfer) is followed by its
    `gather_routes()` on every rank (so rank 0's results, whose config simple_evaluate then fills from the model's
    `get_model_info`, count every rank's requests) and, with logged samples, by marking each sample's routes, before
    lm-eval writes or prints anything. Yields the models evaluated."""
    original, evaluated = lm_eval_evaluator.evaluate, []

    def evaluate(*args, **kwargs):
        results = original(*args, **kwargs)
        lm = kwargs["lm"] if "lm" in kwargs else args[0]
        lm = getattr(lm, "lm", lm)  # lm-eval's CachingLM (--use_cache) wraps the model
        if isinstance(getattr(lm, "ledger", None), Ledger):
            lm.gather_routes()
            if results is not None and "samples" in results:
                lm.ledger.mark_samples(results["samples"], gated=lm.gate is not None)
            evaluated.append(lm)
        return results

    lm_eval_evaluator.evaluate = evaluate
    try:
        yield evaluated
    finally:
        lm_eval_evaluator.evaluate = original
