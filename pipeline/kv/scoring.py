"""Scoring continuations after a handoff, as lm-eval's log-likelihood requests ask: the cache of c[0..n-2] built once
per context; one step row reads c[n-1] e0[0..] c[n-1] e1[0..] ..., each continuation masked from the others and at
positions n-1, n, ... again, so each scores as if alone.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from pipeline.kv.decode import packed_logprobs, prefilled_packed_logprobs
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import Layers, padded_prefixes
from pipeline.store.lazy import lazy

torch = lazy("torch")


def truncate(context: Sequence[int], continuation: Sequence[int], max_length: int) -> list[int]:
    """The context left after lm-eval's left-truncation of context + continuation to max_length + 1 tokens."""
    if len(continuation) > max_length:
        raise ValueError(f"continuation of {len(continuation)} tokens exceeds the model's {max_length}")
    whole = (list(context) + list(continuation))[-(max_length + 1) :]
    return whole[: len(whole) - len(continuation)]


def score_continuations(
    handoff: Handoff,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = True,
) -> list[tuple[float, bool]]:
    """Sum of log-probabilities of each continuation given its context, and whether it is the greedy one. Requests
    sharing a context share one prefix cache; contexts whose continuations together fit `batch_size` share a forward:

        prefixes  c0[0..n0-2] pad pad        step rows  c0[n0-1] e0[0] ...  c0[n0-1] e1[0] ...  pad
                  c1[0..n1-2 ...........]               c1[n1-1] e2[0] ...  c1[n1-1] e3[0] ...
                                                        positions n-1, n, ... again for every continuation

    At `batch_size` 1 a mode whose decoding model prefills the prompt itself reads the prefix and its one packed
    row in one forward."""
    max_length = max_length or handoff.decoder.config.max_position_embeddings
    ordered = shared_contexts(requests, max_length, handoff.context)
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc=f"scoring ({handoff.mode})", unit="req", disable=not progress)
    for chunk in fill(ordered, lambda group: len(group[1]), batch_size):
        contexts = [context for context, _ in chunk]
        prefixes = padded_prefixes(contexts)  # (B, P) right-padded, (B,) prefix lengths
        if len(chunk) == 1:  # one context, however many continuations: as few rows as its window allows
            forwards = [[part] for part in fill(chunk[0][1], lambda index: len(requests[index][1]), max_length)]
        else:
            forwards = [[indices for _, indices in chunk]]
        layers, prefix_ids = None, None
        if batch_size == 1 and len(forwards) == 1 and handoff.kind.reads.own and prefixes.ids.shape[1]:
            prefix_ids = prefixes.ids  # (1, P): prefilled in the step's own forward
        else:
            layers = handoff.prefix_layers(prefixes.ids, prefixes.padded_lengths)
        for forward in forwards:
            rows = [[(index, requests[index][1]) for index in indices] for indices in forward]
            for index, result in score_rows(handoff, layers, contexts, rows, prefixes.lengths, prefixes.padded,
                                            prefix_ids).items():
                results[index] = result
            bar.update(sum(len(members) for members in rows))
    bar.close()
    return results  # type: ignore[return-value]


def shared_contexts(requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int,
                    reads: Callable[[Sequence[int]], list[int]] = list) -> list[tuple[tuple[int, ...], list[int]]]:
    """Each context (as the handoff `reads` it) with the indices of the requests sharing it, the largest first (as
    lm-eval does); a request longer than `max_length` + 1 tokens is refused, not cut again."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (context, continuation) in enumerate(requests):
        if not continuation:
            raise ValueError(f"request {index} has an empty continuation")
        if len(context) + len(continuation) > max_length + 1:
            raise ValueError(f"request {index} has {len(context) + len(continuation)} tokens, past the window of "
                             f"{max_length} + 1: truncate its context first (`truncate`, as Router.score does)")
        groups.setdefault(tuple(reads(context)), []).append(index)
    if any(not context for context in groups):
        raise ValueError("a request has an empty context; lm-eval prepends the prefix token to avoid this")

    return sorted(groups.items(), key=lambda group: len(group[0]) + sum(len(requests[i][1]) for i in group[1]),
                  reverse=True)


def score_rows(handoff: Handoff, layers: Layers | None, contexts: Sequence[Sequence[int]],
               rows: list[list[tuple[int, Sequence[int]]]], lengths: torch.Tensor, padded: bool,
               prefix_ids: torch.Tensor | None = None) -> dict[int, tuple[float, bool]]:
    """One forward of each context's (index, continuation) members packed into its step row, after `layers` or the
    decoding model's own prefill of `prefix_ids` (1, P): per request index, (sum of log-probabilities, greedy)."""
    steps, targets, segments, offsets = packed_rows(contexts, rows)  # each (B, L)
    if prefix_ids is not None:
        logprobs = prefilled_packed_logprobs(handoff, prefix_ids, steps, segments, offsets)  # (1, L, V)
    elif (segments[:, 0] == segments.max(dim=1).values).all():  # one continuation a row: a plain step
        logprobs = handoff.step_logprobs(layers, steps, handoff.lengths_read(lengths, padded))  # (B, L, V)
    else:
        logprobs = packed_logprobs(handoff, layers, steps, lengths, segments, offsets)  # (B, L, V)
    targets = targets.to(logprobs.device)
    scored = logprobs.gather(-1, targets[..., None])[..., 0]  # (B, L): log p of each continuation token
    greedy = (logprobs.argmax(-1) == targets).cpu()  # (B, L)
    scored = scored.cpu()
    results = {}
    for row, members in enumerate(rows):
        at = 0
        for index, continuation in members:
            span = slice(at, at + len(continuation))
            results[index] = (scored[row, span].sum().item(), bool(greedy[row, span].all()))
            at += len(continuation)
    return results


def packed_rows(contexts: Sequence[Sequence[int]], rows: list[list[tuple[int, Sequence[int]]]]
                ) -> tuple[torch.Tensor, ...]:
    """Per context, its members packed into one right-padded row, all (B, L): the tokens c[n-1] e[0] ... e[m-2] per
    member, the tokens e[0] ... e[m-1] they score, the member's segment (-1 on padding), each token's offset in it."""
    width = max(sum(len(continuation) for _, continuation in members) for members in rows)
    columns: tuple[list, ...] = ([], [], [], [])  # steps, targets, segments, offsets: a padded list per row
    for row, members in enumerate(rows):
        steps = [token for _, continuation in members for token in (contexts[row][-1], *continuation[:-1])]
        targets = [token for _, continuation in members for token in continuation]
        segments = [segment for segment, (_, continuation) in enumerate(members) for _ in continuation]
        offsets = [offset for _, continuation in members for offset in range(len(continuation))]
        pad = width - len(steps)
        for column, values, fill in zip(columns, (steps, targets, segments, offsets), (0, 0, -1, 0)):
            column.append(values + [fill] * pad)
    return tuple(torch.tensor(column, dtype=torch.long) for column in columns)


def fill(items: Sequence, size: Callable[[Any], int], budget: int) -> list[list]:
    """`items` in consecutive parts whose sizes sum to at most `budget`; an item larger than that gets a part alone."""
    parts: list[list] = []
    used = 0
    for item in items:
        if not parts or used + size(item) > budget:
            parts.append([])
            used = 0
        parts[-1].append(item)
        used += size(item)
    return parts
