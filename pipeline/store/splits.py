"""The study's data by name: sequence splits, task parts and tasks, and what keeps them apart.

Every row of every split carries a `doc_id` and a `content_hash`; `check_disjoint` refuses two splits that
share either, so nothing fitted or selected on is ever evaluated on.
"""
from __future__ import annotations

import hashlib

from pipeline.store.cli import Refusal
from pipeline.store.lazy import lazy

pd = lazy("pandas")

SEQUENCE_SPLITS = ("fit", "select", "eval")  # token sequences: fit the maps, select one, evaluate it
TASK_PARTS = ("dev", "eval")  # task items: dev scores the pair alone, eval every variant
TASKS = ("hellaswag", "piqa")
ITEM_KINDS = ("recall", "gist", "knowledge")  # the tiny world marks each task item with one (column `kind`)


class OverlapError(Refusal, ValueError):
    pass


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_disjoint(frames: dict[str, pd.DataFrame]) -> None:
    """Raise OverlapError if any document id or content hash appears in two of the frames."""
    for column in ("doc_id", "content_hash"):
        seen: dict[str, str] = {}
        for name, frame in frames.items():
            if column not in frame:
                raise ValueError(f"frame {name!r} has no {column!r} column; cannot check disjointness")
            for value in frame[column].unique():
                if value in seen:
                    raise OverlapError(f"{column} {value!r} is in both {seen[value]!r} and {name!r}: "
                                       "the splits overlap; regenerate them from distinct streams")
                seen[value] = name
