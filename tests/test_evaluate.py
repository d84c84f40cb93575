"""The evaluate stage's command line: several variants in one process, the oracle first, an unknown name refused
before any work."""
import pytest
import yaml
from conftest import ROOT

from pipeline.evaluate import ordered_variants
from pipeline.schema.evaluate import EvaluateParams
from pipeline.store import paths
from pipeline.store.params import ParamError

PARAMS = EvaluateParams(mapped={"selected": "models/mapper.safetensors"}, top_k=4, horizon=2, batch_size=2,
                        shuffle_seed=0, threads=1, processes=1)


def test_the_oracle_runs_first_and_each_variant_once():
    assert ordered_variants(["zero", "selected", "oracle", "zero", "direct"], PARAMS) == \
        ["oracle", "zero", "selected", "direct"]
    assert ordered_variants(["selected"], PARAMS) == ["selected"]


@pytest.mark.parametrize("name", ["oracle2", "mapped_k7", ""])
def test_a_variant_that_is_neither_a_baseline_nor_a_mapped_key_is_refused_by_name(name):
    with pytest.raises(ParamError, match=rf"^pipeline\.evaluate: unknown variant {name!r}; name a baseline"):
        ordered_variants(["oracle", name], PARAMS)


def test_the_evaluate_stage_runs_every_baseline_and_declares_each_ones_outputs():
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["evaluate"]
    assert stage["cmd"].split()[3:] == list(paths.BASELINES)
    outs = {out if isinstance(out, str) else next(iter(out)) for out in stage["outs"]}
    for variant in paths.BASELINES:
        assert {f"eval/{variant}", str(paths.variant_metrics(variant))} <= outs
