"""Stage distill's parameters (`schema.distill`): a distillation start without its family's learning rate is
refused. (The stage runs on two processes in tests/store/test_ranks.py, its inputs in tests/store/test_inputs.py.)"""
import pytest
from helpers import committed_params

from pipeline.schema.distill import DistillParams
from pipeline.store.params import ParamError, parse


def test_a_distillation_start_without_its_familys_learning_rate_is_refused():
    section = {**committed_params()["distill"], "lrs": {"linear": [0.001]}}
    with pytest.raises(ParamError, match=r"^distill\.start: 'mlp_k3' is a mlp map but distill\.lrs has no mlp entry"):
        parse(DistillParams, section, "distill")
