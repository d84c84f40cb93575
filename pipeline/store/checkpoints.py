"""The Hugging Face checkpoint folder convert_models makes of a dequantized GGUF, or the marker it leaves in its place
when it has nothing to convert. It is written whole or not at all (`atomic_dir`), and SIGTERM interrupts the writing
as Ctrl-C does, so the stage removes its temporaries.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import signal
import threading
from pathlib import Path
from typing import Iterator

from pipeline.store.artifacts import atomic_dir, private_name
from pipeline.store.lazy import lazy

safetensors_torch = lazy("safetensors.torch")

WEIGHTS = "model.safetensors"


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def terminate_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt (every `finally` runs); a no-op off the main thread or
    where SIGTERM has a handler already (`store.cli.entry`'s)."""
    if threading.current_thread() is not threading.main_thread() or callable(signal.getsignal(signal.SIGTERM)):
        yield
        return
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def scratch_for(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out`, removed at the end (SIGTERM too) or by the next run after a kill."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for leftover in out.parent.glob(f".{out.name}.scratch.*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    with terminate_interrupts():
        scratch = private_name(out.parent / f"{out.name}.scratch", ".tmp")  # .<name>.scratch.<random>.tmp
        try:
            scratch.mkdir(mode=0o700)
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _provenance(folder: Path, name: str, provenance: dict, indent: int | None) -> None:
    (folder / name).write_text(json.dumps(provenance, indent=indent, sort_keys=indent is not None) + "\n")


def write_marker(out: Path, name: str, provenance: dict) -> dict:
    """`out` holding the provenance file `name` alone: the stage had nothing to make."""
    with terminate_interrupts(), atomic_dir(out) as staging:
        _provenance(staging, name, provenance, None)
    return provenance


def write_checkpoint(out: Path, model, tokenizer, name: str, provenance: dict) -> None:
    """`model` (weights as they are) and `tokenizer` as the checkpoint folder `out`, with the provenance file `name`."""
    with terminate_interrupts(), atomic_dir(out) as staging:
        config = model.config
        config._name_or_path = ""
        config.save_pretrained(staging)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
        state = model.state_dict()
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the embedding itself
        safetensors_torch.save_file({key: tensor.contiguous() for key, tensor in state.items()},
                                    str(staging / WEIGHTS), metadata={"format": "pt"})
        tokenizer.save_pretrained(staging)
        _provenance(staging, name, provenance, 2)
