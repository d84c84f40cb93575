"""Healing a pruned sibling by distillation from the target's logits (Minitron, Sheared-LLaMA): every weight of the
sibling trained with AdamW on the mean over tokens of KL(target || sibling) between their next-token distributions
on the healing rows, which neither model has seen in any other role (the fit stream of the corpus).

The target's body runs once per row: its final hidden states (after its final norm) are kept (`Teacher`), and its
logits at each step are one product with its LM head. Rows are dealt in seeded epochs, the learning rate warms up
linearly and decays on a cosine to zero at the declared step count, and a wall-clock cap stops healing at the first
step past it (then the run is no longer a function of params alone: `stopped_by` says which limit ended it).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")
F = lazy("torch.nn.functional")


@dataclass(frozen=True)
class Healing:
    steps: int
    batch_sequences: int
    lr: float
    warmup_steps: int
    weight_decay: float
    max_seconds: float
    curve_every: int
    curve_sequences: int
    seed: int


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


def heal(student, teacher: Teacher, held_out: Teacher, settings: Healing, started: float) -> dict:
    """Train every weight of `student` on KL(teacher || student) over the teacher's rows; the curve scores the first
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
        loss = (kl_per_position(teacher.logits(indices), logits) * mask).sum() / mask.sum()
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
