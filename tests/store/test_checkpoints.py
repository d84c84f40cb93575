"""convert_models' checkpoint folder writer: a folder transformers loads back, model and tokenizer, with a tied head
stored once, every file at the mode the umask gives, the marker in one line, and neither SIGTERM nor Ctrl-C in the
middle leaves a temporary folder or a partial checkpoint."""
from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers.kvworld import VOCAB, word_tokenizer
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pipeline.store import checkpoints
from pipeline.store.checkpoints import WEIGHTS, scratch_for, write_checkpoint, write_marker


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        tie_word_embeddings=True)).eval()


@pytest.fixture
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)
    before = os.umask(0o022)
    yield set_mask
    os.umask(before)


def leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_a_checkpoint_loads_back_stores_a_tied_head_once_and_every_file_takes_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    model, tokenizer, out = tiny_model(), word_tokenizer(), tmp_path / "models" / "built"
    write_checkpoint(out, model, tokenizer, "built.json", {"built": True, "from": "a test"})
    assert "lm_head.weight" not in load_file(out / WEIGHTS)
    reloaded = LlamaForCausalLM.from_pretrained(out)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)
    text = "3 1 4 1 5"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == tokenizer(text).input_ids
    assert json.loads((out / "built.json").read_text()) == {"built": True, "from": "a test"}
    assert json.loads((out / "config.json").read_text()).get("_name_or_path", "") == ""
    assert {stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()} == {mode}
    assert leftovers(out.parent) == []


def test_a_marker_is_its_provenance_alone_in_one_line(tmp_path):
    out = tmp_path / "converted"
    assert write_marker(out, "converted.json", {"gguf": None}) == {"gguf": None}
    assert {path.name: path.read_bytes() for path in out.iterdir()} == {"converted.json": b'{"gguf": null}\n'}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_weights_are_written_leaves_no_temporary_folder_nor_a_partial_checkpoint(
        tmp_path, monkeypatch, signum):
    def killed(tensors, path, metadata):
        Path(path).write_bytes(b"partial")
        os.kill(os.getpid(), signum)
        raise AssertionError("the signal did not interrupt the write")
    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    out = tmp_path / "converted"
    # SIGINT raises KeyboardInterrupt, as in a stage's command, even where this process was started with SIGINT
    # ignored (a background job of a non-interactive shell, which Python then leaves ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            write_checkpoint(out, tiny_model(), word_tokenizer(), "converted.json", {})
    finally:
        signal.signal(signal.SIGINT, before)
    assert not out.exists() and leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is not checkpoints._interrupt  # SIGTERM's handler set back


def test_a_sigterm_in_the_scratch_folder_removes_it_and_a_killed_run_is_removed_next_time(tmp_path):
    out = tmp_path / "converted"
    with pytest.raises(KeyboardInterrupt):
        with scratch_for(out) as scratch:
            (scratch / "model.gguf").write_bytes(b"gguf")
            os.kill(os.getpid(), signal.SIGTERM)
    assert leftovers(tmp_path) == []
    stale = tmp_path / ".converted.scratch.abc.tmp"
    stale.mkdir()
    with scratch_for(out) as scratch:
        assert scratch.is_dir() and leftovers(tmp_path) == [scratch.name]
    assert leftovers(tmp_path) == []
