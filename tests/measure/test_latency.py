"""Latency (`measure.latency`) on tiny random models: what each handoff timer covers, the handoff path's first
logits, memory accounting.

No test asserts a speed: timings on a shared CPU are noise at these sizes.
"""
import pytest
import torch
from helpers import build_model, tiny_config

from pipeline.kv import modes
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import identity_mapper, random_mapper
from pipeline.measure import latency as measure
from pipeline.measure import timing

VOCAB = 97


@pytest.fixture(scope="module")
def pair():
    return build_model(tiny_config(VOCAB, 64), seed=1), build_model(tiny_config(VOCAB, 32), seed=2)


def test_each_handoff_timer_brackets_only_its_own_part(pair, monkeypatch):
    target, source = pair
    handoff = Handoff(target, source, "mapped", random_mapper(source.config, target.config, k=1))
    ticks, calls = [], []
    monkeypatch.setattr(timing, "read_clock", lambda device: ticks.append(len(ticks)) or len(ticks) - 1)
    for name in ("source_prefill", "rebuilt"):
        function = getattr(modes, name)
        monkeypatch.setattr(modes, name, lambda *a, _f=function, _n=name: calls.append((_n, len(ticks))) or _f(*a))
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **kw: calls.append(("step", len(ticks))) or forward(*a, **kw))
    parts = measure.time_handoff(handoff, torch.arange(12)[None])
    # the clock was read once before each part and once after the last: each part ran inside its own interval
    assert calls == [("source_prefill", 1), ("rebuilt", 2), ("step", 3)]
    assert parts == {"handoff": 3e-6, "prefill": 1e-6, "map": 1e-6, "step": 1e-6}


def test_handoff_path_with_the_targets_own_cache_gives_the_targets_first_logits(pair):
    target, _ = pair
    handoff = Handoff(target, target, "mapped", identity_mapper("t", "t", target.config, target.config))
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    full = measure.target_first_token(target, ids).logits[0, -1]
    handed = measure.handoff_first_token(handoff, ids)[0].logits[0]
    assert torch.allclose(full, handed, atol=1e-4)


def test_cpu_peak_bytes_sees_a_tensor_held_by_the_result():
    mib = 2**20
    peak = measure.peak_bytes(lambda: torch.ones(4 * mib // 4), torch.device("cpu"))
    assert 4 * mib <= peak < 5 * mib
