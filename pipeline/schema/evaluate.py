"""The `evaluate` section of params.yaml, read by stage `evaluate`: the mapped variants (name -> mapper file) and
how each variant is scored against the oracle."""
from __future__ import annotations

from pydantic import model_validator

from pipeline.store.params import ParamError, Params, Positive, Processes, Threads
from pipeline.store.paths import BASELINES


class EvaluateParams(Params):
    mapped: dict[str, str]  # variant -> mapper file, a stage's output (check_params)
    top_k: Positive
    horizon: Positive
    batch_size: Positive
    shuffle_seed: int
    threads: Threads
    processes: Processes  # each scoring every N-th batch and task document

    @model_validator(mode="after")
    def _variants(self) -> EvaluateParams:
        for name in self.mapped:
            if name in BASELINES:
                raise ParamError(f"evaluate.mapped.{name}: a mapped variant cannot take a baseline's name")
        return self
