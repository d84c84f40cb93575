"""The `operating` section (stage `operating@<n>`): the variants handed off at each operating length
(data.long.lengths), and how each is scored against the oracle and timed on the same prompts."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.kv.modes import BASELINES
from pipeline.schema.evaluate import declared_repair
from pipeline.store.params import ParamError, Params, Positive


class Repaired(Params):
    map: str  # a variant of operating.maps
    repair: str  # kv.repair's string form, or `selected`


class OperatingParams(Params):
    lengths: list[Annotated[int, Field(ge=2)]]  # one stage each, every one a key of data.long.lengths
    baselines: list[str]  # modes without a map beside the oracle (kv.modes.BASELINES)
    maps: dict[str, str]  # variant -> mapper file (a stage's output)
    repaired: dict[str, Repaired]  # variant -> a map of `maps` under a repair
    truncated: bool  # the truncated prompt (the oracle at `keep`) at each repaired variant's budget at the length
    speculative: list[Annotated[float, Field(gt=0, le=1)]]  # speculative prefill's shares p, a variant each
    recall_ngram: Annotated[int, Field(ge=2)]  # a recall position extends an (n-1)-gram the prompt holds
    top_k: Positive
    horizon: Positive  # greedy rollout tokens after each prompt (a pass-key item reads its key's first tokens)

    def speculative_variants(self) -> dict[str, float]:
        return {f"speculative_{share:g}": share for share in self.speculative}

    @model_validator(mode="after")
    def _variants(self) -> OperatingParams:
        if len(set(self.speculative)) != len(self.speculative):
            raise ParamError(f"operating.speculative: a share is listed twice in {self.speculative}; list each once")
        names = [*self.baselines, *self.maps, *self.repaired, *self.speculative_variants()]
        twice = sorted({name for name in names if names.count(name) > 1} | {"oracle"} & set(names))
        if twice:
            raise ParamError(f"operating: the variant name {twice[0]!r} is used twice (or is the oracle's); give "
                             f"each variant of baselines, maps and repaired its own name (speculative's are "
                             f"speculative_<p>)")
        for name in self.baselines:
            if name not in BASELINES:
                raise ParamError(f"operating.baselines: {name!r} is not a mode without a map ({', '.join(BASELINES)})")
        for name, entry in self.repaired.items():
            if entry.map not in self.maps:
                raise ParamError(f"operating.repaired.{name}.map: {entry.map!r} is not a variant of operating.maps "
                                 f"({', '.join(self.maps) or 'none'})")
            declared_repair(f"operating.repaired.{name}.repair", entry.repair, self.maps[entry.map], repr(entry.map))
        if len(set(self.lengths)) != len(self.lengths):
            raise ParamError(f"operating.lengths: a length is listed twice in {self.lengths}; list each once")
        return self
