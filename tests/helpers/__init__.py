"""What the tests share besides fixtures (those are conftest.py's): the real rows in tests/data, the committed
params, a locally trained tokenizer, tiny Qwen3 and Llama configs and models built in the test (no network), the
periodic model's training, and the pipeline's first two stages as dvc runs them. Importing it sets the offline
environment the tests run in."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from pipeline import pin_models, prepare_models
from pipeline.measure.settings import MeasureParams
from pipeline.store.params import parse

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"  # real rows with their provenance: tests/data/README.md
HELLASWAG = DATA / "hellaswag" / "hellaswag_val_300.jsonl"
PIQA, PIQA_LABELS = DATA / "piqa" / "valid_300.jsonl", DATA / "piqa" / "valid-labels_300.lst"
WIKITEXT = DATA / "wikitext2" / "wiki.test.first15.raw"
EOS = "<|endoftext|>"


def hellaswag_rows(n: int) -> list[dict]:
    with open(HELLASWAG) as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    assert len(rows) == n, f"{HELLASWAG} has {len(rows)} rows, {n} asked"
    return rows


def piqa_rows(n: int) -> list[dict]:
    with open(PIQA) as f, open(PIQA_LABELS) as g:
        rows = [dict(json.loads(line), label=int(label)) for _, line, label in zip(range(n), f, g)]
    assert len(rows) == n, f"{PIQA} has {len(rows)} rows, {n} asked"
    return rows


def merge(base: dict, override: dict) -> dict:
    """`base` with `override` merged in: nested mappings merge, any other value replaces."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def committed(section: str, **overrides) -> dict:
    """A section of the committed params.yaml (dots for nesting) with `overrides` merged in: tests start from
    the values the pipeline runs with, since parameter classes have no defaults."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    for part in section.split("."):
        data = data[part]
    return merge(data, overrides)


def measure_params(**overrides):
    """The committed `measure` section (how intervals resample, the confident margin) with `overrides`."""
    return parse(MeasureParams, committed("measure", **overrides), "measure")


def committed_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


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
    for row in hellaswag_rows(300):
        texts += [row["activity_label"], row["ctx"], *row["endings"]]
    for row in piqa_rows(300):
        texts += [f"Question: {row['goal']}\nAnswer:", row["sol1"], row["sol2"]]
    return texts


def tiny_config(vocab_size: int, hidden: int, layers: int = 2, **extra) -> Qwen3Config:
    fields = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rope_theta=10000.0, tie_word_embeddings=True)
    return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, **{**fields, **extra})


# llama3-style frequency scaling over its own theta: the tiny Llama pair rotates unlike the Qwen3 one
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def llama_config(vocab_size: int, hidden: int, layers: int = 2, **extra) -> LlamaConfig:
    """SmolLM2's architecture in miniature: Llama (no q_norm/k_norm), grouped queries (8 heads over 2 KV heads),
    llama3 RoPE scaling, tied embeddings; the same KV geometry as `tiny_config` (2 KV heads of 16)."""
    fields = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True)
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, **{**fields, **extra})


ARCHITECTURES = {"qwen3": tiny_config, "llama": llama_config}  # the tiny pairs' configs, by architecture


def build_model(config, seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def periodic_batch(generator: torch.Generator, batch: int, length: int, vocab: int) -> torch.Tensor:
    """Sequences that repeat a random pattern of 3-6 tokens: after one period the prefix predicts the rest."""
    rows = []
    for _ in range(batch):
        period = int(torch.randint(3, 7, (1,), generator=generator))
        pattern = torch.randint(1, vocab, (period,), generator=generator)
        rows.append(pattern.repeat(length // period + 1)[:length])
    return torch.stack(rows)  # (batch, length)


def train_periodic_model() -> Qwen3ForCausalLM:
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


def pin_and_prepare(root: Path, params: dict, monkeypatch) -> None:
    """`pin_models` then `prepare_models` as dvc runs them: in `root`, with `params` as its params.yaml, offline
    (the stages' paths, models/pins.json and models/<side>, are relative to the working directory)."""
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(root)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    pin_models.main([])
    prepare_models.main([])
    torch.set_num_threads(threads)  # the stage sets the process's thread count
