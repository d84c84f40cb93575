"""Build the tiny pair outside DVC (for tuning the world): generate the world, train the tokenizer, train
the source and the target, save both in Hugging Face format with the tokenizer, and write their stats.

    PYTHONPATH=. python tools/build_tiny_pair.py OUT_DIR [--only source|target]
"""

import argparse
import json
from pathlib import Path

from pipeline.tokenizer import train_tokenizer
from pipeline.train import TrainConfig, train_model
from pipeline.world import WorldConfig, generate_world

SOURCE = TrainConfig(hidden=64, intermediate=128, copy_steps=400, mixed_steps=300, seed=1)
TARGET = TrainConfig(hidden=128, intermediate=256, copy_steps=400, mixed_steps=1200, seed=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", choices=("source", "target"))
    args = parser.parse_args()
    world = generate_world(WorldConfig())
    tokenizer = train_tokenizer(world["corpus"].text)
    dev = {"hellaswag": world["hellaswag_dev"], "piqa": world["piqa_dev"]}
    for role, cfg in (("source", SOURCE), ("target", TARGET)):
        if args.only and role != args.only:
            continue
        model, stats = train_model(cfg, tokenizer, world["corpus"], dev)
        model.save_pretrained(args.out / role)
        tokenizer.save_pretrained(args.out / role)
        (args.out / f"{role}-stats.json").write_text(json.dumps(stats, indent=1))
        print(role, "trained in", stats["train_seconds"], "s; dev", stats["dev"][-1])


if __name__ == "__main__":
    main()
