"""One map scored by a gate's score on hand-built dev and eval rows: what the selective stage summarizes and its
study reads."""
from __future__ import annotations

import numpy as np
import pandas as pd

from helpers import committed
from pipeline.measure.confident import MARGINS
from pipeline.schema.selective import SelectiveParams
from pipeline.store.params import parse


def _summary_inputs(margins: list[list[float]]) -> tuple:
    """One map `a` scored by `entropy` on hand-built rows: 40 dev and 40 eval items (both tasks) where the score ranks
    the changed ones first (with noise), and eval prompts with the oracle's margins `margins` per position."""
    rng = np.random.default_rng(3)
    items = []
    for part in ("dev", "eval"):
        changed = np.arange(40) % 3 == 0
        task = np.where(np.arange(40) % 2, "piqa", "hellaswag")
        items.append(pd.DataFrame({"part": part, "map": "a", "task": task, "item": range(40),
                                   "mapped": (~changed).astype(int), "oracle": 1, "source": 0, "changed": changed,
                                   "score_entropy": changed + rng.normal(0, 0.4, 40)}))
    first_agree = np.arange(len(margins)) % 2
    prompts = pd.DataFrame({"map": "a", "prompt": range(len(margins)), "first_agree": first_agree,
                            "rollout_agree": first_agree, "horizon": 1, MARGINS: margins, "changed": first_agree == 0,
                            "score_entropy": (first_agree == 0) + rng.normal(0, 0.4, len(margins))})
    params = parse(SelectiveParams, {**committed("selective"), "maps": {"a": "a.safetensors"}, "scores": ["entropy"]},
                   "selective")
    costs = {"a": {"target_ms": 10.0, "handoff_ms": 4.0, "entropy_ms": 0.1, "target": 10.0, "handoff": 3.0,
                   "entropy": 0.01}}
    return pd.concat(items, ignore_index=True), prompts, params, costs
