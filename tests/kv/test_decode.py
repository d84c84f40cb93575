"""Decoding after the handoff (`kv.decode`): the oracle decodes as the target's own `generate`, stops after the
EOS token, decodes a one-token prompt from an empty cache, and samples reproducibly with a seed."""
import pytest
import torch
from helpers import build_model, tiny_config

from pipeline.kv.decode import eos_ids, generate
from pipeline.kv.handoff import Handoff

VOCAB = 97


@pytest.fixture(scope="module")
def target():
    return build_model(tiny_config(VOCAB, 64), seed=1)


def _prompt(length=12, seed=5):
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_oracle_generation_equals_the_targets_own_generate_token_for_token(target):
    prompt = _prompt()
    tokens, ttft_ms = generate(Handoff(target), prompt, 10, eos_ids(target, None))
    with torch.no_grad():
        expected = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(prompt):]
    assert tokens == expected.tolist()
    assert ttft_ms > 0


def test_generation_stops_after_the_eos_token(target):
    prompt = _prompt(seed=6)
    free, _ = generate(Handoff(target), prompt, 8)
    stopped, _ = generate(Handoff(target), prompt, 8, stop={free[3]})
    assert stopped == free[: free.index(free[3]) + 1]


def test_a_one_token_prompt_decodes_from_an_empty_cache(target):
    tokens, _ = generate(Handoff(target), [7], 4)
    with torch.no_grad():
        expected = target.generate(torch.tensor([[7]]), attention_mask=torch.ones(1, 1, dtype=torch.long),
                                   max_new_tokens=4, do_sample=False, pad_token_id=0)[0, 1:]
    assert tokens == expected.tolist()


def test_sampling_with_a_seed_is_reproducible_and_another_seed_draws_otherwise(target):
    prompt = _prompt(seed=7)

    def draw(seed: int) -> list[int]:
        return generate(Handoff(target), prompt, 12, temperature=1.0, seed=seed)[0]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
