"""The `evaluate` section of params.yaml, read by stage `evaluate`: the mapped variants (name -> mapper file), the
repair setting some of them apply (`kv.repair`), and how each variant is scored against the oracle."""
from __future__ import annotations

from pydantic import model_validator

from pipeline.kv.modes.registry import BASELINES
from pipeline.kv.repair import Repair, RepairError
from pipeline.store.params import ParamError, Params, Positive, Processes
from pipeline.store.paths import SELECTED_MAPPER

SELECTED = "selected"  # a repair of evaluate.repair read from select's choice (store.paths.SELECTED_REPAIR)


class EvaluateParams(Params):
    mapped: dict[str, str]  # variant -> mapper file, a stage's output (check_params)
    repair: dict[str, str]  # variant of `mapped` -> kv.repair's string form, or `selected`: the setting select chose
    top_k: Positive
    horizon: Positive
    batch_size: Positive
    shuffle_seed: int
    processes: Processes  # each scoring every N-th batch and task document

    @model_validator(mode="after")
    def _variants(self) -> EvaluateParams:
        for name in self.mapped:
            if name in BASELINES:
                raise ParamError(f"evaluate.mapped.{name}: a mapped variant cannot take a baseline's name")
        for name, setting in self.repair.items():
            key = f"evaluate.repair.{name}"
            if name not in self.mapped:
                raise ParamError(f"{key}: not a variant of evaluate.mapped ({', '.join(self.mapped)}); add it there "
                                 f"with its mapper file")
            if name == "shuffled":
                raise ParamError(f"{key}: the shuffled-cache null control takes no repair; repair another variant")
            if setting == SELECTED and self.mapped[name] != str(SELECTED_MAPPER):
                raise ParamError(f"{key}: `selected` is the setting select chose for {SELECTED_MAPPER}, but the "
                                 f"variant maps with {self.mapped[name]}; name a setting instead")
            if setting != SELECTED:
                try:
                    Repair.parse(setting)
                except RepairError as error:
                    raise ParamError(f"{key}: {error} (or `selected`)") from None
        return self
