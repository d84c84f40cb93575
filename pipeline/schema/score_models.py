"""The `score_models` section of params.yaml, read by stage `score_models`: each model alone on the dev items."""
from __future__ import annotations

from pipeline.store.params import Params, Positive


class ScoreModelsParams(Params):
    batch_size: Positive  # task requests per forward
