"""Repair: after the map, the target recomputes part of the prefix cache of c[0..P-1] before its first step, in order:

    1. exact_layers n   the target's own keys/values of layers 0..n-1 over the whole prefix: layers 0..n-2 in
                        full, then only the input norm and K/V projections of layer n-1 (n = 1: the embedding's
                        K/V alone); no logits
    2. sink s           the target's own prefill of c[0..s-1], every layer
    3. tokens rho       round(rho x (P - s)) of the remaining tokens c[s..P-1], chosen by a selector
                        (`kv.selectors`), recomputed in one forward of the decoder body: each at its own position,
                        seeing the cache of the tokens before it (mapped, or recomputed in the same forward)

Known answers: exact_layers = L, sink = P and rho = 1 each give the oracle's cache within float rounding; the empty
setting returns the cache untouched. String form: `none`, `layers:1`, `sink:4+tokens:0.1:attention`,
`tokens:0.1:key_norm@2`; parts joined by `+` in any order, applied in the order above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.kv.selectors import POLICIES, SELECTORS, Selector
from pipeline.store.cli import Refusal
from pipeline.store.params import ParamError

REPAIR_FORM = "none, or parts joined by '+': layers:N, sink:S, tokens:RHO:POLICY (POLICY: " + "|".join(
    name + ("" if selector.parameter is None else f"[@N: {selector.parameter}]") for name, selector in SELECTORS.items()
) + ")"


class RepairError(Refusal, ValueError):
    """A malformed repair setting: one line naming the bad part."""


@dataclass(frozen=True)
class Repair:
    """One repair setting; the empty one (`Repair()`, `none`) leaves the cache as it is."""

    exact_layers: int = 0
    sink: int = 0
    tokens: float = 0.0  # rho: the fraction of the prefix tokens after the sink
    select_by: str = "recency"
    argument: int | float | None = None  # the policy's own parameter (`POLICY@VALUE`), None where it takes none

    def __post_init__(self):
        if self.exact_layers < 0 or self.sink < 0:
            raise RepairError(f"repair {self}: exact layers and sink are counts >= 0")
        if not 0.0 <= self.tokens <= 1.0:
            raise RepairError(f"repair tokens:{self.tokens:g}: the fraction must be in [0, 1]")
        problem = self.selector.refusal(self.argument, None)
        if problem:
            raise RepairError(f"repair {self}: {problem}")

    @classmethod
    def parse(cls, text: str) -> Repair:
        text = str(text).strip()
        if text in ("", "none"):
            return cls()
        fields: dict = {}
        for part in text.split("+"):
            name, *values = part.strip().split(":")
            key = {"layers": "exact_layers", "sink": "sink", "tokens": "tokens"}.get(name)
            if key is None or key in fields or len(values) != (2 if key == "tokens" else 1):
                raise RepairError(f"repair {text!r}: bad part {part!r} (form: {REPAIR_FORM})")
            try:
                if key == "tokens":
                    name, at, argument = values[1].partition("@")
                    fields["tokens"], fields["select_by"] = float(values[0]), name
                    if name not in POLICIES or not math.isfinite(fields["tokens"]):
                        raise ValueError
                    if at:
                        fields["argument"] = SELECTORS[name].read(argument)
                else:
                    fields[key] = int(values[0])
            except ValueError:
                raise RepairError(f"repair {text!r}: bad part {part!r} (form: {REPAIR_FORM})") from None
        return cls(**fields)

    def __str__(self) -> str:
        parts = ([f"layers:{self.exact_layers}"] if self.exact_layers else []) + (
            [f"sink:{self.sink}"] if self.sink else []) + (
            [f"tokens:{self.tokens:g}:{self.policy}"] if self.tokens else [])
        return "+".join(parts) or "none"

    @property
    def policy(self) -> str:
        """The token choice as the string form writes it: `POLICY[@VALUE]`."""
        return self.select_by + ("" if self.argument is None else f"@{self.argument:g}")

    @property
    def selector(self) -> Selector:
        return SELECTORS[self.select_by]

    def policy_refusal(self, layers: int) -> str | None:
        """Why the token policy cannot read a target of `layers` decoder layers (`key_norm@N` past them), or None."""
        return self.selector.refusal(self.argument, layers) if self.tokens else None

    @property
    def empty(self) -> bool:
        return not (self.exact_layers or self.sink or self.tokens)

    @property
    def reads_source(self) -> bool:
        """Its token policy ranks by the source's look-ahead scores."""
        return bool(self.tokens) and self.selector.reads_source

    def chosen(self, length: int) -> int:
        """Tokens the `tokens` part recomputes in a prefix of `length` (after the sink)."""
        return math.floor(self.tokens * max(length - self.sink, 0) + 0.5)


def parse_grid(texts: list[str], key: str, why_none: str) -> list[Repair]:
    """A declared list of settings (params' `key`): each parsed, none named twice, `none` among them (`why_none` says
    what it is there for)."""
    settings = []
    for text in texts:
        try:
            settings.append(Repair.parse(text))
        except RepairError as error:
            raise ParamError(f"{key}: {error}") from None
    if len({str(setting) for setting in settings}) != len(settings):
        raise ParamError(f"{key}: a setting is named twice (compare their canonical forms); drop one")
    if "none" not in texts:
        raise ParamError(f"{key}: add `none`, {why_none}")
    return settings
