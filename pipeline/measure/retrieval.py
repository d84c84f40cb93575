"""Long-context measures: pass-key retrieval by greedy decoding (selection recall: did it fail at the handoff's choice
of positions or after?), and agreement where the continuation recalls the prompt, which running-text agreement,
dominated by local context, does not isolate."""
from __future__ import annotations

from typing import Sequence

from pipeline.store.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")

RECALL = "recall_by_position"  # a prompt row's list column: per continuation position, whether it is a recall one


def exact_match(greedy: Sequence[int], answer: Sequence[int]) -> bool:
    return list(greedy[: len(answer)]) == list(answer)


def recall_positions(prompt: Sequence[int], continuation: Sequence[int], n: int) -> list[bool]:
    """Per continuation position (m,): whether the n tokens ending at its token occur together in the prompt (what an
    induction head copies).

        prompt:        ... a b c ... x y
        continuation:  a b c d
                           ^ n = 3: "a b c" occurs in the prompt -> recall; "b c d" does not -> not recall
    """
    prompt, sequence = list(prompt), list(prompt) + list(continuation)
    seen = {tuple(prompt[start : start + n]) for start in range(len(prompt) - n + 1)}
    return [end >= n and tuple(sequence[end - n : end]) in seen
            for end in range(len(prompt) + 1, len(sequence) + 1)]


def recall_agreement(agree_by_position: Sequence[Sequence[int]], recall: Sequence[Sequence[bool]]) -> dict:
    agree = np.concatenate([np.asarray(a, dtype=float) for a in agree_by_position])
    flags = np.concatenate([np.asarray(r, dtype=bool) for r in recall])
    out = {}
    for name, chosen in (("recall", flags), ("other", ~flags)):
        count = int(chosen.sum())
        out[f"{name}_agreement"] = float(agree[chosen].mean()) if count else None
        out[f"{name}_positions"] = count
    return out


def key_positions(prompt: Sequence[int], key: Sequence[int]) -> list[int]:
    prompt, key = list(prompt), list(key)
    starts = [start for start in range(len(prompt) - len(key) + 1) if prompt[start : start + len(key)] == key]
    if len(starts) != 1:
        raise ValueError(f"the key {key} is stated {len(starts)} times in the prompt, not once: a pass-key item states "
                         f"it exactly once (store.haystack)")
    return list(range(starts[0], starts[0] + len(key)))


def needle_selected(selected: Sequence[int], prompt: Sequence[int], key: Sequence[int]) -> bool:
    """Every token of the key is among the positions the target computed by a choice."""
    return set(key_positions(prompt, key)) <= {int(position) for position in selected}


def retrieval_rows(items: pd.DataFrame, greedy: Sequence[Sequence[int]], selected: Sequence | None = None
                   ) -> pd.DataFrame:
    """One row per item: depth, key, whether the greedy tokens retrieved it and, with `selected`, `needle_selected`."""
    exact = [exact_match(tokens, answer) for tokens, answer in zip(greedy, items.continuation_ids)]
    rows = pd.DataFrame({"item": range(len(items)), "depth": items.depth.to_numpy(), "key": items.key.to_numpy(),
                         "exact": exact})
    if selected is not None:
        rows["needle_selected"] = [None if not _chose(chosen) else needle_selected(chosen, prompt, key) for
                                   chosen, prompt, key in zip(selected, items.prompt_ids, items.continuation_ids)]
    return rows


def _chose(selected) -> bool:
    """A list of positions, not the None or NaN of a request that chose none."""
    return selected is not None and not (isinstance(selected, float) and np.isnan(selected))


def retrieval_summary(rows: pd.DataFrame, oracle: pd.DataFrame | None = None) -> dict:
    """Exact-match share overall and per depth; the selection recall over items that chose positions; beside the
    oracle's rows, the share of its score kept (None where it retrieves nothing)."""
    def shares(frame: pd.DataFrame) -> dict:
        return {"exact_match": float(frame.exact.mean()), "n": int(len(frame)),
                "by_depth": {f"{depth:g}": float(part.exact.mean()) for depth, part in frame.groupby("depth")}}

    out = shares(rows)
    chose = rows.needle_selected.dropna() if "needle_selected" in rows else []
    if len(chose):
        out["selection_recall"], out["selection_n"] = float(chose.astype(bool).mean()), int(len(chose))
    if oracle is not None:
        reference = shares(oracle)
        out["of_oracle"] = out["exact_match"] / reference["exact_match"] if reference["exact_match"] else None
        out["of_oracle_by_depth"] = {depth: (out["by_depth"][depth] / value if value else None)
                                     for depth, value in reference["by_depth"].items()}
    return out
