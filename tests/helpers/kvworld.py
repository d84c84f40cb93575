"""A tiny project folder for the extract and fit tests: two random Qwen3 models (with the word-level tokenizer
their token ids spell, as every model folder of the pipeline holds one) and fit/select parquet files."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB = 97


def qwen3_config(hidden: int, layers: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       rope_theta=10000.0, tie_word_embeddings=True)


def write_sequences(path: Path, count: int, length: int, seed: int, prefix: str) -> None:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        ids = torch.randint(0, VOCAB, (length - (i % 3),), generator=generator).tolist()
        rows.append({"doc_id": f"{prefix}-{i}", "text": " ".join(map(str, ids)), "token_ids": ids,
                     "content_hash": hashlib.sha256(str(ids).encode()).hexdigest()})
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Token i is the word `str(i)`: the sequences' text is their ids joined by spaces."""
    words = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="0", pad_token="0")


def make_world(root: Path, fit: int = 10, select: int = 4, length: int = 24) -> Path:
    for name, hidden, layers, seed in (("source", 32, 3, 2), ("target", 64, 2, 1)):
        torch.manual_seed(seed)
        Qwen3ForCausalLM(qwen3_config(hidden, layers)).eval().save_pretrained(root / "models" / name)
        word_tokenizer().save_pretrained(root / "models" / name)
    write_sequences(root / "data" / "fit.parquet", fit, length, 0, "fit")
    write_sequences(root / "data" / "select.parquet", select, length, 1, "select")
    return root
