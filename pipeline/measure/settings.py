"""The `measure` section of params.yaml: how every stage and study measures against the oracle and resamples."""
from __future__ import annotations

from pipeline.store.params import Params, Positive, Share


class MeasureParams(Params):
    # a position is confident where the oracle's top-2 probabilities differ by at least this (`measure.confident`)
    confident_margin: Share
    bootstrap_iters: Positive  # every bootstrap interval, paired or per item
    bootstrap_seed: int
    # the studies beyond V0's table (candidates, repair, length, calibrate) score each task's first n
    # eval items (None: all); evaluate's variants always score every eval item
    study_items: Positive | None

    @property
    def bootstrap(self) -> tuple[int, int]:
        """(iterations, seed): the last two arguments of every bootstrap interval."""
        return self.bootstrap_iters, self.bootstrap_seed
