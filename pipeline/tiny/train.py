"""Training a tiny Qwen3 model on the tiny world, and scoring task items the way lm-eval does. Two phases (feasibility
notes, round 2): first only `copy` documents, where the look-back (an induction head) appears within a few hundred
steps, then the whole corpus; mixing from the start let the models settle on a bag-of-words shortcut. The loss covers
only each document's predictable part (after the random facts, after `then`) and its EOS. Scoring follows lm-eval's
`multiple_choice`: acc is the argmax of summed log-likelihoods, acc_norm per character."""
from __future__ import annotations

import math
import time

from tqdm import tqdm

from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy
from pipeline.store.params import Count, Params, Positive, PositiveFloat, Share
from pipeline.tiny.items import render_hellaswag, render_piqa

pd = lazy("pandas")
torch = lazy("torch")
F = lazy("torch.nn.functional")
transformers = lazy("transformers")

RENDER = {"hellaswag": render_hellaswag, "piqa": render_piqa}


class TrainConfig(Params):
    layers: Positive
    hidden: Positive
    intermediate: Positive
    heads: Positive
    kv_heads: Positive
    head_dim: Positive
    rope_theta: PositiveFloat
    max_positions: Positive
    copy_steps: Count  # phase 1: copy documents only
    mixed_steps: Count  # phase 2: the whole corpus
    lr: PositiveFloat
    warmup: Count
    min_lr_ratio: Share
    batch: Positive
    seed: int
    eval_every: Positive


def build_model(cfg: TrainConfig, tokenizer: transformers.PreTrainedTokenizerFast) -> transformers.Qwen3ForCausalLM:
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return transformers.Qwen3ForCausalLM(config)


def encode_corpus(tokenizer: transformers.PreTrainedTokenizerFast,
                  corpus: pd.DataFrame) -> tuple[list[torch.Tensor], list[int]]:
    """Token ids of each document followed by EOS, and the index of its first loss-bearing token."""
    ids = tokenizer(list(corpus.text), add_special_tokens=False)["input_ids"]
    heads = tokenizer([t[:n] for t, n in zip(corpus.text, corpus.loss_from)], add_special_tokens=False)["input_ids"]
    docs = [torch.tensor(d + [tokenizer.eos_token_id]) for d in ids]
    return docs, [len(h) for h in heads]


def make_batch(docs: list[torch.Tensor], loss_from: list[int], picks: list[int],
               pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batch: causal attention never lets a real token see the padding after it, so no mask."""
    width = max(len(docs[i]) for i in picks)
    input_ids = torch.full((len(picks), width), pad_id)  # (B, T)
    labels = torch.full((len(picks), width), -100)  # (B, T); the model shifts them by one
    for row, i in enumerate(picks):
        input_ids[row, : len(docs[i])] = docs[i]
        labels[row, loss_from[i] : len(docs[i])] = docs[i][loss_from[i] :]
    return input_ids, labels


def lr_at(step: int, cfg: TrainConfig) -> float:
    total = cfg.copy_steps + cfg.mixed_steps
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(cfg: TrainConfig, tokenizer: transformers.PreTrainedTokenizerFast, corpus: pd.DataFrame,
                dev_items: dict[str, pd.DataFrame], threads: int) -> tuple[transformers.Qwen3ForCausalLM, dict]:
    """Train from scratch; dev_items maps a task name ('hellaswag', 'piqa') to its dev frame, scored every eval_every
    steps. Deterministic given cfg and the thread count."""
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tokenizer)
    docs, loss_from = encode_corpus(tokenizer, corpus)
    copy_docs, all_docs = [i for i, kind in enumerate(corpus.kind) if kind == "copy"], range(len(docs))
    sampler = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = cfg.copy_steps + cfg.mixed_steps
    stats = {"config": {**cfg.model_dump(), "threads": threads},
             "parameters": sum(p.numel() for p in model.parameters()), "loss": [], "dev": []}
    started, eval_seconds, running = time.perf_counter(), 0.0, None
    bar = tqdm(range(total), desc=f"train h{cfg.hidden}", mininterval=5)
    for step in bar:
        pool = copy_docs if step < cfg.copy_steps else all_docs
        picks = [pool[i] for i in torch.randint(len(pool), (cfg.batch,), generator=sampler).tolist()]
        input_ids, labels = make_batch(docs, loss_from, picks, tokenizer.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        model.train()
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        bar.set_postfix(loss=f"{running:.3f}", refresh=False)
        if (step + 1) % 50 == 0:
            stats["loss"].append({"step": step + 1, "loss": round(running, 4)})  # smoothed training loss
        if (step + 1) % cfg.eval_every == 0 or step + 1 == total:
            t0 = time.perf_counter()
            record = {"step": step + 1, **dev_summary(model, tokenizer, dev_items)}
            eval_seconds += time.perf_counter() - t0
            stats["dev"].append(record)
            bar.write(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))
    stats.update(train_seconds=round(time.perf_counter() - started - eval_seconds, 1),
                 dev_eval_seconds=round(eval_seconds, 1), final_loss=round(running, 4))
    model.eval()
    return model, stats


def dev_summary(model: transformers.Qwen3ForCausalLM, tokenizer: transformers.PreTrainedTokenizerFast,
                items: dict[str, pd.DataFrame]) -> dict:
    """acc per task and per task and kind, e.g. {'hellaswag': 0.9, 'hellaswag/recall': 1.0, ...}."""
    out = {}
    for task, frame in items.items():
        scored = score_items(model, tokenizer, task, frame)
        out[task] = round(float(scored.acc.mean()), 4)
        for kind, group in scored.groupby("kind", sort=True):
            out[f"{task}/{kind}"] = round(float(group.acc.mean()), 4)
    return out


def encode_choices(tokenizer: transformers.PreTrainedTokenizerFast, task: str, items: pd.DataFrame) -> list[dict]:
    """Per item: context ids, each choice's continuation ids and character length, gold index; split as lm-eval does
    (encode context + " " + choice whole, the continuation is what follows the context's own tokens)."""
    out = []
    for _, item in items.iterrows():
        query, choices, gold = RENDER[task](item)
        context = tokenizer.encode(query, add_special_tokens=False)
        continuations = []
        for choice in choices:
            whole = tokenizer.encode(f"{query} {choice}", add_special_tokens=False)
            if whole[: len(context)] != context:
                raise ValueError(f"tokenizer does not split {query} {choice!r} at the context boundary")
            continuations.append(whole[len(context) :])
        out.append(dict(context=context, continuations=continuations, lengths=[len(c) for c in choices], gold=gold))
    return out


@no_grad
def score_items(model: transformers.Qwen3ForCausalLM, tokenizer: transformers.PreTrainedTokenizerFast, task: str,
                items: pd.DataFrame, batch: int = 64) -> pd.DataFrame:
    """Per item: kind, gold, log-likelihood of each choice, acc and acc_norm (0/1)."""
    model.eval()
    encoded = encode_choices(tokenizer, task, items)
    pairs = [(e["context"], cont) for e in encoded for cont in e["continuations"]]
    lls = []
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        width = max(len(c) + len(e) for c, e in chunk)
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id)  # (B, T)
        for row, (c, e) in enumerate(chunk):
            input_ids[row, : len(c) + len(e)] = torch.tensor(c + e)
        logprobs = F.log_softmax(model(input_ids=input_ids).logits.float(), dim=-1)  # (B, T, V)
        for row, (c, e) in enumerate(chunk):
            # the token at position t is predicted by the logits at t - 1
            positions = torch.arange(len(c) - 1, len(c) + len(e) - 1)
            lls.append(logprobs[row, positions, torch.tensor(e)].sum().item())
    return decide(encoded, lls, items)


def decide(encoded: list[dict], lls: list[float], items: pd.DataFrame) -> pd.DataFrame:
    """lm-eval's decisions from the flat list of choice log-likelihoods (items in order, choices in order)."""
    rows, cursor = [], 0
    for e, kind in zip(encoded, items.kind):
        ll = lls[cursor : cursor + len(e["continuations"])]
        cursor += len(ll)
        pick = max(range(len(ll)), key=ll.__getitem__)
        pick_norm = max(range(len(ll)), key=lambda i: ll[i] / e["lengths"][i])
        rows.append(dict(kind=kind, gold=e["gold"], ll=ll, acc=float(pick == e["gold"]),
                         acc_norm=float(pick_norm == e["gold"])))
    return pd.DataFrame(rows, index=items.index)
