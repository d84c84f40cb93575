"""Fixtures the distillation tests share (`test_distill`, `test_distill_rows`)."""
import pytest
import torch
from helpers import build_model, tiny_config
from helpers.distill import VOCAB, frozen


@pytest.fixture(scope="module")
def one_thread():
    """These runs are tiny: on shared cores, two threads spend their time waiting for each other (20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def random_pair():
    return frozen(build_model(tiny_config(VOCAB, 64), seed=1)), frozen(build_model(tiny_config(VOCAB, 32), seed=2))
