"""Tests of the training module's pieces that need no training: batches, schedule, lm-eval-style scoring."""


import pytest
import torch
import torch.nn.functional as F
from helpers import committed

from pipeline.store.params import parse
from pipeline.tiny.corpus import generate_world
from pipeline.tiny.items import render_hellaswag
from pipeline.tiny.tokenizer import train_tokenizer
from pipeline.tiny.train import TrainConfig, build_model, encode_corpus, lr_at, make_batch, score_items, train_model
from pipeline.tiny.world import WorldConfig

TINY = parse(TrainConfig,
             committed("train.target", hidden=32, intermediate=64, heads=2, kv_heads=1, head_dim=16, layers=2),
             "train.target")
SMALL = parse(WorldConfig, committed("data.world", corpus_docs=200), "data.world")


@pytest.fixture(scope="module")
def world_and_tokenizer():
    world = generate_world(SMALL, {"fit": 2, "select": 2, "eval": 2}, items_per_part=8)
    return world, train_tokenizer(world["corpus"].text)


def test_batch_puts_loss_only_on_the_predictable_part_and_eos(world_and_tokenizer):
    world, tokenizer = world_and_tokenizer
    corpus = world["corpus"]
    docs, loss_from = encode_corpus(tokenizer, corpus)
    story = int((corpus.kind == "story").idxmax())
    input_ids, labels = make_batch(docs, loss_from, [story], tokenizer.pad_token_id)
    scored = tokenizer.decode(labels[0][labels[0] != -100])
    assert scored == corpus.text[story][corpus.loss_from[story]:] + tokenizer.eos_token
    assert scored.startswith(" Later ")


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TINY.model_copy(update=dict(copy_steps=10, mixed_steps=90, warmup=10, lr=1e-3, min_lr_ratio=0.1))
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-4, rel=1e-2)


def test_score_items_matches_a_per_choice_forward(world_and_tokenizer):
    world, tokenizer = world_and_tokenizer
    torch.manual_seed(0)
    model = build_model(TINY, tokenizer).eval()
    items = world["hellaswag_dev"].head(3)
    scored = score_items(model, tokenizer, "hellaswag", items, batch=5)
    query, choices, gold = render_hellaswag(items.iloc[0])
    context = tokenizer.encode(query)
    for choice, ll in zip(choices, scored.ll.iloc[0]):
        whole = torch.tensor([tokenizer.encode(f"{query} {choice}")])  # (1, T)
        logprobs = F.log_softmax(model(input_ids=whole).logits, dim=-1)[0]  # (T, V)
        expected = sum(logprobs[t - 1, whole[0, t]].item() for t in range(len(context), whole.shape[1]))
        assert ll == pytest.approx(expected, abs=1e-4)
    assert scored.gold.iloc[0] == gold
    assert set(scored.columns) == {"kind", "gold", "ll", "acc", "acc_norm"}


def test_training_twice_on_one_thread_gives_the_same_weights_and_losses_byte_for_byte(world_and_tokenizer):
    world, tokenizer = world_and_tokenizer
    cfg = TINY.model_copy(update={"copy_steps": 3, "mixed_steps": 3, "batch": 4, "eval_every": 6})
    dev = {task: world[f"{task}_dev"].head(2) for task in ("hellaswag", "piqa")}
    threads = torch.get_num_threads()
    try:
        runs = [train_model(cfg, tokenizer, world["corpus"], dev, threads=1) for _ in range(2)]
        other_seed = train_model(cfg.model_copy(update={"seed": cfg.seed + 1}), tokenizer, world["corpus"], dev, 1)
    finally:
        torch.set_num_threads(threads)
    weights = [model.state_dict() for model, _ in (*runs, other_seed)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert runs[0][1]["loss"] == runs[1][1]["loss"] and runs[0][1]["dev"] == runs[1][1]["dev"]
    assert not all(torch.equal(weights[0][name], weights[2][name]) for name in weights[0])  # the check sees a change
