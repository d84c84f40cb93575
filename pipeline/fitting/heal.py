"""Healing a pruned sibling by distillation from the target's logits (Minitron, Sheared-LLaMA): every weight of the
sibling trained with AdamW on the mean over tokens of KL(target || sibling) between their next-token distributions
on the healing rows, which neither model has seen in any other role (the fit stream of the corpus).

The target runs once over the healing rows, before the first step (`TopTeacher`): at each position it keeps its
`top_k` largest log-probabilities, their token ids and the log of the mass left over, so every step's work is the
sibling's alone. The loss reads the target's distribution coarsened to those k tokens and one bucket for the rest:

    KL_k = sum_{i in top k} p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest),  p_rest = 1 - sum_top p_i

exact where the target puts no mass outside its top k, and never above the full KL (coarsening a pair of
distributions cannot raise their divergence). The select rows' figures are exact (`Teacher`: the target's final
hidden states kept, its logits rebuilt from them with its LM head). Rows are dealt in seeded epochs, the learning
rate warms up linearly and decays on a cosine to zero at the declared step count, and a wall-clock cap stops
healing at the first step past it (then the run is no longer a function of params alone: `stopped_by` says which
limit ended it).
"""
from __future__ import annotations

import math
import random
import time
from typing import Annotated, NamedTuple

from pydantic import Field
from tqdm.auto import tqdm

from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy
from pipeline.store.params import Count, Params, Positive, PositiveFloat

torch = lazy("torch")
F = lazy("torch.nn.functional")


class Healing(Params):
    """How a sibling is healed: the `sibling` section's healing keys (`schema.sibling.SiblingParams` adds the cut)."""

    steps: Count  # AdamW steps of healing (0: pruned only)
    batch_sequences: Positive  # healing rows per step (and per forward when the target or the select rows are run)
    row_length: Positive  # tokens per healing and ranking row: each calibration window cut into rows this long
    lr: PositiveFloat
    warmup_steps: Count  # linear warmup, then cosine decay to zero at `steps`
    weight_decay: Annotated[float, Field(ge=0)]
    top_k: Positive  # the target's log-probabilities kept per position of the healing rows (the rest: one bucket)
    max_seconds: PositiveFloat  # wall-clock cap of the whole build: healing stops at the first step past it
    curve_every: Positive  # steps between points of the healing curve
    curve_sequences: Positive  # select rows each point of the curve scores (the final figures read them all)
    seed: Count


def cut_rows(windows: list[list[int]], length: int) -> list[list[int]]:
    """Each window cut into consecutive rows of `length` tokens, in order; a window no longer than `length` stays
    whole, and a longer window's tail shorter than `length` is left out (every row of a long window is full)."""
    if length < 1:
        raise ValueError(f"row length {length}: rows hold at least one token")
    rows = []
    for window in windows:
        if len(window) <= length:
            rows.append(list(window))
        else:
            rows.extend(list(window[start:start + length]) for start in range(0, len(window) - length + 1, length))
    return rows


def padded(rows: list[list[int]], indices: list[int]):
    """(input_ids, attention_mask) of the rows at `indices`, right-padded with token 0: (B, T) each."""
    length = max(len(rows[index]) for index in indices)
    ids = torch.zeros(len(indices), length, dtype=torch.long)
    mask = torch.zeros(len(indices), length, dtype=torch.long)
    for line, index in enumerate(indices):
        ids[line, : len(rows[index])] = torch.tensor(rows[index])
        mask[line, : len(rows[index])] = 1
    return ids, mask


class Teacher:
    """The target's final hidden states of each row, computed at first use and kept; `logits` rebuilds its next-token
    logits from them with its LM head."""

    def __init__(self, target, rows: list[list[int]]):
        self.target, self.rows, self.hidden = target, rows, {}

    @no_grad
    def logits(self, indices: list[int]):
        missing = [index for index in indices if index not in self.hidden]
        if missing:
            ids, mask = padded(self.rows, missing)
            body = getattr(self.target, self.target.base_model_prefix)
            states = body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (b, T, hidden)
            for index, state in zip(missing, states):
                self.hidden[index] = state[: len(self.rows[index])].clone()  # (T_row, hidden)
        states = torch.nn.utils.rnn.pad_sequence([self.hidden[index] for index in indices], batch_first=True)
        return self.target.get_output_embeddings()(states)  # (B, T, vocab)


class TopK(NamedTuple):
    """The target's kept distribution at each position of a batch of rows (padded: (B, T, ...))."""

    log_probs: torch.Tensor  # (B, T, k) float32: its top-k log-probabilities
    tokens: torch.Tensor  # (B, T, k) int64: their token ids
    log_rest: torch.Tensor  # (B, T) float32: log of the probability outside its top k


def log_rest(log_probs, tokens):
    """log of the mass of `log_probs` (B, T, V) outside `tokens` (B, T, k): (B, T), exact where it is tiny."""
    return log_probs.scatter(-1, tokens, float("-inf")).logsumexp(-1)


class TopTeacher:
    """The target's kept distribution at every position of every row, computed once, in batches, before healing."""

    def __init__(self, target, rows: list[list[int]], k: int, batch: int):
        self.rows, self.log_probs, self.tokens, self.log_rest = rows, [], [], []
        with torch.no_grad():
            for chunk in tqdm(batches_of(list(range(len(rows))), batch), desc="target's top-k", unit="batch"):
                ids, mask = padded(rows, chunk)
                log_probs = F.log_softmax(target(input_ids=ids, attention_mask=mask, use_cache=False).logits.float(),
                                          dim=-1)  # (b, T, V)
                values, tokens = log_probs.topk(k, dim=-1)  # (b, T, k) each
                rest = log_rest(log_probs, tokens)  # (b, T)
                for line, index in enumerate(chunk):
                    length = len(rows[index])
                    self.log_probs.append(values[line, :length].clone())
                    self.tokens.append(tokens[line, :length].to(torch.int32))
                    self.log_rest.append(rest[line, :length].clone())

    def kept(self, indices: list[int]) -> TopK:
        def pad(parts):
            return torch.nn.utils.rnn.pad_sequence([parts[index] for index in indices], batch_first=True)
        return TopK(pad(self.log_probs), pad(self.tokens).long(), pad(self.log_rest))


def kept_kl(kept: TopK, student_logits):
    """KL_k(target || sibling) at each position (the module's docstring): (B, T)."""
    student = F.log_softmax(student_logits.float(), dim=-1)  # (B, T, V)
    student_top = student.gather(-1, kept.tokens)  # (B, T, k)
    top = (kept.log_probs.exp() * (kept.log_probs - student_top)).sum(-1)  # (B, T)
    return top + kept.log_rest.exp() * (kept.log_rest - log_rest(student, kept.tokens))


def kl_per_position(teacher_logits, student_logits):
    """KL(teacher || student) of the next-token distributions at each position: (B, T)."""
    teacher_log = F.log_softmax(teacher_logits.float(), dim=-1)
    student_log = F.log_softmax(student_logits.float(), dim=-1)
    return F.kl_div(student_log, teacher_log, log_target=True, reduction="none").sum(-1)


def next_token_nll(logits, ids, mask):
    """(summed NLL of each real next token, their count) under `logits` (B, T, vocab) of `ids` (B, T)."""
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
    valid = mask[:, 1:].float()
    return float((nll * valid).sum()), float(valid.sum())


def batches_of(indices: list[int], size: int) -> list[list[int]]:
    return [indices[start : start + size] for start in range(0, len(indices), size)]


@no_grad
def scored(student, teacher: Teacher, indices: list[int], batch: int) -> dict[str, float]:
    """On the rows at `indices`: the sibling's and the target's perplexity of each next token (pooled) and the mean
    KL(target || sibling) per real position."""
    student.eval()
    sums = {"student": 0.0, "target": 0.0, "tokens": 0.0, "kl": 0.0, "positions": 0.0}
    for chunk in batches_of(indices, batch):
        ids, mask = padded(teacher.rows, chunk)
        student_logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, vocab)
        teacher_logits = teacher.logits(chunk)
        nll, tokens = next_token_nll(student_logits, ids, mask)
        sums["student"], sums["tokens"] = sums["student"] + nll, sums["tokens"] + tokens
        sums["target"] += next_token_nll(teacher_logits, ids, mask)[0]
        sums["kl"] += float((kl_per_position(teacher_logits, student_logits) * mask).sum())
        sums["positions"] += float(mask.sum())
    return {"perplexity": math.exp(sums["student"] / sums["tokens"]),
            "target_perplexity": math.exp(sums["target"] / sums["tokens"]),
            "kl": sums["kl"] / sums["positions"]}


def schedule(rows: int, batch: int, steps: int, seed: int) -> list[list[int]]:
    """Each step's row indices: seeded permutations of all rows, one after another, cut into batches."""
    generator, order = random.Random(seed), []
    while len(order) < steps * batch:
        epoch = list(range(rows))
        generator.shuffle(epoch)
        order += epoch
    return [order[step * batch : (step + 1) * batch] for step in range(steps)]


def warmup_cosine(settings: Healing):
    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(settings.steps - settings.warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def heal(student, teacher: TopTeacher, held_out: Teacher, settings: Healing, started: float) -> dict:
    """Train every weight of `student` on KL_k(teacher || student) over the teacher's rows; the curve scores the first
    `curve_sequences` rows of `held_out` every `curve_every` steps. `started`: the build's start (the cap counts it)."""
    torch.manual_seed(settings.seed)
    curve_rows = list(range(min(settings.curve_sequences, len(held_out.rows))))
    optimizer = torch.optim.AdamW(student.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    rate = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings))
    tokens, stopped_by, step = 0, "steps", 0

    def point() -> dict:
        return {"step": step, "tokens": tokens, "seconds": round(time.perf_counter() - started, 1),
                **{f"select_{key}": value for key, value in
                   scored(student, held_out, curve_rows, settings.batch_sequences).items()}}

    curve = [point()]
    bar = tqdm(schedule(len(teacher.rows), settings.batch_sequences, settings.steps, settings.seed),
               desc="healing", unit="step")
    for step, indices in enumerate(bar, 1):
        student.train()
        ids, mask = padded(teacher.rows, indices)
        logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, vocab)
        loss = (kept_kl(teacher.kept(indices), logits) * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        rate.step()
        tokens += int(mask.sum())
        bar.set_postfix(kl=f"{loss.item():.3f}")
        if step % settings.curve_every == 0 or step == settings.steps:
            curve.append(point())
            bar.write(f"step {step}: select perplexity {curve[-1]['select_perplexity']:.2f}, "
                      f"KL {curve[-1]['select_kl']:.3f}, {curve[-1]['seconds']} s")
        if time.perf_counter() - started > settings.max_seconds:
            stopped_by = "max_seconds"
            if curve[-1]["step"] != step:
                curve.append(point())
            break
    bar.close()
    student.eval()
    return {"steps": step, "tokens": tokens, "stopped_by": stopped_by, "curve": curve}
