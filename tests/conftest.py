"""Shared fixtures (a locally trained tokenizer, tiny Qwen3 pairs built in the test, no network, and a periodic model
cached in .pytest_cache) and the collection order; the helpers they are built from are in helpers/."""
from __future__ import annotations

import hashlib
import inspect
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

pytest.register_assert_rewrite("helpers")  # before their import: a failed assert there explains itself too

from helpers import build_model, periodic_batch, task_texts, tiny_config, train_periodic_model, train_tokenizer  # noqa: E402


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


@pytest.fixture(scope="session")
def wide_pair(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """tiny_pair's shapes with weights drawn wide (initializer_range 0.5). tiny_pair's near-uniform models pick the
    same endings and greedy tokens whatever their cache, so no map changes a decision there; here one does."""
    root = tmp_path_factory.mktemp("wide")
    for name, hidden, seed in (("target", 64, 1), ("source", 32, 2)):
        build_model(tiny_config(len(tokenizer), hidden, initializer_range=0.5), seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {"target": root / "target", "source": root / "source"}


@pytest.fixture(scope="session")
def periodic_model(request) -> Qwen3ForCausalLM:
    """`train_periodic_model`'s result, cached in pytest's cache folder (.pytest_cache) keyed by the source of
    the code that trains it and the torch version: training is not what the tests that use it check."""
    code = "".join(inspect.getsource(f) for f in (train_periodic_model, periodic_batch, tiny_config, build_model))
    key = hashlib.sha256(f"{code}{torch.__version__}".encode()).hexdigest()[:16]
    cache = getattr(request.config, "cache", None)
    if cache is None:  # pytest run with -p no:cacheprovider
        return train_periodic_model()
    folder = cache.mkdir("periodic_model") / key
    # written whole, then renamed, never replaced: `make test`'s other worker may race for it (not
    # store.artifacts.atomic_dir, which clears every staging folder beside its target, the other worker's too)
    if not (folder / "config.json").is_file():
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=folder.parent))
        train_periodic_model().save_pretrained(staging)
        try:
            staging.rename(folder)
        except OSError:  # the other worker renamed its copy first: the same model
            shutil.rmtree(staging)
    return Qwen3ForCausalLM.from_pretrained(folder).eval()


def pytest_collection_modifyitems(config, items) -> None:
    """The files with the most end-to-end runs (marked `slow`) first, each file's tests together and in order:
    under `make test`'s two workers (a whole file on one, in this order: --no-loadscope-reorder) the longest file
    then runs beside the rest of the suite instead of after most of it."""
    slow: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])  # stable: each file's tests keep their order
