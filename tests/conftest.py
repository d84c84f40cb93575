"""Shared fixtures: a locally trained tokenizer and tiny Qwen3 models built in the test, no network."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
EOS = "<|endoftext|>"


def shared_file(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.is_file():
        pytest.fail(f"{path} is missing: the tests read real rows from ../shared/data")
    return path


def hellaswag_rows(n: int) -> list[dict]:
    with open(shared_file("hellaswag", "hellaswag_val_1000.jsonl")) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def piqa_rows(n: int) -> list[dict]:
    with open(shared_file("piqa", "valid.jsonl")) as f, open(shared_file("piqa", "valid-labels.lst")) as g:
        return [dict(json.loads(line), label=int(label)) for _, line, label in zip(range(n), f, g)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)


def task_texts() -> list[str]:
    texts = []
    for row in hellaswag_rows(1000):
        texts += [row["activity_label"], row["ctx"], *row["endings"]]
    for row in piqa_rows(1838):
        texts += [f"Question: {row['goal']}\nAnswer:", row["sol1"], row["sol2"]]
    return texts


def tiny_config(vocab_size: int, hidden: int, layers: int = 2, **extra) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        **extra,
    )


def build_model(config: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(task_texts(), vocab_size=1024)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """A target (hidden 64) and a source (hidden 32) with the same KV geometry, saved with the tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    paths = {}
    for name, hidden, seed in (("target", 64, 1), ("source", 32, 2)):
        model = build_model(tiny_config(len(tokenizer), hidden), seed)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths


def periodic_batch(generator: torch.Generator, batch: int, length: int, vocab: int) -> torch.Tensor:
    """Sequences that repeat a random pattern of 3-6 tokens: after one period the prefix predicts the rest."""
    rows = []
    for _ in range(batch):
        period = int(torch.randint(3, 7, (1,), generator=generator))
        pattern = torch.randint(1, vocab, (period,), generator=generator)
        rows.append(pattern.repeat(length // period + 1)[:length])
    return torch.stack(rows)  # (batch, length)


@pytest.fixture(scope="session")
def periodic_model() -> Qwen3ForCausalLM:
    """A tiny model trained briefly on periodic text, so its continuations depend on the cached prefix."""
    vocab, length = 32, 40
    model = build_model(tiny_config(vocab, 64), seed=0).train()
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(300):
        batch = periodic_batch(generator, 32, length, vocab)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
