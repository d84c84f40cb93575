"""The one request path: each context's handoff and route. Under a gate (`kv.gate`) a context scored above the
threshold goes to the target's own prefill. Decisions are memoised per context, so a context scored for several
continuations (HellaSwag's four endings, lm-eval's rolling windows) is gated once; one that keeps its map reuses the
prefix cache of the gate's first step, so it is prefilled, mapped and repaired once, with at most a batch held.
"""
from __future__ import annotations

from typing import Sequence

from pipeline.kv.gate import Gate
from pipeline.kv.handoff import ClockHook, FirstStep, Handoff
from pipeline.kv.kvcache import Layers, padded_prefixes
from pipeline.kv.routes import FELL_BACK, Route, hands_off, way, ways
from pipeline.kv.scoring import score_continuations, truncate

TokenPair = tuple[Sequence[int], Sequence[int]]  # (context, continuation) token ids


class Router:
    """Each context's handoff and route, memoised; scoring on the routes."""

    def __init__(self, handoff: Handoff, gate: Gate | None = None, batch_size: int = 16):
        """`batch_size`: contexts a forward when the gate scores them."""
        self.handoff, self.gate, self.batch_size = handoff, gate, batch_size
        self.decisions: dict[tuple[int, ...], tuple[float, bool]] = {}  # gated context -> (score, fell back)

    @classmethod
    def of(cls, pair, request, batch_size: int = 16) -> "Router":
        """The router of a face's `request` (`kv.request.Transfer`) between `pair`'s models (`Pair.router`)."""
        return pair.router(request.mode, request.mapper, repair=request.repair, keep=request.keep,
                           share=request.share, speculative=request.speculative, fallback=request.fallback,
                           threshold=request.threshold, disagree=request.disagree,
                           shuffle_seed=request.shuffle_seed or 0, batch_size=batch_size)

    @property
    def repaired(self) -> bool:
        return not self.handoff.repair.empty

    def ways(self) -> list[str]:
        """Every way this router can send a request, in the order counts list them."""
        return ways(self.handoff.mode, self.repaired, self.gate is not None)

    def routes(self, contexts: Sequence[Sequence[int]], kept: dict[tuple[int, ...], Layers] | None = None
               ) -> list[Route]:
        """Each context's route (its gate's score where gated); `kept`: filled with the prefix cache of each newly
        gated context that keeps its map (the gate's first step of it), for its scoring."""
        if self.gate is not None:
            unseen = list(dict.fromkeys(tuple(c) for c in contexts if tuple(c) not in self.decisions))
            if unseen:
                scores, fallback = self.gate.route(unseen, self.batch_size, kept)
                self.decisions.update(zip(unseen, zip(scores.tolist(), fallback.tolist())))
                for context, fell_back in zip(unseen, fallback.tolist()):
                    if kept is not None and fell_back:
                        kept.pop(context[:-1], None)
        return [self.route(context) for context in contexts]

    def route(self, context: Sequence[int]) -> Route:
        """A context's route, as decided (ungated, or not yet gated: the handoff's own)."""
        score, fell_back = self.decisions.get(tuple(context), (None, False))
        return Route(way(self.handoff.mode, self.repaired, context, fell_back), score)

    def first_step(self, context: Sequence[int], clock: ClockHook | None = None) -> tuple[FirstStep, Route]:
        """One context's first step on its route, batch 1, and the route: under a gate the handoff's first step, its
        score and, where it falls back, the fallback's. `clock` is told the handoff's parts, `gate` after the score,
        `fallback` after each part of the fallback's."""
        prefixes = padded_prefixes([context])
        if self.gate is None or not hands_off(self.handoff.mode, context):
            route = self.routes([context])[0]
            return self.handoff_of(route).first_step(prefixes, clock), route
        first = self.handoff.first_step(prefixes, clock, retain=True)
        score = self.gate.scorer.step_scores(first, [self.gate.score])[self.gate.score]  # (1,)
        fell_back = bool(self.gate.falls_back(score)[0])
        if clock is not None:
            clock("gate")
        self.decisions[tuple(context)] = (float(score[0]), fell_back)
        if fell_back:
            first = self.gate.fallback.first_step(prefixes, None if clock is None else lambda part: clock("fallback"))
        return first, self.route(context)

    def handoff_of(self, route: Route) -> Handoff:
        """The handoff that serves a request of `route`."""
        return self.gate.fallback if route.way == FELL_BACK else self.handoff

    def routed(self, contexts: Sequence[Sequence[int]]) -> list[tuple[Handoff, Route]]:
        """Each context's handoff and route together."""
        return [(self.handoff_of(route), route) for route in self.routes(contexts)]

    def score(self, requests: Sequence[TokenPair], max_length: int, progress: bool = True
              ) -> tuple[list[tuple[float, bool]], list[Route]]:
        """Each request's (sum of log-probabilities, greedy) and route; contexts truncated once to `max_length`."""
        trimmed = [(truncate(context, continuation, max_length), continuation) for context, continuation in requests]
        if self.gate is None:
            return self.scored(trimmed, self.routes([context for context, _ in trimmed]), max_length, progress)
        results: list = [None] * len(trimmed)
        routes: list = [None] * len(trimmed)
        sharing: dict[tuple[int, ...], list[int]] = {}  # each context -> the requests that share it
        for index, (context, _) in enumerate(trimmed):
            sharing.setdefault(tuple(context), []).append(index)
        distinct = list(sharing)
        for start in range(0, len(distinct), self.batch_size):
            members = [index for context in distinct[start : start + self.batch_size] for index in sharing[context]]
            part = [trimmed[index] for index in members]
            kept: dict[tuple[int, ...], Layers] = {}  # this batch's prefix caches from the gate's first steps
            scored, routed = self.scored(part, self.routes([context for context, _ in part], kept), max_length,
                                         progress=False, kept=kept)
            for index, result, route in zip(members, scored, routed):
                results[index], routes[index] = result, route
        return results, routes

    def scored(self, trimmed: Sequence[TokenPair], routes: list[Route], max_length: int, progress: bool,
               kept: dict[tuple[int, ...], Layers] | None = None) -> tuple[list[tuple[float, bool]], list[Route]]:
        """Truncated requests scored on their routes' handoffs (`kept`: prefix caches the handoff built already)."""
        results: list = [None] * len(trimmed)
        for handoff, fell_back in ((self.handoff, False), (self.gate and self.gate.fallback, True)):
            members = [index for index, route in enumerate(routes) if (route.way == FELL_BACK) == fell_back]
            if not members:
                continue
            scored = score_continuations(handoff, [trimmed[index] for index in members], self.batch_size,
                                         max_length=max_length, progress=progress,
                                         kept=None if fell_back else kept)
            for index, result in zip(members, scored):
                results[index] = result
        return results, routes

    def record(self) -> dict:
        """The handoff this router serves, as results record it: mode, repair setting and gate."""
        gate = None if self.gate is None else {"score": self.gate.score, "threshold": self.gate.threshold}
        transfer = self.handoff.mode if self.handoff.share is None else f"{self.handoff.mode}:{self.handoff.share:g}"
        return {"transfer": transfer, "repair": str(self.handoff.repair), "gate": gate}
