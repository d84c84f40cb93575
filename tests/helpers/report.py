"""A variant's fake evaluation (its metrics, item rows and prompt rows) and the committed report params: what the
report's studies are computed from."""
from __future__ import annotations

import numpy as np
import pandas as pd

from helpers import committed
from pipeline.store.params import parse
from pipeline.studies.settings import ReportParams


def _fake_variant(rng, acc_hs, acc_pq, agree, n=300, prompts=60):
    items = pd.DataFrame({"task": ["hellaswag"] * n + ["piqa"] * n, "item": list(range(n)) * 2,
                          "acc": np.r_[rng.random(n) < acc_hs, rng.random(n) < acc_pq].astype(float)})
    items["acc_norm"] = items.acc
    prompt_rows = pd.DataFrame({"prompt": range(prompts), "first_agree": (rng.random(prompts) < agree).astype(int),
                                "tokens": 16})
    prompt_rows["nll"] = 16 * (2 - agree) - prompt_rows.first_agree  # no draw: the items' draws stay as they were
    metrics = {"prompts": {"perplexity": 10 / max(agree, 0.1), "next_token_top1": agree, "agreement": agree,
                           "mean_kl": 1 - agree, "rollout_agreement": agree, "n": prompts},
               "tasks": {task: {"acc": frame.acc.mean(), "acc_norm": frame.acc.mean(), "n": n, "kinds": {}}
                         for task, frame in items.groupby("task")}}
    return metrics, items, prompt_rows


def report_params(**overrides) -> ReportParams:
    return parse(ReportParams, committed("report", **overrides), "report")
