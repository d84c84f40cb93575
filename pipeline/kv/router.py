"""The one request path: a handoff and the route each request takes through it (`kv.routes`).
"""
from __future__ import annotations

from typing import Sequence

from pipeline.kv.handoff import ClockHook, FirstStep, Handoff
from pipeline.kv.kvcache import padded_prefixes
from pipeline.kv.routes import Route, way, ways
from pipeline.kv.scoring import score_continuations, truncate

TokenPair = tuple[Sequence[int], Sequence[int]]  # (context, continuation) token ids


class Router:
    def __init__(self, handoff: Handoff, batch_size: int = 16):
        self.handoff, self.batch_size = handoff, batch_size

    @classmethod
    def of(cls, pair, request, batch_size: int = 16) -> "Router":
        """The router of a face's `request` (`kv.request.Transfer`) between `pair`'s models."""
        return pair.router(request.mode, request.mapper, repair=request.repair, keep=request.keep,
                           share=request.share, speculative=request.speculative,
                           shuffle_seed=request.shuffle_seed or 0, batch_size=batch_size)

    @property
    def repaired(self) -> bool:
        return not self.handoff.repair.empty

    def ways(self) -> list[str]:
        return ways(self.handoff.mode, self.repaired)

    def route(self, context: Sequence[int]) -> Route:
        return Route(way(self.handoff.mode, self.repaired, context))

    def first_step(self, context: Sequence[int], clock: ClockHook | None = None) -> tuple[FirstStep, Route]:
        """One context's first step, batch 1, and its route."""
        return self.handoff.first_step(padded_prefixes([context]), clock), self.route(context)

    def score(self, requests: Sequence[TokenPair], max_length: int, progress: bool = True
              ) -> tuple[list[tuple[float, bool]], list[Route]]:
        """Each request's (sum of log-probabilities, greedy) and route; contexts truncated once to `max_length`."""
        trimmed = [(truncate(context, continuation, max_length), continuation) for context, continuation in requests]
        results = score_continuations(self.handoff, trimmed, self.batch_size, max_length=max_length,
                                      progress=progress)
        return results, [self.route(context) for context, _ in trimmed]

    def record(self) -> dict:
        """The handoff as results record it."""
        transfer = self.handoff.mode if self.handoff.share is None else f"{self.handoff.mode}:{self.handoff.share:g}"
        return {"transfer": transfer, "repair": str(self.handoff.repair)}
