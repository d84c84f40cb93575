"""Measure a trained tiny pair on the dev items: target, source, and the target decoding from the
source's cache (direct injection) or from a zero cache, with paired bootstrap intervals against the target.

The cached variants follow PROTOCOL.md's last-token protocol: one model prefills context[:-1], the target
processes context[-1] + continuation from that cache. The target's own cache through the same path (the
oracle) must reproduce the plain target: checked here, as a guard on the plumbing.

    PYTHONPATH=. python tools/measure_tiny_pair.py PAIR_DIR   (written by tools/build_tiny_pair.py)
"""

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen3ForCausalLM

from pipeline.train import decide, encode_choices, score_items
from pipeline.world import KINDS, WorldConfig, generate_world

TASKS = ("hellaswag", "piqa")


@torch.no_grad()
def handoff_scores(prefill: Qwen3ForCausalLM, decode: Qwen3ForCausalLM, tokenizer, task: str, items: pd.DataFrame,
                   zero_cache: bool = False) -> pd.DataFrame:
    encoded = encode_choices(tokenizer, task, items)
    lls = []
    for e in encoded:
        prefix = torch.tensor([e["context"][:-1]])  # (1, n-1)
        for continuation in e["continuations"]:
            # the decode step appends to the cache, so every choice starts from a fresh prefill
            cache = prefill.model(input_ids=prefix, use_cache=True).cache
            if zero_cache:
                for layer in cache.layers:
                    layer.keys.zero_()
                    layer.values.zero_()
            rest = torch.tensor([e["context"][-1:] + continuation])  # (1, 1+L)
            logprobs = F.log_softmax(decode(input_ids=rest, cache=cache).logits.float(), dim=-1)[0]  # (1+L, V)
            lls.append(logprobs[torch.arange(len(continuation)), torch.tensor(continuation)].sum().item())
    return decide(encoded, lls, items)


def paired_ci(a: np.ndarray, b: np.ndarray, resamples: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of a - b over items and its paired-bootstrap 95% interval (items resampled with replacement)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(a), (resamples, len(a)))  # (R, N)
    diffs = (a - b)[picks].mean(axis=1)  # (R,)
    return float((a - b).mean()), float(np.quantile(diffs, 0.025)), float(np.quantile(diffs, 0.975))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pair", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = generate_world(WorldConfig())
    tokenizer = AutoTokenizer.from_pretrained(args.pair / "target")
    source = Qwen3ForCausalLM.from_pretrained(args.pair / "source").eval()
    target = Qwen3ForCausalLM.from_pretrained(args.pair / "target").eval()
    report = {}
    for task in TASKS:
        items = world[f"{task}_dev"]
        variants = {
            "target": score_items(target, tokenizer, task, items),
            "source": score_items(source, tokenizer, task, items),
            "oracle": handoff_scores(target, target, tokenizer, task, items),
            "direct": handoff_scores(source, target, tokenizer, task, items),
            "zero": handoff_scores(target, target, tokenizer, task, items, zero_cache=True),
        }
        gap = max(abs(a - b) for x, y in zip(variants["target"].ll, variants["oracle"].ll) for a, b in zip(x, y))
        if gap > 1e-4 or not variants["target"].acc.equals(variants["oracle"].acc):
            raise RuntimeError(f"{task}: the oracle handoff differs from the plain target (max |dll| {gap:.2e})")
        for name, scored in variants.items():
            for metric in ("acc", "acc_norm"):
                row = {"all": float(scored[metric].mean())}
                row.update({k: float(scored[metric][scored.kind == k].mean()) for k in KINDS})
                report[f"{task}/{name}/{metric}"] = row
            if name != "target":
                ci = {"all": paired_ci(variants["target"].acc.to_numpy(), scored.acc.to_numpy())}
                for k in KINDS:
                    mask = (scored.kind == k).to_numpy()
                    ci[k] = paired_ci(variants["target"].acc.to_numpy()[mask], scored.acc.to_numpy()[mask])
                report[f"{task}/target-minus-{name}/acc"] = ci
        report[f"{task}/n"] = {"all": len(items), **{k: int((items.kind == k).sum()) for k in KINDS}}
        report[f"{task}/oracle_max_abs_ll_gap"] = gap
    (args.pair / "measure.json").write_text(json.dumps(report, indent=1))
    for key, row in report.items():
        print(key, json.dumps(row))


if __name__ == "__main__":
    main()
