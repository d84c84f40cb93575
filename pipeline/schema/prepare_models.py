"""The `train` section: the tiny pair's training, and the seed of a random pair's weights."""
from __future__ import annotations

from pipeline.store.params import Params
from pipeline.tiny.train import TrainConfig


class TrainParams(Params):
    random_seed: int  # models.kind `random`: the source's weight draw; the target's is the next seed
    source: TrainConfig | None  # required when models.kind is `trained`
    target: TrainConfig | None
