"""A variant against the oracle on held-out prompts: one row per prompt; `measure.prompt_metrics` gives the figures.
The oracle's outputs are stored once, compactly (per continuation position its top-K log-probabilities and ids, K >=
vocabulary keeping the whole distribution, and its greedy rollout), and every variant is compared with that copy."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from pipeline.kv.decode import greedy_rollout, read_after, teacher_forced
from pipeline.kv.handoff import Handoff
from pipeline.kv.router import Router
from pipeline.measure.confident import MARGINS, PROBABILITIES, oracle_margin, oracle_probability
from pipeline.measure.timing import Stopwatch
from pipeline.store.artifacts import read_table
from pipeline.store.lazy import lazy
from pipeline.store.ranks import ONE_PROCESS, Ranks

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")
F = lazy("torch.nn.functional")

Prompt = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


def read_prompts(table: str | Path | pd.DataFrame) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, continuation_ids) per row of a sequence table: a frame, or a file read (data/eval.parquet)."""
    frame = read_table(table, columns=["prompt_ids", "continuation_ids"]) if isinstance(table, (str, Path)) else table
    return [(list(p), list(c)) for p, c in zip(frame.prompt_ids, frame.continuation_ids)]


def oracle_outputs(handoff: Handoff, prompts: list[Prompt], top_k: int, horizon: int, batch_size: int,
                   progress: bool = True, ranks: Ranks = ONE_PROCESS, attention: bool = False) -> dict:
    """top_ids/top_logprobs (N, M, K), lengths (N,), greedy (N, horizon), with `attention` a list of (L_t, m, hidden);
    each rank runs every N-th batch, and every rank gets the whole outputs."""
    stored, k = empty_oracle(handoff, prompts, top_k, horizon)
    outputs: list = [None] * len(prompts)
    starts = _my_batches(len(prompts), batch_size, ranks)
    bar = tqdm(total=len(prompts), desc="oracle", unit="prompt", disable=not progress or not ranks.main)
    for start in starts:
        batch = prompts[start : start + batch_size]
        captured = [] if attention else None
        for i, logprobs in enumerate(teacher_forced(handoff, batch, captured), start):
            if attention:
                outputs[i] = captured[i - start]  # (L_t, m, hidden)
            values, ids = logprobs.topk(k, dim=-1)  # (m, K)
            stored["top_ids"][i, : len(ids)], stored["top_logprobs"][i, : len(ids)] = ids.cpu(), values.cpu()
        stored["greedy"][start : start + len(batch)] = greedy_rollout(handoff, [c for c, _ in batch], horizon).cpu()
        bar.update(len(batch))
    bar.close()
    if ranks.size > 1:  # each batch's rows from the rank that ran it
        whole = [stored[name] for name in ("top_ids", "top_logprobs", "greedy")]
        per_rank = ranks.all_gather((starts, *whole, outputs))
        for rank_starts, *tensors, rank_outputs in per_rank:
            for start in rank_starts:
                rows = slice(start, start + batch_size)
                for mine, part in zip(whole, tensors):
                    mine[rows] = part[rows]
                outputs[rows] = rank_outputs[rows]
    if attention:
        stored["attention"] = outputs
    return stored


def empty_oracle(handoff: Handoff, prompts: list[Prompt], top_k: int, horizon: int) -> tuple[dict, int]:
    """`oracle_outputs`' tensors before any prompt is read, and K (top_k, at most the vocabulary)."""
    if handoff.mode != "oracle":
        raise ValueError("oracle outputs must come from the oracle handoff")
    width = max(len(cont) for _, cont in prompts)
    k = min(top_k, handoff.decoder.config.vocab_size)
    return {"top_ids": torch.zeros(len(prompts), width, k, dtype=torch.int64),
            "top_logprobs": torch.full((len(prompts), width, k), float("-inf")),
            "lengths": torch.tensor([len(cont) for _, cont in prompts]),
            "greedy": torch.zeros(len(prompts), horizon, dtype=torch.int64)}, k


def _my_batches(count: int, batch_size: int, ranks: Ranks) -> list[int]:
    starts = list(range(0, count, batch_size))
    return [starts[i] for i in ranks.share(len(starts))]


def _kl_on_top(oracle_logprobs: torch.Tensor, oracle_ids: torch.Tensor, variant_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(oracle || variant) per position (m,), on the oracle's top-K tokens plus one bucket for the rest of the
    vocabulary: exact when K covers the vocabulary, otherwise a lower bound of the full KL."""
    p = oracle_logprobs.exp()  # (m, K)
    q_logprobs = variant_logprobs.gather(-1, oracle_ids)  # (m, K)
    p_rest = (1 - p.sum(-1)).clamp_min(0.0)  # (m,)
    q_rest = (1 - q_logprobs.exp().sum(-1)).clamp_min(1e-12)
    top = (p * (oracle_logprobs - q_logprobs)).sum(-1)
    rest = torch.where(p_rest > 1e-9, p_rest * (p_rest.clamp_min(1e-12).log() - q_rest.log()), torch.zeros_like(p_rest))
    return (top + rest).clamp_min(0.0)


def variant_rows(handoff: Handoff, prompts: list[Prompt], oracle: dict, batch_size: int,
                 progress: bool = True, ranks: Ranks = ONE_PROCESS) -> pd.DataFrame | None:
    """One row per prompt against the oracle, gathered on rank 0 in prompt order; None on the other ranks."""
    horizon = oracle["greedy"].shape[1]
    attention = "attention" in oracle
    rows = []
    bar = tqdm(total=len(prompts), desc=f"compare ({handoff.mode})", unit="prompt",
               disable=not progress or not ranks.main)
    for start in _my_batches(len(prompts), batch_size, ranks):
        batch = [(handoff.context(context), continuation)  # as the handoff reads it (the truncated prompt's tail)
                 for context, continuation in prompts[start : start + batch_size]]
        rollouts = greedy_rollout(handoff, [c for c, _ in batch], horizon).cpu()  # (B, horizon)
        captured = [] if attention else None
        for i, (logprobs, (_, continuation), rollout) in enumerate(zip(teacher_forced(handoff, batch, captured),
                                                                       batch, rollouts), start):
            rows.append(prompt_row(i, logprobs, continuation, rollout, oracle,
                                   captured[i - start] if attention else None))
        bar.update(len(batch))
    bar.close()
    per_rank = ranks.gather(rows)
    if per_rank is None:
        return None
    return pd.DataFrame(sorted((row for part in per_rank for row in part), key=lambda row: row["prompt"]))


def prompt_row(index: int, logprobs: torch.Tensor, continuation: Sequence[int], rollout: torch.Tensor,
               oracle: dict, attention: torch.Tensor | None = None) -> dict:
    """`logprobs` (m, V), `rollout` (horizon,), `attention` (L_t, m, hidden). A position agrees where the teacher-forced
    argmax is the oracle's; `first_agree` is V0's column, the first position after the prompt."""
    m = len(continuation)
    logprobs = logprobs.cpu()  # (m, V)
    targets = torch.tensor(list(continuation))
    choice = logprobs.argmax(-1)  # (m,)
    agree = (choice == oracle["top_ids"][index, :m, 0]).to(torch.int64)  # (m,)
    kl = _kl_on_top(oracle["top_logprobs"][index, :m], oracle["top_ids"][index, :m], logprobs)
    row = {
        "prompt": index,
        "tokens": m,
        "nll": float(-logprobs.gather(-1, targets[:, None]).sum()),
        "first_agree": int(agree[0]),
        "agree": int(agree.sum()),
        "agree_by_position": agree.tolist(),
        MARGINS: oracle_margin(oracle["top_logprobs"][index, :m]).tolist(),
        PROBABILITIES: oracle_probability(oracle["top_logprobs"][index, :m], oracle["top_ids"][index, :m],
                                          choice).tolist(),
        "kl": float(kl.sum()),
        "rollout_agree": int((rollout.cpu() == oracle["greedy"][index]).sum()),
        "horizon": oracle["greedy"].shape[1],
    }
    if attention is not None:  # per target layer, the sum over positions of the cosine with the oracle's
        cosine = F.cosine_similarity(attention.float(), oracle["attention"][index].float(), dim=-1)
        row["attention_cosine"] = cosine.sum(-1).tolist()  # (L_t,) sums over the m positions
    return row


# a timed first step's parts (`Router.first_step`), in the order they run
FIRST_STEP_PARTS = ("prefill", "scores", "map", "repair", "sparse", "step")


def timed_reads(router: Router, prompts: list[Prompt], horizon: int, warmup: int, progress: bool = True):
    """Per prompt, run alone through `router`'s first step: its logprobs (m, V), greedy rollout (horizon,) and timed
    columns (greedy tokens, way, `ttft_ms`, each part's ms, `selected`); the first prompt runs `warmup` times first."""
    for _ in range(warmup if prompts else 0):
        router.first_step(router.handoff.context(prompts[0][0]))
    for context, continuation in tqdm(prompts, desc=f"timed ({router.handoff.mode})", unit="prompt",
                                      disable=not progress):
        clock = Stopwatch(router.handoff.device)
        first, route = router.first_step(router.handoff.context(context), clock)
        times = {"ttft_ms": clock.total_ms(), **dict.fromkeys((f"{part}_ms" for part in FIRST_STEP_PARTS), 0.0)}
        times.update({f"{part}_ms": ms for part, ms in clock.parts_ms().items()})
        logprobs, rollout = read_after(router.handoff, first, continuation, horizon)
        columns = {"greedy": rollout.cpu().tolist(), "way": route.way, **times}
        if first.selected is not None:  # the prefix positions the target computed by a choice
            columns["selected"] = [p for p in first.selected[0].tolist() if p >= 0]
        yield logprobs, rollout, columns


def timed_rows(router: Router, prompts: list[Prompt], oracle: dict, warmup: int, progress: bool = True
               ) -> pd.DataFrame:
    reads = timed_reads(router, prompts, oracle["greedy"].shape[1], warmup, progress)
    return pd.DataFrame([{**prompt_row(i, logprobs, prompts[i][1], rollout, oracle), **columns}
                         for i, (logprobs, rollout, columns) in enumerate(reads)])


def timed_oracle(router: Router, prompts: list[Prompt], top_k: int, horizon: int, warmup: int,
                 progress: bool = True) -> tuple[dict, pd.DataFrame]:
    """`oracle_outputs`' form and its timed rows against them from one timed pass: each prefix prefilled once."""
    stored, k = empty_oracle(router.handoff, prompts, top_k, horizon)
    reads = list(timed_reads(router, prompts, horizon, warmup, progress))
    for i, (logprobs, rollout, _) in enumerate(reads):
        values, ids = logprobs.topk(k, dim=-1)  # (m, K)
        stored["top_ids"][i, : len(ids)], stored["top_logprobs"][i, : len(ids)] = ids.cpu(), values.cpu()
        stored["greedy"][i] = rollout.cpu()
    return stored, pd.DataFrame([{**prompt_row(i, logprobs, prompts[i][1], rollout, stored), **columns}
                                 for i, (logprobs, rollout, columns) in enumerate(reads)])
