"""One mode's continuation of a prompt as `generate` shows it: streamed, its route, where it leaves the oracle's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipeline.kv.decode import generate
from pipeline.kv.router import Router
from pipeline.kv.routes import EMPTY_PREFIX, REPAIRED, SENTENCES


@dataclass
class Generation:
    mode: str
    tokens: list[int]
    ttft_ms: float  # cache built, prompt[-1] read, first token picked
    route: str = ""  # how its cache came (`route_text`)


def departure(tokens: Sequence[int], oracle: Sequence[int]) -> int | None:
    """The first new-token index where `tokens` leaves `oracle`'s (one stopping earlier departs where it stops);
    None when they are the same."""
    for index, (token, reference) in enumerate(zip(tokens, oracle)):
        if token != reference:
            return index
    return None if len(tokens) == len(oracle) else min(len(tokens), len(oracle))


def route_text(router: Router, prompt: Sequence[int], repaired: list[tuple[int, float]]) -> str:
    """How a mode's cache of `prompt` came, in words; `repaired`: this continuation's repair-log (tokens, seconds)."""
    handoff = router.handoff
    taken = router.route(prompt).way
    if taken == EMPTY_PREFIX:
        return SENTENCES[EMPTY_PREFIX]
    if taken == REPAIRED and repaired:
        tokens, seconds = (sum(column) for column in zip(*repaired))
        layers = handoff.repair.exact_layers
        exact = "" if not layers else "layer 0 exact, " if layers == 1 else f"layers 0-{layers - 1} exact, "
        return f"repaired {handoff.repair}: {exact}{tokens} tokens recomputed in {1000 * seconds:.1f} ms"
    return handoff.mode


def warm_up(routers: dict[str, Router], prompt: Sequence[int]) -> None:
    """One untimed token of each mode, so the first prompt's times exclude lazy initialisation."""
    for router in routers.values():
        generate(router.handoff, prompt, 1)


class Stream:
    """Prints a mode's text as its tokens come (a token not yet a whole character waits for the next)."""

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
    handoff = router.handoff
    logged = len(handoff.repaired.log)
    tokens, ttft_ms = generate(handoff, prompt, max_new_tokens, stop, temperature, seed, stream)
    stream.close()
    return Generation(handoff.mode, tokens, ttft_ms, route_text(router, prompt, handoff.repaired.log[logged:]))
