"""The study's data by name: sequence splits, task parts and tasks, and what keeps them apart: every row carries a
`doc_id` and a `content_hash`, and `check_disjoint` refuses two splits that share either.
"""
from __future__ import annotations

import hashlib
import re

from pipeline.store.cli import Refusal
from pipeline.store.lazy import lazy

pd = lazy("pandas")

SEQUENCE_SPLITS = ("fit", "select", "eval")  # token sequences: fit the maps, select one, evaluate it
TASK_PARTS = ("dev", "eval")  # task items: dev scores the pair alone, eval every variant
TASKS = ("hellaswag", "piqa")
ITEM_KINDS = ("recall", "gist", "knowledge")  # the tiny world marks each task item with one (column `kind`)


WINDOW = re.compile(r"/(?:w|key)\d+$")  # a later window or a pass-key item of a document: <doc_id>/w<k>, /key<i>


class OverlapError(Refusal, ValueError):
    pass


def document(doc_id: str) -> str:
    """The document a sequence row comes from: its doc_id without a window's or a pass-key item's suffix."""
    return WINDOW.sub("", doc_id)


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_disjoint(frames: dict[str, pd.DataFrame], documents: dict[str, list[str]] | None = None) -> None:
    """Refuse a doc_id or content hash in two frames, or a document in two groups of `documents` (group -> names of
    frames whose windows may share documents)."""
    if documents:
        _disjoint({group: pd.concat([frames[name][["doc_id"]] for name in names]).assign(
            document=lambda frame: frame.doc_id.map(document)) for group, names in documents.items()}, ("document",))
    _disjoint(frames, ("doc_id", "content_hash"))


def _disjoint(frames: dict[str, pd.DataFrame], columns: tuple[str, ...]) -> None:
    for column in columns:
        seen: dict[str, str] = {}
        for name, frame in frames.items():
            for value in frame[column].unique():
                if value in seen:
                    raise OverlapError(f"{column} {value!r} is in both {seen[value]!r} and {name!r}: "
                                       "the splits overlap; regenerate them from distinct streams")
                seen[value] = name
