"""Oracle distributions with near-ties and sure positions, and the rows `measure.compare` stores of a variant against
them: what the confident-agreement measures and their study read."""
from __future__ import annotations

import pandas as pd
import torch

from pipeline.measure.confident import oracle_margin, oracle_probability

VOCAB, TOP_K = 6, 4


def distributions(seed: int, prompts: int = 40, positions: int = 5) -> torch.Tensor:
    """Oracle log-probabilities (N, m, V): every other position a near-tie (the two best 0.41 and 0.39), the others
    sure (0.9 on one token); the best token drawn per position."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.full((prompts, positions, VOCAB), 0.05)
    for i in range(prompts):
        for j in range(positions):
            order = torch.randperm(VOCAB, generator=generator)
            if (i + j) % 2:
                probs[i, j, order[0]], probs[i, j, order[1]] = 0.41, 0.39
                probs[i, j, order[2:]] = 0.2 / (VOCAB - 2)
            else:
                probs[i, j] = 0.1 / (VOCAB - 1)
                probs[i, j, order[0]] = 0.9
    return probs.log()


def rows_of(oracle: torch.Tensor, variant: torch.Tensor) -> pd.DataFrame:
    """`compare.variant_rows`' columns `measure.confident` reads, for a variant's log-probabilities against the
    oracle's stored top-K."""
    top_logprobs, top_ids = oracle.topk(TOP_K, dim=-1)  # (N, m, K)
    rows = []
    for i in range(len(oracle)):
        choice = variant[i].argmax(-1)  # (m,)
        agree = (choice == top_ids[i, :, 0]).to(torch.int64)
        rows.append({"prompt": i, "first_agree": int(agree[0]), "agree_by_position": agree.tolist(),
                     "margin_by_position": oracle_margin(top_logprobs[i]).tolist(),
                     "oracle_prob_by_position": oracle_probability(top_logprobs[i], top_ids[i], choice).tolist()})
    return pd.DataFrame(rows)


def swap_near_ties(oracle: torch.Tensor) -> torch.Tensor:
    """The oracle with its two best tokens swapped wherever their margin is below 0.1."""
    variant = oracle.clone()
    values, ids = oracle.topk(2, dim=-1)  # (N, m, 2)
    tie = (values[..., 0].exp() - values[..., 1].exp()) < 0.1  # (N, m)
    first, second = ids[..., 0][tie], ids[..., 1][tie]
    flat = variant[tie]  # (T, V)
    rows = torch.arange(len(flat))
    flat[rows, first], flat[rows, second] = oracle[tie][rows, second], oracle[tie][rows, first]
    variant[tie] = flat
    return variant
