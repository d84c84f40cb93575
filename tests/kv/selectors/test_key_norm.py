"""The `key_norm` policy (`kv/selectors/key_norm.py`, its maths `kv/selectors/maths/key_norm.py`): the tokens whose
mapped keys are largest, over every layer or the first N (`key_norm@N`), priced by the keys it reads."""
import pytest
import torch
from helpers import build_model, llama_config

from pipeline.kv.flops import repair_budget
from pipeline.kv.recompute import RepairCount, repair_cache
from pipeline.kv.repair import Repair, RepairError
from pipeline.kv.selectors.maths.base import Evidence
from pipeline.kv.selectors.maths.key_norm import MATHS
from pipeline.store.shapes import pair_configs

LAYERS, WIDTH = 3, 12


def _layers(scale: dict[tuple[int, int], float]) -> list:
    """Per layer unit-norm keys of 1 row (1, 2, WIDTH, 16), the (layer, slot) pairs of `scale` scaled by it."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for index in range(LAYERS):
        keys = torch.randn(1, 2, WIDTH, 16, generator=generator)
        keys = keys / keys.pow(2).sum(dim=(1, 3), keepdim=True).sqrt()
        for (layer, slot), factor in scale.items():
            if layer == index:
                keys[:, :, slot] *= factor
        layers.append((keys, torch.zeros_like(keys)))
    return layers


def _scores(layers, argument=None, length=WIDTH):
    evidence = Evidence(None, layers, layers, None, 0, torch.zeros(1, WIDTH, dtype=torch.long),
                        torch.tensor([length]), RepairCount(), None, None)
    return MATHS.score(evidence, argument)


def test_the_largest_mapped_keys_score_highest():
    scores = _scores(_layers({(0, 3): 4.0, (2, 7): 3.0}))
    assert scores[0].topk(2).indices.sort().values.tolist() == [3, 7]


def test_with_a_parameter_only_the_first_layers_are_read():
    scores = _scores(_layers({(0, 3): 4.0, (2, 7): 30.0}), argument=2)
    assert scores[0].argmax().item() == 3


def test_padding_does_not_set_a_rows_scale():
    # a huge key past the row's length would shrink every real token's relative score if it were averaged in
    real = _scores(_layers({}), length=8)[0, :8]
    padded = _scores(_layers({(0, 10): 100.0, (1, 10): 100.0, (2, 10): 100.0}), length=8)[0, :8]
    assert torch.allclose(real, padded)


def test_its_parameter_prints_back_and_is_checked_against_the_target():
    assert str(Repair.parse("tokens:0.1:key_norm@2")) == "tokens:0.1:key_norm@2"
    assert Repair.parse("tokens:0.1:key_norm@2") == Repair(tokens=0.1, select_by="key_norm", argument=2)
    with pytest.raises(RepairError, match="count >= 1"):
        Repair.parse("tokens:0.1:key_norm@0")
    target = build_model(llama_config(31, 32, layers=2), seed=0)
    layers = [(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16))] * 2
    with pytest.raises(RepairError, match="the target has only 2 layers") as error:
        repair_cache(target, layers, torch.zeros(1, 5, dtype=torch.long), None, Repair.parse("tokens:0.5:key_norm@3"),
                     RepairCount())
    assert "\n" not in str(error.value)


def test_reading_fewer_layers_costs_less_and_any_reading_costs_more_than_recency():
    _, target = pair_configs("qwen3-v0")
    recency, two, every = (repair_budget(target, Repair.parse(f"tokens:0.1:{p}"), 1024)
                           for p in ("recency", "key_norm@2", "key_norm"))
    assert recency < two < every
