"""The one list of handoff modes, in the order the contract reports them.

Every other list of modes is derived from `MODES` (the contract's, the baselines below, the request's fields, the
faces' choices, the report's names, the maths' registry, which refuses a declared mode without maths). Adding a mode
is adding its two modules, its declaration beside this one (`kv/modes/<name>.py`) and its maths, the prefix hook
(`kv/modes/maths/<name>.py`), and their two lines: here and in `kv/modes/maths/registry.py`.
"""
from __future__ import annotations

from pipeline.kv import entries
from pipeline.kv.modes import direct, mapped, oracle, shuffled, source, speculative, zero
from pipeline.kv.modes.base import Mode


def register(*modes: Mode) -> dict[str, Mode]:
    """The registry of `modes` by name; anything but a named `Mode` instance is refused."""
    return entries.register(Mode, "modes", modes)


MODES = register(oracle.MODE, zero.MODE, source.MODE, direct.MODE, mapped.MODE, shuffled.MODE, speculative.MODE)
SOURCE_MODES = tuple(name for name, mode in MODES.items() if mode.hands_over)  # the source's cache handed over
OWN_MODES = tuple(name for name, mode in MODES.items() if mode.reads.own)  # the decoding model's own prefill
MAPPER_MODES = tuple(name for name, mode in MODES.items() if mode.reads.map)  # `shuffled` also runs without a map
# the modes without a map or a value: the `evaluate` stage's baselines, in the order it runs them in one process and
# the report lists them (the oracle first: every other variant is compared with its outputs; then by name); each
# writes eval/<variant>/ and metrics/eval/<variant>.json
BASELINES = tuple(sorted((name for name, mode in MODES.items() if not mode.reads.map and mode.parameter is None),
                         key=lambda mode: (mode != "oracle", mode)))


def split_mode(text: str) -> tuple[str, str | None]:
    """A mode as a request writes it, `NAME` or `NAME:VALUE` (`speculative:0.1`, as a repair writes `tokens:0.1`):
    (its name, the text of its value or None)."""
    name, colon, value = str(text).partition(":")
    return name, value if colon else None


def check_mode(name: str, has_source: bool, has_mapper: bool) -> None:
    """Refuse a mode that is unknown or lacks the source or mapper it reads: before any weight is loaded when
    called on names (`kv.pair`), and again by every Handoff on the models themselves."""
    if name not in MODES:
        raise ValueError(f"unknown transfer mode {name!r} (known: {', '.join(MODES)})")
    reason = MODES[name].refusal(has_source, has_mapper)
    if reason:
        raise ValueError(reason)
