"""Layer probes (`fitting.probes`): many passes equal one, rows and moments agree, the source is read once when
it fits the budget, and the probe finds a planted layer."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.fitting import ridge
from pipeline.fitting.probes import holdout_sequences, probe_r2, ranking, stored_bytes
from pipeline.store.cachefiles import MANIFEST, ShardWriter, paired_split


def _fake_caches(root: Path, planted: dict[int, int], source_layers=4, sequences=8, length=30) -> None:
    """Random source caches; target layer l is an exact linear map of source layer planted[l] (keys and values)."""
    generator = torch.Generator().manual_seed(0)
    heads, dim = 2, 4
    maps = {layer: torch.randn(heads * dim, heads * dim, generator=generator) for layer in planted}
    for name in ("source", "target"):
        meta = {"model": name, "model_path": name,
                "geometry": {"layers": source_layers if name == "source" else len(planted),
                             "kv_heads": heads, "head_dim": dim}, "rotary": {}, "dtype": "float32"}
        writer = ShardWriter(root / name, meta, 3, torch.float32)
        gen = torch.Generator().manual_seed(1)
        writer.begin("fit", [length] * sequences)
        for seq in range(sequences):
            source = [torch.randn(length, heads, dim, generator=gen) for _ in range(2 * source_layers)]
            layers = source if name == "source" else [
                (source[2 * p + kind].reshape(length, -1) @ maps[layer]).reshape(length, heads, dim)
                for layer, p in planted.items() for kind in (0, 1)]
            writer.add(f"d{seq}", f"h{seq}", torch.stack(layers[0::2]), torch.stack(layers[1::2]))
        records = writer.close()
        (root / name / MANIFEST).write_text(json.dumps(dict(meta, splits={"fit": {"shards": records["fit"]}})))


def test_probes_in_many_passes_equal_one_pass_and_compute_each_inputs_gram_once(tmp_path, monkeypatch):
    _fake_caches(tmp_path, {0: 2, 1: 0, 2: 3})
    pairs = paired_split(tmp_path / "source", tmp_path / "target", "fit")
    held = holdout_sequences(pairs, 0.25, seed=0)
    one_pass = probe_r2(pairs, held, 4, 3, 8, 8, 1e-6, budget_bytes=1e9, device="cpu")
    grams = []
    original = ridge.Moments.update
    monkeypatch.setattr(ridge.Moments, "update",
                        lambda self, x, y, inputs=True: (grams.append(inputs), original(self, x, y, inputs))[1])
    three_passes = probe_r2(pairs, held, 4, 3, 8, 8, 1e-6, budget_bytes=1, device="cpu")
    # the same R² (to float64 rounding: the solves see right-hand sides of other widths)
    assert all(torch.allclose(one_pass[kind], three_passes[kind], rtol=1e-12, atol=1e-12) for kind in one_pass)
    shards = len(pairs)
    assert grams.count(True) == shards * 2 * 2 * 4  # shards x kinds x (train, held) x source layers, once
    assert grams.count(False) == 2 * grams.count(True)  # the two later passes add only X^T Y


def test_probes_on_fewer_rows_than_features_equal_probes_from_moments(tmp_path, monkeypatch):
    _fake_caches(tmp_path, {0: 2, 1: 0, 2: 3}, sequences=3, length=2)  # 4 train, 2 held-out rows < 8 features
    pairs = paired_split(tmp_path / "source", tmp_path / "target", "fit")
    held = holdout_sequences(pairs, 0.25, seed=0)
    kinds, original = [], ridge.summary

    def recorded(rows, in_width, out_width, device, force_moments=False):
        made = original(in_width if force_moments else rows, in_width, out_width, device)
        kinds.append(type(made).__name__)
        return made

    monkeypatch.setattr(ridge, "summary", recorded)
    from_rows = probe_r2(pairs, held, 4, 3, 8, 8, 1e-3, budget_bytes=1, device="cpu")
    assert set(kinds) == {"Rows"}
    monkeypatch.setattr(ridge, "summary", lambda *args: recorded(*args, force_moments=True))
    from_moments = probe_r2(pairs, held, 4, 3, 8, 8, 1e-3, budget_bytes=1, device="cpu")
    assert set(kinds) == {"Rows", "Moments"}
    assert all(torch.allclose(from_rows[kind], from_moments[kind], rtol=1e-7, atol=1e-7) for kind in from_rows)


def test_probes_read_the_source_once_when_its_rows_fit_the_budget_with_the_same_scores(tmp_path):
    _fake_caches(tmp_path, {0: 2, 1: 0, 2: 3})

    def probe(rows_budget_bytes):
        pairs = paired_split(tmp_path / "source", tmp_path / "target", "fit")  # fresh read counters
        scores = probe_r2(pairs, holdout_sequences(pairs, 0.25, seed=0), 4, 3, 8, 8, 1e-6, budget_bytes=1,
                          device="cpu", rows_budget_bytes=rows_budget_bytes)  # three passes
        return scores, sum(s.bytes_read for s, _ in pairs) / stored_bytes(pairs, 4, 8)

    (kept, kept_reads), (reread, reread_reads) = probe(1e9), probe(0)
    assert all(torch.equal(kept[kind], reread[kind]) for kind in kept)
    assert (kept_reads, reread_reads) == (1.0, 3.0)  # learning the stored dtype reads no tensor


def test_probe_picks_the_planted_source_layer(tmp_path):
    planted = {0: 2, 1: 0, 2: 3}
    _fake_caches(tmp_path, planted)
    pairs = paired_split(tmp_path / "source", tmp_path / "target", "fit")
    held = holdout_sequences(pairs, 0.25, seed=0)
    # the budget forces one target layer per pass
    scores = probe_r2(pairs, held, 4, 3, 8, 8, 1e-6, budget_bytes=1, device="cpu")
    assert [order[0] for order in ranking(scores)] == [planted[layer] for layer in range(3)]
    for layer, p in planted.items():
        assert scores["keys"][layer, p] > 0.999 and scores["values"][layer, p] > 0.999
