"""A small draw of the tiny world, as its generator, items and tokenizer tests read it."""
from __future__ import annotations

import pandas as pd

from helpers import committed
from pipeline.store.params import parse
from pipeline.tiny.corpus import generate_world
from pipeline.tiny.world import WorldConfig

SMALL = parse(WorldConfig, committed("data.world", corpus_docs=400), "data.world")


def small_world(cfg: WorldConfig = SMALL, fit: int = 6, items_per_part: int = 40) -> dict[str, pd.DataFrame]:
    return generate_world(cfg, {"fit": fit, "select": 4, "eval": 5}, items_per_part)
