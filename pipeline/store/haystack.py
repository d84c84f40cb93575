"""Pass-key retrieval items: a key stated once at a seeded depth of a real-text haystack, asked for at the end.

    haystack[: at]  needle(key)  haystack[at :]  question    ->  key
    `------------------------ length tokens ---------------'

The needle and question (`RetrievalForm`) are tokenized alone and joined as token ids, so the prompt states exactly
the continuation's ids and is exactly `length` tokens. The haystack is a run of one document's tokens at a seeded
offset; `at` is round(depth x the haystack's length). A key whose ids occur elsewhere in the prompt is drawn again, so
an exact match after the handoff is a retrieval, never a copy of the surrounding text.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from pipeline.store.lazy import lazy
from pipeline.store.splits import content_hash

pd = lazy("pandas")

KEY_TRIES = 100  # redraws of a key whose ids the haystack already holds before the item is refused


@dataclass(frozen=True)
class RetrievalForm:
    """How an item reads: `needle` holds `{key}` (the only place the key is stated), `question` ends the prompt
    right before the key's first token; a key is `digits` random decimal digits; `depths`, each in [0, 1], where
    the needle sits in the haystack."""

    needle: str
    question: str
    digits: int
    depths: tuple[float, ...]


def occurrences(tokens: list[int], part: list[int]) -> int:
    """How many times `part` occurs in `tokens` (overlapping runs counted)."""
    width = len(part)
    return sum(tokens[start : start + width] == part for start in range(len(tokens) - width + 1))


def retrieval_items(documents: list[tuple[str, list[int]]], length: int, count: int, form: RetrievalForm, tokenizer,
                    seed: int) -> pd.DataFrame:
    """`count` items of `length` prompt tokens from `documents` ((doc_id, token ids), taken in turn); `needle_at` is
    the needle's first token in the prompt, `continuation_ids` the key's ids."""
    question = tokenizer.encode(form.question, add_special_tokens=False)
    before, after = (tokenizer.encode(text, add_special_tokens=False) for text in form.needle.split("{key}"))
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        doc_id, ids = documents[index % len(documents)]
        depth = form.depths[index % len(form.depths)]
        for _ in range(KEY_TRIES):
            key = "".join(rng.choice("0123456789") for _ in range(form.digits))
            answer = tokenizer.encode(key, add_special_tokens=False)
            needle = before + answer + after
            size = length - len(needle) - len(question)  # the haystack's tokens
            if size < 1 or len(ids) < size:
                raise ValueError(f"document {doc_id!r} ({len(ids)} tokens) cannot hold a {length}-token item's "
                                 f"haystack ({size} tokens); give longer documents or a shorter length")
            start = rng.randrange(len(ids) - size + 1)
            haystack = ids[start : start + size]
            at = round(depth * size)
            prompt = haystack[:at] + needle + haystack[at:] + question
            if occurrences(prompt, answer) == 1:
                break
        else:
            raise ValueError(f"no key of {form.digits} digits occurs only once in document {doc_id!r}'s haystack "
                             f"after {KEY_TRIES} draws; use more digits")
        rows.append({"doc_id": f"{doc_id}/key{index}", "content_hash": content_hash(f"{doc_id}/key{index}/{key}"),
                     "prompt_ids": prompt, "continuation_ids": answer, "key": key, "depth": depth, "needle_at": at})
    return pd.DataFrame(rows)
