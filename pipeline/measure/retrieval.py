"""Long-context measures: pass-key retrieval by greedy decoding, agreement where the continuation recalls the prompt.

Retrieval (`store.haystack` items): the variant's greedy tokens after the prompt, as many as the key has, must be the
key's tokens exactly (`exact_match`); reported per depth of the needle and overall, beside the oracle's own score and
the variant's share of it (the drop where the oracle retrieves and the variant does not).

Recall positions: continuation position j is a recall position when the n tokens ending at its token (the sequence
prompt + continuation, n >= 2) already occur together in the prompt: the token extends an (n-1)-gram the prompt
holds, with the same next token, what an induction head copies. Agreement there against the other positions says
whether information far back in the prompt survived the handoff, which running-text agreement, dominated by local
context, does not.

    prompt:        ... a b c ... x y
    continuation:  a b c d
                       ^ n = 3: "a b c" occurs in the prompt -> recall; "b c d" does not -> not recall
"""
from __future__ import annotations

from typing import Sequence

from pipeline.store.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")

RECALL = "recall_by_position"  # a prompt row's list column: per continuation position, whether it is a recall one


def exact_match(greedy: Sequence[int], answer: Sequence[int]) -> bool:
    """Whether the first len(answer) greedy tokens are the answer's tokens."""
    return list(greedy[: len(answer)]) == list(answer)


def recall_positions(prompt: Sequence[int], continuation: Sequence[int], n: int) -> list[bool]:
    """Per continuation position (m,): the n-gram of prompt + continuation ending at its token occurs in the prompt."""
    if n < 2:
        raise ValueError(f"a recall position extends an n-gram of n >= 2 tokens, got n = {n}")
    prompt, sequence = list(prompt), list(prompt) + list(continuation)
    seen = {tuple(prompt[start : start + n]) for start in range(len(prompt) - n + 1)}
    return [end >= n and tuple(sequence[end - n : end]) in seen
            for end in range(len(prompt) + 1, len(sequence) + 1)]


def recall_agreement(agree_by_position: Sequence[Sequence[int]], recall: Sequence[Sequence[bool]]) -> dict:
    """Agreement with the oracle over the recall positions and over every other position, each with its count (None
    where there is none)."""
    agree = np.concatenate([np.asarray(a, dtype=float) for a in agree_by_position])
    flags = np.concatenate([np.asarray(r, dtype=bool) for r in recall])
    out = {}
    for name, chosen in (("recall", flags), ("other", ~flags)):
        count = int(chosen.sum())
        out[f"{name}_agreement"] = float(agree[chosen].mean()) if count else None
        out[f"{name}_positions"] = count
    return out


def retrieval_rows(items: pd.DataFrame, greedy: Sequence[Sequence[int]]) -> pd.DataFrame:
    """One row per item: its depth, the key, and whether the greedy tokens after its prompt retrieved it."""
    exact = [exact_match(tokens, answer) for tokens, answer in zip(greedy, items.continuation_ids)]
    return pd.DataFrame({"item": range(len(items)), "depth": items.depth.to_numpy(), "key": items.key.to_numpy(),
                         "exact": exact})


def retrieval_summary(rows: pd.DataFrame, oracle: pd.DataFrame | None = None) -> dict:
    """Exact-match share overall and per depth, with n; beside the oracle's rows, the share of the oracle's score kept
    (`of_oracle`, None where the oracle retrieves nothing) overall and per depth."""
    def shares(frame: pd.DataFrame) -> dict:
        return {"exact_match": float(frame.exact.mean()), "n": int(len(frame)),
                "by_depth": {f"{depth:g}": float(part.exact.mean()) for depth, part in frame.groupby("depth")}}

    out = shares(rows)
    if oracle is not None:
        reference = shares(oracle)
        out["of_oracle"] = out["exact_match"] / reference["exact_match"] if reference["exact_match"] else None
        out["of_oracle_by_depth"] = {depth: (out["by_depth"][depth] / value if value else None)
                                     for depth, value in reference["by_depth"].items()}
    return out
