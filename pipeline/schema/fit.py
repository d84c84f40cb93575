"""The `fit` section: the candidate grid (closed-form families x ks x lambdas, the MLP's ks) and how it is solved;
`FitParams.candidates()` names every map it makes, which check_params holds other sections' map names against."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pipeline.fitting.families import closed_form_candidates, mlp_candidates
from pipeline.kv.families import CLOSED_FORM, FAMILIES
from pipeline.kv.mapnames import MapName
from pipeline.store.params import Params, Positive, PositiveFloat, Processes


class MlpParams(Params):
    ks: list[Positive]  # chosen source layers read by the MLP (one candidate per k); [] for none
    hidden: Positive
    lr: PositiveFloat
    batch_rows: Positive
    max_epochs: Positive
    patience: Positive  # epochs without a better held-out loss before stopping
    workers: Positive  # maps trained side by side in threads, each on fit.threads: the same bytes, more memory


class LowRankParams(Params):
    ranks: Annotated[list[Positive], Field(min_length=1)]  # one low_rank candidate per rank (and k and lambda)


class FitParams(Params):
    mlp: MlpParams
    low_rank: LowRankParams
    ks: Annotated[list[Positive], Field(min_length=1)]
    lambdas: Annotated[list[Annotated[float, Field(ge=0)]], Field(min_length=1)]
    lambda_scale: Literal["absolute", "relative"]  # relative: lambda times the mean centered Gram diagonal
    families: list[Literal[CLOSED_FORM]]  # the closed-form families fitted (kv.families.registry)
    probe_lambda: Annotated[float, Field(ge=0)]
    probe_holdout: Annotated[float, Field(gt=0, le=0.5)]  # share of fit sequences held out of the probes
    accumulator_gib: PositiveFloat  # float64 moments held at once; more passes if smaller
    probe_rows_gib: Annotated[float, Field(ge=0)]  # source rows kept across probe passes (stored dtype); else re-read
    seed: int
    timing_repeats: Positive
    processes: Processes  # each fitting every N-th target layer; mappers do not change

    def closed_form(self, families: list[str] | None = None) -> list[MapName]:
        """The closed-form grid of `families` (all of `fit.families` by default): a family whose names carry a
        rank reads its ranks from its own section (`fit.low_rank.ranks`)."""
        widths = {name: getattr(self, name).ranks for name in CLOSED_FORM if "rank" in FAMILIES[name].name_fields}
        return closed_form_candidates(self.families if families is None else families, self.ks, self.lambdas, widths)

    def candidates(self) -> list[str]:
        """The names of every map this grid fits (fit's files models/mappers/<name>.safetensors), before the
        pair's contract skips a family."""
        return [str(name) for name in self.closed_form() + mlp_candidates(self.mlp.ks)]
