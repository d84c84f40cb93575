"""A tiny generated Llama target, the cuts and settings of a sibling of it, and a project folder for its stage."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers.kvworld import VOCAB, word_tokenizer, write_sequences
from pipeline import sibling as stage
from pipeline.fitting.prune import Cut
from pipeline.schema.sibling import SiblingParams
from pipeline.store import paths
from pipeline.store.params import parse

LAYERS, HEADS, KV_HEADS, CHANNELS, HEAD_DIM = 6, 4, 2, 64, 8
SETTINGS = dict(shape="mlp:16+heads:2", keep="influence", ranking_sequences=4, prefill_length=64, steps=40,
                batch_sequences=4, row_length=20, lr=3e-3, warmup_steps=4, weight_decay=0.0, top_k=16,
                max_seconds=600.0, curve_every=20, curve_sequences=4, seed=0)


def llama_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=CHANNELS, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=64, tie_word_embeddings=True,
                         initializer_range=0.2)  # sharp next-token distributions
    return LlamaForCausalLM(config).eval()


def sibling_params(**changes) -> SiblingParams:
    return parse(SiblingParams, {**SETTINGS, **changes}, "sibling")


def whole(layers=range(LAYERS), channels=CHANNELS, heads=HEADS) -> Cut:
    """A cut keeping the first `channels` channels and `heads` heads (the first of each group) of `layers`."""
    per_group = heads // KV_HEADS
    kept_heads = [group * (HEADS // KV_HEADS) + index for group in range(KV_HEADS) for index in range(per_group)]
    return Cut(list(layers), [list(range(channels))] * len(layers), [kept_heads] * len(layers))


def project_folder(root: Path) -> Path:
    """A project folder holding the target (with the word-level tokenizer) and the sibling stage's calibration pool
    and select split."""
    llama_target().save_pretrained(root / "models" / "target")
    word_tokenizer().save_pretrained(root / "models" / "target")
    write_sequences(root / paths.CALIBRATION_POOL, 24, 20, 0, "fit")
    write_sequences(root / paths.split("select"), 8, 20, 1, "select")
    return root


def rows(project: Path, split: Path) -> list[list[int]]:
    return stage.sequences(project / split)


IDS = torch.tensor([[5, 9, 14, 3, 22, 7, 40, 2]])
