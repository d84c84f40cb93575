"""Benchmark: lm-eval's stock `hf` model and the `kv-transfer` oracle on the same HellaSwag rows, side by side.

kv-transfer prefills each context once for its four endings, where `hf` runs context + ending four times, so
on HellaSwag it should take about half of `hf`'s time at equal results. Both read one random Llama-shaped model
(SmolLM-135M's body, ~107M parameters, the tests' locally trained tokenizer, float32) saved to a temp folder,
and score the rows in `tests/data/` through lm-eval's own HellaSwag task; only their `loglikelihood` calls are
timed. Run `make bench-eval`, or:

    python tools/bench_eval.py --items 40 --batch-sizes 1 16 --threads 2 [--profile kv-16]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the world it times is the tests' own
from helpers import hellaswag_rows, task_texts, train_tokenizer, write_jsonl  # noqa: E402
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.lm_eval_model import KVTransferLM
from pipeline.measure.tasks import write_task_config

TASK = "hellaswag_bench"
FIRST_ROW = 200  # rows the tokenizer saw least of: it is trained on all 300, as in the tests


def save_model(folder: Path, layers: int) -> Path:
    """A random Llama of SmolLM-135M's shape (hidden 576, 9 heads over 3 KV heads) with the tests' tokenizer."""
    tokenizer = train_tokenizer(task_texts(), vocab_size=1024)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {layers} layers")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def evaluate(lm, task_dir: Path, repeats: int, profile: Path | None = None) -> dict:
    """Seconds spent in `lm.loglikelihood` (the fastest of `repeats` calls: other work on a shared machine only
    ever adds time), per-choice (loglikelihood, is_greedy) per document, acc, acc_norm."""
    call, spent = lm.loglikelihood, []

    def timed(requests, **options):
        times = []
        for _ in range(repeats):
            profiler = cProfile.Profile() if profile else None
            start = time.perf_counter()
            if profiler:
                profiler.enable()
            out = call(requests, **options)
            if profiler:
                profiler.disable()
            times.append(time.perf_counter() - start)
            if profiler and times[-1] == min(times):
                profiler.dump_stats(profile)
        spent.append(min(times))
        return out

    lm.loglikelihood = timed
    out = simple_evaluate(model=lm, tasks=[TASK],
                          task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                          num_fewshot=0, log_samples=True, bootstrap_iters=0)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return {"seconds": sum(spent), "choices": [[(float(r[0][0]), bool(r[0][1])) for r in s["resps"]] for s in samples],
            "acc": [s["acc"] for s in samples], "acc_norm": [s["acc_norm"] for s in samples]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=40, help="HellaSwag items (4 requests each)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=2, help="time each model this many times, keep the fastest")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (30: SmolLM-135M's)")
    parser.add_argument("--profile", nargs="*", default=[], metavar="MODEL-BATCH",
                        help="print cProfile's top entries for these runs, e.g. kv-16 hf-1")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = save_model(root / "model", args.layers)
        rows = hellaswag_rows(FIRST_ROW + args.items)[FIRST_ROW:]
        write_task_config(root / "tasks", "hellaswag", TASK, write_jsonl(root / "rows.jsonl", rows))
        table = []
        for batch in args.batch_sizes:
            results = {}
            for name in ("hf", "kv"):
                if name == "hf":
                    lm = HFLM(pretrained=str(folder), batch_size=batch, device="cpu", dtype="float32",
                              softmax_dtype="float32")
                else:
                    lm = KVTransferLM.from_args(target=str(folder), transfer="oracle", dtype="float32", device="cpu",
                                                batch_size=batch)
                profile = root / f"{name}-{batch}.prof" if f"{name}-{batch}" in args.profile else None
                results[name] = evaluate(lm, root / "tasks", args.repeats, profile)
                if profile:
                    print(f"\ncProfile, {name} at batch {batch}:")
                    stats = pstats.Stats(str(profile))
                    stats.sort_stats("tottime").print_stats(12)
                    stats.sort_stats("cumulative").print_stats(r"handoff|huggingface", 8)  # where the time goes
            hf, kv = results["hf"], results["kv"]
            delta = max(abs(a[0] - b[0]) for x, y in zip(kv["choices"], hf["choices"]) for a, b in zip(x, y))
            same = ([[g for _, g in doc] for doc in kv["choices"]] == [[g for _, g in doc] for doc in hf["choices"]]
                    and kv["acc"] == hf["acc"] and kv["acc_norm"] == hf["acc_norm"])
            table.append((batch, hf, kv, delta, same))


    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    print(f"\nHellaSwag, {args.items} items, float32, {args.threads} threads, fastest of {args.repeats}")
    print("| batch | hf s | kv-transfer s | ratio | hf acc / acc_norm | kv acc / acc_norm | max abs delta ll | "
          "same is_greedy and decisions |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, hf, kv, delta, same in table:
        print(f"| {batch} | {hf['seconds']:.2f} | {kv['seconds']:.2f} | {kv['seconds'] / hf['seconds']:.2f}x | "
              f"{mean(hf['acc']):.3f} / {mean(hf['acc_norm']):.3f} | {mean(kv['acc']):.3f} / "
              f"{mean(kv['acc_norm']):.3f} | {delta:.1e} | {'yes' if same else 'NO'} |")
    if not all(same for *_, same in table):
        sys.exit("kv-transfer's decisions differ from hf's")


if __name__ == "__main__":
    main()
