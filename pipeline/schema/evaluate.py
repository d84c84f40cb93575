"""The `evaluate` section: mapped variants (name -> mapper file), repairs (`kv.repair`), scoring against the oracle."""
from __future__ import annotations

import json

from pydantic import model_validator

from pipeline.kv.modes import BASELINES
from pipeline.kv.repair import Repair, RepairError
from pipeline.kv.speculative import SpeculativeParams
from pipeline.store.artifacts import ArtifactError
from pipeline.store.params import ParamError, Params, Positive, Processes
from pipeline.store.paths import SELECTED_MAPPER, SELECTED_REPAIR

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
            parsed = declared_repair(key, setting, self.mapped[name], "the variant")
            if parsed is not None and parsed.reads_source:
                raise ParamError(f"{key}: policy {parsed.select_by} reads params' `speculative` settings, which "
                                 f"evaluate does not (its oracle would rerun with them); give it through select "
                                 f"(select.repairs, then `selected`) or name another policy")
        return self


def declared_repair(key: str, setting: str, mapper: str, variant: str) -> Repair | None:
    """A variant's repair as params declare it; None for `selected`, which only the selected map may take."""
    if setting == SELECTED:
        if mapper != str(SELECTED_MAPPER):
            raise ParamError(f"{key}: `selected` is the setting select chose for {SELECTED_MAPPER}, but {variant} "
                             f"maps with {mapper}; name a setting instead")
        return None
    try:
        return Repair.parse(setting)
    except RepairError as error:
        raise ParamError(f"{key}: {error} (or `selected`)") from None


def selected_repair(key: str) -> tuple[Repair, SpeculativeParams | None]:
    """Select's choice (store.paths.SELECTED_REPAIR): its repair and, where its policy ranks by the source's look-ahead
    scores, the `speculative` settings select scored it under (read from there, not params); `key`: who asked."""
    if not SELECTED_REPAIR.is_file():
        raise ArtifactError(f"{key}: {SELECTED_REPAIR} not found; run the select stage")
    chosen = json.loads(SELECTED_REPAIR.read_text())
    setting, lookahead = Repair.parse(chosen["repair"]), chosen.get("speculative")
    if setting.reads_source and lookahead is None:
        raise ArtifactError(f"{key}: {SELECTED_REPAIR} chose {setting}, which ranks by the source's look-ahead "
                            f"scores, but holds no `speculative` settings; rerun the select stage")
    return setting, None if lookahead is None else SpeculativeParams.model_validate(lookahead)
