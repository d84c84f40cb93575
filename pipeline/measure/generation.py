"""One mode's continuation of a prompt, as `generate` shows it: decoded through its router (the way its gate sends it,
scored and timed), streamed as its tokens come, its route in words and where it departs from the oracle's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from pipeline.kv.decode import generate
from pipeline.kv.router import Router
from pipeline.kv.routes import EMPTY_PREFIX, FELL_BACK, REPAIRED, SENTENCES, way


@dataclass
class Generation:
    """One mode's continuation of one prompt."""

    mode: str
    tokens: list[int]
    ttft_ms: float  # cache built, prompt[-1] read, first token picked
    score: float | None = None  # a gated mode's score of the prompt
    fell_back: bool = False  # a gated mode continued from the target's own prefill
    score_ms: float = 0.0  # a gated mode's scoring (its own source prefill, map and first step)
    route: str = ""  # how its cache came (`route_text`)


def departure(tokens: Sequence[int], oracle: Sequence[int]) -> int | None:
    """The first new-token index where `tokens` leaves `oracle`'s (one stopping earlier departs where it stops);
    None when they are the same."""
    for index, (token, reference) in enumerate(zip(tokens, oracle)):
        if token != reference:
            return index
    return None if len(tokens) == len(oracle) else min(len(tokens), len(oracle))


def route_text(router: Router, prompt: Sequence[int], score: float | None, fell_back: bool,
               repaired: list[tuple[int, float]]) -> str:
    """How a mode's cache of `prompt` came, in words; `repaired`: this continuation's repair-log (tokens, seconds)."""
    handoff, gate = router.handoff, router.gate
    taken = way(handoff.mode, router.repaired, prompt, fell_back)
    if taken == FELL_BACK and score > gate.threshold:
        return f"{SENTENCES[FELL_BACK]}: {gate.score} {score:.4g} > threshold {gate.threshold:g}"
    if taken == FELL_BACK:  # at threshold -inf every prompt falls back, whatever its score (-inf at one token)
        alone = " (a one-token prompt: no handoff to score)" if len(prompt) < 2 else ""
        return f"{SENTENCES[FELL_BACK]}: threshold -inf sends every prompt there{alone}"
    if taken == EMPTY_PREFIX:
        return SENTENCES[EMPTY_PREFIX]
    if taken == REPAIRED and repaired:
        tokens, seconds = (sum(column) for column in zip(*repaired))
        layers = handoff.repair.exact_layers
        exact = "" if not layers else "layer 0 exact, " if layers == 1 else f"layers 0-{layers - 1} exact, "
        return f"repaired {handoff.repair}: {exact}{tokens} tokens recomputed in {1000 * seconds:.1f} ms"
    return handoff.mode


def warm_up(routers: dict[str, Router], prompt: Sequence[int]) -> None:
    """One untimed token of each mode and one scoring of each gate, so the first prompt's times exclude lazy
    initialisation (the first cached step, the first map)."""
    for router in routers.values():
        generate(router.handoff, prompt, 1)
        if router.gate is not None:  # the gate itself, not the router: a routed prompt's decision is memoised
            router.gate.route([list(prompt)], batch_size=1)


class Stream:
    """Prints a mode's text as its tokens come, writing only the decoded text's new end (a token whose bytes are not
    a whole character yet waits for the next)."""

    def __init__(self, tokenizer, mode: str, width: int, out):
        self.tokenizer, self.out, self.shown = tokenizer, out, ""
        out.write(f"{mode:<{width}} | ")
        out.flush()

    def __call__(self, tokens: list[int]) -> None:
        text = self.tokenizer.decode(tokens)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[len(self.shown):].replace("\n", "\\n"))
        self.out.flush()
        self.shown = text

    def close(self) -> None:
        self.out.write("\n")
        self.out.flush()


def continued(router: Router, prompt: Sequence[int], max_new_tokens: int, stop, temperature: float, seed: int,
              stream: "Stream") -> Generation:
    """Decoded, streamed, by the handoff the router sends `prompt` to (under a gate, scored and the scoring timed)."""
    handoff, start = router.handoff, time.perf_counter()
    [(serving, taken)] = router.routed([list(prompt)])
    score_ms = 1000 * (time.perf_counter() - start) if router.gate is not None else 0.0
    score, fell_back = taken.score, taken.way == FELL_BACK
    logged = len(handoff.repaired.log)
    tokens, ttft_ms = generate(serving, prompt, max_new_tokens, stop, temperature, seed, stream)
    stream.close()
    text = route_text(router, prompt, score, fell_back, handoff.repaired.log[logged:])
    return Generation(handoff.mode, tokens, ttft_ms, score, fell_back, score_ms, text)
