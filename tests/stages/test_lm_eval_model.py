"""The `kv-transfer` lm-eval model: the exactness gate against lm-eval's stock `hf` model on real
HellaSwag and PIQA rows, through lm-eval's own task definitions pointed at local files; its model args (a repair)
refused in one line before any model loads."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from helpers import ROOT, WIKITEXT, committed, hellaswag_rows, piqa_rows, train_tokenizer, write_jsonl
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, MistralConfig

from pipeline.kv.contract import UnsupportedModelError
from pipeline.kv.mapper import identity_mapper, random_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair, RepairError
from pipeline.kv.router import Router
from pipeline.kv.routes import CACHED, EMPTY_PREFIX, REPAIRED, Route
from pipeline.kv.scoring import truncate
from pipeline.lm_eval_model import KVTransferLM, cache_key, main
from pipeline.measure.adapter import HandoffLM
from pipeline.measure.taskeval import evaluate_tasks
from pipeline.measure.tasks import write_task_config
from pipeline.prepare_data import run as prepare_data_run
from pipeline.schema.prepare_data import DataParams
from pipeline.store import devices
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.models import IncompatiblePairError, ModelNotAvailableError
from pipeline.store.params import ParamError, parse

TOLERANCES = yaml.safe_load((ROOT / "params.yaml").read_text())["tolerances"]
TASKS = ["hellaswag_local", "piqa_local"]
N_ITEMS = 40
FLOAT32_ABS = 1e-4  # |delta log-likelihood| of the kv-transfer oracle against stock hf, in float32 (PROTOCOL.md)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    write_task_config(root, "hellaswag", "hellaswag_local", write_jsonl(root / "hs.jsonl", hellaswag_rows(N_ITEMS)))
    write_task_config(root, "piqa", "piqa_local", write_jsonl(root / "pq.jsonl", piqa_rows(N_ITEMS)))
    return root


def evaluate(lm, task_dir, **options) -> dict:
    """Per task: per-document list of (loglikelihood, is_greedy) per choice, the acc/acc_norm decisions and the
    (context, continuation) requests. `options` go to `simple_evaluate` (`apply_chat_template=True`, ...)."""
    # our task files only: indexing lm-eval's own catalogue costs seconds per call
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = simple_evaluate(model=lm, tasks=TASKS, task_manager=manager,
                          num_fewshot=0, log_samples=True, bootstrap_iters=0, **options)
    per_task = {}
    for task in TASKS:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        per_task[task] = {
            "choices": [[(float(r[0][0]), bool(r[0][1])) for r in s["resps"]] for s in samples],
            "acc": [s["acc"] for s in samples],
            "acc_norm": [s["acc_norm"] for s in samples],
            "requests": [[tuple(a) for a in s["arguments"]] for s in samples],
        }
    return per_task


def stock_hf(path, dtype):
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    # log-softmax in float32 as kv-transfer does: the comparison is of the cache path, not of softmax rounding
    return HFLM(pretrained=model, tokenizer=__import__("transformers").AutoTokenizer.from_pretrained(path),
                batch_size=8, device="cpu", softmax_dtype="float32")


def max_delta(ours, reference):
    return max(abs(a[0] - b[0]) for task in TASKS
               for doc_a, doc_b in zip(ours[task]["choices"], reference[task]["choices"])
               for a, b in zip(doc_a, doc_b))


def beyond_float32_tolerance(ours, reference, tolerance: float) -> list[tuple[str, int, float, float]]:
    """Choices whose loglikelihoods differ by more than `tolerance` plus two float32 steps at their size. Each
    side sums its continuation's token log-probs in float32, in its own order: past 1024 the steps are 1.2e-4,
    so a 180-token PIQA answer can land one step apart while its tokens agree to 1e-6."""
    return [(task, doc, a[0], b[0]) for task in TASKS
            for doc, (doc_a, doc_b) in enumerate(zip(ours[task]["choices"], reference[task]["choices"]))
            for a, b in zip(doc_a, doc_b)
            if abs(a[0] - b[0]) > tolerance + 2 * float(np.spacing(np.float32(abs(b[0]))))]


@pytest.fixture(scope="module")
def reference_float32(tiny_pair, task_dir):
    return evaluate(stock_hf(tiny_pair["target"], torch.float32), task_dir)


@pytest.mark.parametrize("transfer", ["oracle", "direct"])
def test_exactness_gate_float32(tiny_pair, task_dir, reference_float32, transfer):
    source = {"source": str(tiny_pair["target"])} if transfer == "direct" else {}
    lm = KVTransferLM.from_args(target=str(tiny_pair["target"]), transfer=transfer, dtype="float32", device="cpu",
                                **source)
    ours = evaluate(lm, task_dir)
    delta = max_delta(ours, reference_float32)
    print(f"\nexactness gate float32 {transfer}: max |delta loglikelihood| = {delta:.2e}")
    assert not beyond_float32_tolerance(ours, reference_float32, FLOAT32_ABS), delta
    for task in TASKS:
        assert len(ours[task]["choices"]) == N_ITEMS
        assert [[g for _, g in doc] for doc in ours[task]["choices"]] == \
               [[g for _, g in doc] for doc in reference_float32[task]["choices"]]
        assert ours[task]["acc"] == reference_float32[task]["acc"]
        assert ours[task]["acc_norm"] == reference_float32[task]["acc_norm"]
    if transfer == "direct":  # HellaSwag's four endings and PIQA's two share one source prefill
        assert lm.handoff.inputs.source_prefills == 2 * N_ITEMS


def test_exactness_gate_bfloat16(tiny_pair, task_dir):
    epsilon = TOLERANCES["bfloat16"]["decision_margin"]
    ours = evaluate(KVTransferLM.from_args(target=str(tiny_pair["target"]), dtype="bfloat16", device="cpu"),
                    task_dir)
    reference = evaluate(stock_hf(tiny_pair["target"], torch.bfloat16), task_dir)
    flipped, near_ties = 0, 0
    for task in TASKS:
        for doc_ours, doc_ref in zip(ours[task]["choices"], reference[task]["choices"]):
            scores = sorted(ll for ll, _ in doc_ref)
            near_tie = scores[-1] - scores[-2] < epsilon
            near_ties += near_tie
            if max(range(len(doc_ours)), key=lambda i: doc_ours[i][0]) != \
               max(range(len(doc_ref)), key=lambda i: doc_ref[i][0]):
                flipped += 1
                assert near_tie, "a bfloat16 decision flipped on an item with a clear margin"
    print(f"\nexactness gate bfloat16: max |delta| = {max_delta(ours, reference):.3e}, "
          f"items under margin {epsilon}: {near_ties}, decisions flipped: {flipped}")


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
NO_SYSTEM_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                      + CHAT_TEMPLATE)
SYSTEM = "Pick the most likely ending."


@pytest.fixture(scope="module")
def chat_target(tiny_pair, tmp_path_factory) -> Path:
    """The tiny target, saved with a chat template that marks each turn with `<|role|>`."""
    folder = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_pair["target"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_chat_templated_oracle_matches_stock_hf_with_the_same_template(chat_target, task_dir):
    chat = {"apply_chat_template": True, "system_instruction": SYSTEM}
    ours = evaluate(KVTransferLM.from_args(target=str(chat_target), transfer="oracle", device="cpu"), task_dir,
                    **chat)
    reference = evaluate(stock_hf(chat_target, torch.float32), task_dir, **chat)
    delta = max_delta(ours, reference)
    print(f"\nchat-templated oracle float32: max |delta loglikelihood| = {delta:.2e}")
    assert not beyond_float32_tolerance(ours, reference, FLOAT32_ABS)
    for task in TASKS:
        assert ours[task]["requests"] == reference[task]["requests"]
        for requests in ours[task]["requests"]:  # the template was applied, with the system instruction
            for context, _ in requests:
                assert context.startswith(f"<|system|>\n{SYSTEM}\n<|user|>\n")
                assert context.endswith("<|assistant|>\n")
        assert [[g for _, g in doc] for doc in ours[task]["choices"]] == \
               [[g for _, g in doc] for doc in reference[task]["choices"]]
        assert ours[task]["acc"] == reference[task]["acc"]
        assert ours[task]["acc_norm"] == reference[task]["acc_norm"]


def test_chat_template_renders_as_stock_hf_also_without_a_system_role(chat_target):
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Question: why?\nAnswer:"}]
    prefilled = [*history, {"role": "assistant", "content": "Because"}]
    ours = KVTransferLM.from_args(target=str(chat_target), device="cpu")
    wrapped = KVTransferLM(ours.router, AutoTokenizer.from_pretrained(chat_target))
    reference = stock_hf(chat_target, torch.float32)
    for lm in (ours, wrapped):
        assert lm.tokenizer_name == reference.tokenizer_name and "/" not in lm.tokenizer_name
        assert lm.chat_template(True) == reference.chat_template(True) == CHAT_TEMPLATE
        assert lm.chat_template(False) is None
        assert lm.apply_chat_template(history) == reference.apply_chat_template(history) == \
               f"<|system|>\n{SYSTEM}\n<|user|>\nQuestion: why?\nAnswer:\n<|assistant|>\n"
        # a task's assistant prefix (gen_prefix) is left open for the continuation
        assert lm.apply_chat_template(prefilled, add_generation_prompt=False) == \
               reference.apply_chat_template(prefilled, add_generation_prompt=False)
        assert lm.apply_chat_template(prefilled, add_generation_prompt=False).endswith("<|assistant|>\nBecause")
        lm.tokenizer.chat_template = reference.tokenizer.chat_template = NO_SYSTEM_TEMPLATE
        assert lm.apply_chat_template(history) == reference.apply_chat_template(history) == \
               "<|user|>\nQuestion: why?\nAnswer:\n<|assistant|>\n"
        lm.tokenizer.chat_template = reference.tokenizer.chat_template = CHAT_TEMPLATE


def test_a_target_without_a_chat_template_is_refused_naming_it(tiny_pair):
    with pytest.raises(ValueError, match=re.escape(f"{tiny_pair['target']} has none")):
        KVTransferLM.from_args(target=str(tiny_pair["target"]), device="cpu").apply_chat_template(
            [{"role": "user", "content": "hi"}])


def test_incompatible_tokenizers_fail_closed_naming_both(tmp_path, tiny_pair):
    other = train_tokenizer(["a small different corpus for another vocabulary"] * 10, vocab_size=300)
    source = tmp_path / "other-source"
    __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_pair["source"]).save_pretrained(source)
    other.save_pretrained(source)
    with pytest.raises(IncompatiblePairError, match="other-source") as info:
        KVTransferLM.from_args(target=str(tiny_pair["target"]), source=str(source), transfer="direct",
                               device="cpu")
    assert str(tiny_pair["target"]) in str(info.value)


def test_a_windowed_model_is_scored_up_to_its_window_and_refused_at_a_max_length_past_it(tmp_path, tokenizer):
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                           max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mistral")
    tokenizer.save_pretrained(tmp_path / "mistral")
    lm = KVTransferLM.from_args(target=str(tmp_path / "mistral"), device="cpu")  # checked per sequence
    assert lm.handoff.window == 32
    with pytest.raises(UnsupportedModelError, match="sliding window of 32 tokens, active at 64 tokens"):
        KVTransferLM.from_args(target=str(tmp_path / "mistral"), device="cpu", max_length=64)


def test_missing_model_is_named_and_fails_fast():
    with pytest.raises(ModelNotAvailableError, match="no-such-org/no-such-model"):
        KVTransferLM.from_args(target="no-such-org/no-such-model", device="cpu")


def test_bad_model_args_are_refused(tiny_pair):
    with pytest.raises(ValueError, match="needs a mapper"):
        KVTransferLM.from_args(target=str(tiny_pair["target"]), source=str(tiny_pair["source"]),
                               transfer="mapped")
    with pytest.raises(ParamError, match=r"^kv-transfer: unknown model arg tranfser= \(known: target, source, "):
        KVTransferLM.from_args(target=str(tiny_pair["target"]), tranfser="direct")


def test_generate_until_stops_and_matches_stock_hf(tiny_pair):
    from lm_eval.api.instance import Instance

    request = Instance("generate_until", {},
                       ("Question: how do you boil water?\nAnswer:", {"until": ["\n"], "max_gen_toks": 12}), 0)
    ours = KVTransferLM.from_args(target=str(tiny_pair["target"]), device="cpu").generate_until([request])
    reference = stock_hf(tiny_pair["target"], torch.float32).generate_until([request])
    assert ours == reference


def test_command_line_runs_lm_eval_with_kv_transfer_and_reports_every_requests_route(tiny_pair, task_dir, tmp_path):
    limit, choices = 4, 2  # PIQA: two solutions per item, one request each
    args = ["--model", "kv-transfer", "--model_args", f"target={tiny_pair['target']},source={tiny_pair['source']},"
            "transfer=direct,device=cpu", "--tasks", "piqa_local", "--include_path",
            str(task_dir), "--limit", str(limit), "--log_samples", "--output_path", str(tmp_path)]
    run = subprocess.run([sys.executable, "-m", "pipeline.lm_eval_model", *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "piqa_local" in run.stdout and "acc" in run.stdout
    # the counts, in what the command prints and in the results it writes
    requests = limit * choices
    lines = run.stdout.splitlines()
    assert "kv-transfer routes (transfer=direct, repair=none):" in lines
    assert f"  piqa_local: {requests} requests: {requests} direct, 0 {EMPTY_PREFIX}" in lines
    (results,) = tmp_path.rglob("results_*.json")
    recorded = json.loads(results.read_text())["config"]["kv_transfer"]
    assert recorded == {"transfer": "direct", "repair": "none",
                        "routes": {"piqa_local": {"requests": requests, "direct": requests, EMPTY_PREFIX: 0}},
                        "requests": {}}  # no document went another way than the handoff's own


@pytest.fixture(scope="module")
def wide_map(wide_pair, tmp_path_factory) -> Path:
    """A random k=1 map of conftest's wide pair, bound to the pair."""
    source, target = (Pair(str(wide_pair[side])).target for side in ("source", "target"))
    mapper = random_mapper(source.config, target.config, k=1, seed=0)
    mapper.models = pair_fingerprints(str(wide_pair["source"]), str(wide_pair["target"]))
    path = tmp_path_factory.mktemp("wide-map") / "k1.safetensors"
    save_mapper(mapper, path)
    return path


ROUTED_ITEMS = 6  # per task, in the route tests


def routed_run(task_dir, **model_args) -> tuple[KVTransferLM, dict]:
    """The kv-transfer model of `model_args` (on the wide pair's CPU float32 defaults) evaluated on ROUTED_ITEMS items
    of each task as the `run` command evaluates it: its results carry the routes."""
    lm = KVTransferLM.from_args(dtype="float32", device="cpu", batch_size=4, **model_args)
    out = simple_evaluate(model=lm, tasks=TASKS, task_manager=TaskManager(include_path=str(task_dir),
                                                                         include_defaults=False),
                          num_fewshot=0, log_samples=True, bootstrap_iters=0, limit=ROUTED_ITEMS)
    return lm, out


def request_contexts(lm: KVTransferLM, samples: list[dict]) -> list[list[int]]:
    """Every request's context tokens, as the handoff sees them, in the samples' order."""
    return [truncate(lm.context_tokens(context, continuation), lm.tok_encode(continuation), lm.max_length)
            for sample in samples for context, continuation in sample["arguments"]]


def test_rank_zero_counts_every_ranks_requests_once_after_gathering_the_routes(tiny_pair):
    from lm_eval.api.instance import Instance

    def request(doc_id: int, index: int) -> Instance:
        return Instance("loglikelihood", {}, (f"context {doc_id}", f" ending {index}"), index,
                        ("piqa_local", doc_id, 1))

    other_rank = KVTransferLM.from_args(target=str(tiny_pair["target"]), device="cpu")
    for doc_id in (1, 3):
        other_rank.ledger.record(request(doc_id, 0), Route("oracle"), ([1, 2], [3]))

    class TwoRanks:  # rank 0 of two, receiving the other rank's ledger (lm-eval gave it the odd documents)
        rank, size = 0, 2

        def gather(self, value, dst: int = 0) -> list:
            return [value, (other_rank.ledger.entries, other_rank.ledger.tokens)]

    lm = KVTransferLM(other_rank.router, other_rank.tokenizer, ranks=TwoRanks())
    for doc_id in (0, 2):
        for _ in range(2):  # lm-eval pads a rank's requests with copies of its last one: the same request
            lm.ledger.record(request(doc_id, 0), Route("oracle"))
    assert lm.route_counts() == {"piqa_local": {"requests": 2, "oracle": 2}}
    lm.gather_object({"samples": []})  # lm-eval's first gather after the requests: the routes come along
    assert lm.route_counts() == {"piqa_local": {"requests": 4, "oracle": 4}}
    lm.gather_object({"metrics": {}})  # lm-eval's later gathers: the routes were gathered once already
    assert lm.route_counts() == {"piqa_local": {"requests": 4, "oracle": 4}}
    assert lm.ledger.tokens == {("piqa_local", doc_id, 0): ([1, 2], [3]) for doc_id in (1, 3)}  # the scored ids too


def test_a_repair_setting_routes_every_request_as_repaired(wide_pair, wide_map, task_dir):
    setting = Repair.parse("sink:2")
    lm, out = routed_run(task_dir, target=str(wide_pair["target"]), source=str(wide_pair["source"]),
                         transfer="mapped", mapper=str(wide_map), repair=str(setting))
    assert out["config"]["kv_transfer"]["repair"] == str(setting)
    for task in TASKS:
        requests = len(request_contexts(lm, out["samples"][task]))
        assert out["config"]["kv_transfer"]["routes"][task] == {"requests": requests, REPAIRED: requests,
                                                                EMPTY_PREFIX: 0}
    assert out["config"]["kv_transfer"]["requests"] == {}  # no request went another way than the handoff's own
    # and it was repaired: the sink of every prefix the source handed off (each longer than the sink)
    assert lm.handoff.repaired.recomputed == setting.sink * lm.handoff.inputs.source_prefills > 0


def test_loglikelihood_rolling_matches_stock_hf(tiny_pair):
    from lm_eval.api.instance import Instance

    text = WIKITEXT.read_text()[:3000]
    requests = [Instance("loglikelihood_rolling", {}, (chunk,), i)
                for i, chunk in enumerate([text[:400], text[400:3000]])]
    ours = KVTransferLM.from_args(target=str(tiny_pair["target"]), device="cpu",
                                  max_length=64).loglikelihood_rolling(requests)
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_pair["target"]).eval()
    reference = HFLM(pretrained=model, tokenizer=__import__("transformers").AutoTokenizer.from_pretrained(
        tiny_pair["target"]), batch_size=4, device="cpu", max_length=64).loglikelihood_rolling(requests)
    assert ours == pytest.approx(reference, abs=1e-3)


def readme_command(marker: str) -> list[str]:
    """The documented shell command (docs/interfaces.md) containing `marker`, continuations joined, split into words."""
    text = (ROOT / "docs/interfaces.md").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if marker in line)
    return shlex.split(line)


@pytest.mark.slow  # end to end: prepare_data, then lm-eval's command line in a subprocess
def test_the_readme_local_command_runs_offline_on_cpu(tmp_path, tiny_pair):
    for name in ("source", "target"):
        shutil.copytree(tiny_pair[name], tmp_path / "models" / name)
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"])
    source = AutoModelForCausalLM.from_pretrained(tiny_pair["source"])
    mapper = identity_mapper("source", "target", source.config, target.config)
    mapper.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))  # fitted on this pair
    save_mapper(mapper, tmp_path / "models" / "mapper.safetensors")
    data = committed("data", fit_sequences=4, select_sequences=3, eval_prompts=3, sequence_length=48,
                     prompt_length=20, continuation_length=8, dev_items=6, eval_items=6,
                     world=committed("data.world", corpus_docs=300))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)  # the task configs name their files relative to the repository root
        prepare_data_run(parse(DataParams, data, "data"), Path("data"))
    words = readme_command("--include_path data/tasks")
    assert words[:3] == [".venv/bin/python", "-m", "pipeline.lm_eval_model"]
    run = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "kvh_hellaswag_eval" in run.stdout and "kvh_piqa_eval" in run.stdout


@pytest.fixture(scope="module")
def identity_map(tiny_pair, tmp_path_factory) -> Path:
    """The identity map of the tiny pair (equal geometry), bound to it."""
    source, target = (Pair(str(tiny_pair[side])).target for side in ("source", "target"))
    mapper = identity_mapper("s", "t", source.config, target.config)
    mapper.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))
    path = tmp_path_factory.mktemp("identity") / "identity.safetensors"
    save_mapper(mapper, path)
    return path


@pytest.mark.parametrize("mode", ["oracle", "zero", "source", "direct", "mapped", "shuffled"])
def test_every_mode_through_kv_transfer_records_itself_as_what_served_its_requests(mode, tiny_pair, identity_map,
                                                                                   task_dir):
    mapper = {"mapper": str(identity_map)} if mode in ("mapped", "shuffled") else {}
    source = {} if mode in ("oracle", "zero") else {"source": str(tiny_pair["source"])}  # refused where unread
    lm = KVTransferLM.from_args(target=str(tiny_pair["target"]), transfer=mode, device="cpu", **mapper, **source)
    assert lm.handoff.mode == mode
    out = simple_evaluate(model=lm, tasks=TASKS, task_manager=TaskManager(include_path=str(task_dir),
                                                                         include_defaults=False),
                          num_fewshot=0, log_samples=True, bootstrap_iters=0, limit=3)
    record = out["config"]["kv_transfer"]
    assert record["transfer"] == mode and record["repair"] == "none"
    for task in TASKS:
        requests = sum(len(sample["arguments"]) for sample in out["samples"][task])
        assert record["routes"][task]["requests"] == record["routes"][task][mode] == requests
    assert record["requests"] == {}


def test_the_request_cache_is_keyed_by_everything_that_changes_an_answer(identity_map, tmp_path):
    models = {"source": {"weights": "sha256:s"}, "target": {"weights": "sha256:t"}}
    base = {"target": "t", "source": "s", "transfer": "mapped", "mapper": str(identity_map)}
    assert cache_key(base, models) == cache_key({**base, "batch_size": 4}, models)  # the batch changes no answer
    for other in ({"target": "t", "transfer": "oracle"}, {**base, "repair": "sink:2"}, {**base, "dtype": "bfloat16"},
                  {**base, "source": "s2"}):
        assert cache_key(other, models) != cache_key(base, models), other
    assert cache_key(base, {**models, "target": {"weights": "sha256:other"}}) != cache_key(base, models)
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(identity_map.read_bytes())
    assert cache_key({**base, "mapper": str(copy)}, models) == cache_key(base, models)  # a map by its content
    copy.write_bytes(identity_map.read_bytes() + b" ")
    assert cache_key({**base, "mapper": str(copy)}, models) != cache_key(base, models)


def test_a_run_sharing_a_request_cache_with_an_oracle_run_is_served_by_its_own_handoff(tiny_pair, task_dir,
                                                                                        tmp_path):
    cache = tmp_path / "requests"
    recorded = {}
    for transfer in ("oracle", "direct"):
        out = tmp_path / transfer
        source = f",source={tiny_pair['source']}" if transfer == "direct" else ""
        args = ["run", "--model", "kv-transfer", "--model_args", f"target={tiny_pair['target']}{source},"
                f"transfer={transfer},device=cpu", "--tasks", "piqa_local", "--include_path", str(task_dir), "--limit",
                "3", "--use_cache", str(cache), "--output_path", str(out)]
        done = subprocess.run([sys.executable, "-m", "pipeline.lm_eval_model", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        (results,) = out.rglob("results_*.json")
        recorded[transfer] = json.loads(results.read_text())["config"]["kv_transfer"]
    # before the key, the direct run read the oracle's answers from the shared file and counted no request
    assert recorded["direct"]["routes"] == {"piqa_local": {"requests": 6, "direct": 6, EMPTY_PREFIX: 0, CACHED: 0}}
    assert len(list(tmp_path.glob("requests_kv-*_rank0.db"))) == 2


def test_a_stages_lm_eval_results_carry_the_route_record_the_run_command_writes(tiny_pair, tmp_path):
    files = {"hellaswag": tmp_path / "hellaswag.parquet", "piqa": tmp_path / "piqa.parquet"}
    pd.DataFrame(hellaswag_rows(3)).to_parquet(files["hellaswag"], index=False)
    pd.DataFrame(piqa_rows(3)).to_parquet(files["piqa"], index=False)
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), "float32", "cpu")
    lm = HandoffLM(Router(pair.handoff("source"), batch_size=4), pair.target_tokenizer)
    tasks, items = evaluate_tasks(lm, files, raw_to=tmp_path / "lm_eval")
    record = json.loads((tmp_path / "lm_eval" / "lm_eval_results.json").read_text())["config"]["kv_transfer"]
    assert record["transfer"] == "source" and record["repair"] == "none"
    assert {task: counts["source"] for task, counts in record["routes"].items()} == {
        f"kvh_{task}": int(sum(len(choices) for choices in items[items.task == task].choices)) for task in files}


def lm_eval_main(monkeypatch, tmp_path, task_dir, model_args: list[str], *flags: str) -> dict:
    """`python -m pipeline.lm_eval_model run` in this process with `model_args` (argv words, any form) on two PIQA
    items (unless `flags` say otherwise), its own output folder: the route record its results carry."""
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    monkeypatch.setattr(sys, "argv", ["lm_eval_model"])
    main(["run", "--model", "kv-transfer", *model_args, "--tasks", "piqa_local", "--include_path", str(task_dir),
          "--device", "cpu", "--output_path", str(out), *(flags or ("--limit", "2"))])
    (results,) = out.rglob("results_*.json")
    return json.loads(results.read_text())["config"]["kv_transfer"]


def cached(record: dict) -> int:
    return record["routes"]["piqa_local"][CACHED]


def test_every_argv_form_keys_the_request_cache_by_the_args_lm_eval_built_and_a_changed_model_or_map_misses(
        tiny_pair, identity_map, task_dir, tmp_path, monkeypatch):
    target, source, map_path = tmp_path / "target", str(tiny_pair["source"]), tmp_path / "map.safetensors"
    shutil.copytree(tiny_pair["target"], target)
    shutil.copy(identity_map, map_path)
    cache = ("--use_cache", str(tmp_path / "requests"))

    def run(*model_args: str) -> dict:
        return lm_eval_main(monkeypatch, tmp_path, task_dir, list(model_args), "--limit", "2", *cache)

    requests = 4  # two PIQA items, two solutions each
    assert cached(run("--model_args", f"target={target},transfer=oracle")) == 0
    # the same handoff in lm-eval's space form, and as JSON: the key is the args lm-eval built, so they hit
    assert cached(run("--model_args", f"target={target}", "transfer=oracle")) == requests
    assert cached(run("-a", json.dumps({"target": str(target), "transfer": "oracle"}))) == requests
    # another handoff in each form misses (before, the space form and -a keyed only their first word, or none)
    mapped = run("--model_args", f"target={target}", f"source={source}", "transfer=mapped", f"mapper={map_path}")
    assert cached(mapped) == 0 and mapped["transfer"] == "mapped"
    assert cached(run("-a", f"target={target},source={source},transfer=direct")) == 0
    assert cached(run("--model_args", f"target={target}", "--model_args", "transfer=zero")) == 0
    # another map copied to the same path, given as JSON: missed (the key holds the map's content)
    other = random_mapper(*(AutoConfig.from_pretrained(folder) for folder in (source, target)), k=1, seed=1)
    other.models = pair_fingerprints(source, str(target))
    save_mapper(other, map_path)
    as_json = json.dumps({"target": str(target), "source": source, "transfer": "mapped", "mapper": str(map_path)})
    assert cached(run("--model_args", as_json)) == 0
    # the target's weights changed in place: every mode misses (the key holds each model's fingerprint)
    weights = bytearray((target / "model.safetensors").read_bytes())
    weights[-1] ^= 0x01
    (target / "model.safetensors").write_bytes(bytes(weights))
    assert cached(run("--model_args", f"target={target},transfer=oracle")) == 0


def test_a_cache_filled_by_a_shorter_run_counts_its_requests_as_cached_with_the_way_they_first_went(
        tiny_pair, identity_map, task_dir, tmp_path, monkeypatch, capsys):
    args = ["--model_args", f"target={tiny_pair['target']},source={tiny_pair['source']},transfer=mapped,"
            f"mapper={identity_map}"]
    cache = ("--use_cache", str(tmp_path / "requests"))
    first = lm_eval_main(monkeypatch, tmp_path, task_dir, args, "--limit", "2", *cache)
    assert first["routes"] == {"piqa_local": {"requests": 4, "mapped": 4, EMPTY_PREFIX: 0, CACHED: 0}}
    longer = lm_eval_main(monkeypatch, tmp_path, task_dir, args, "--limit", "4", *cache)
    # before, this run recorded "4 requests: 4 mapped" for a task of 8, and a fully cached one `routes: {}`
    assert longer["routes"] == {"piqa_local": {"requests": 8, "mapped": 4, EMPTY_PREFIX: 0, CACHED: 4}}
    assert longer["cached"] == {"piqa_local": {"mapped": 4}} and longer["cache"].endswith("_rank0.db")
    assert longer["requests"]["piqa_local"] == {doc: {"route": [CACHED, CACHED], "first_served": ["mapped", "mapped"]}
                                                for doc in ("0", "1")}
    assert "piqa_local: 8 requests: 4 mapped, 0 empty_prefix, 4 cached (first served: 4 mapped)" in \
           capsys.readouterr().out
    again = lm_eval_main(monkeypatch, tmp_path, task_dir, args, "--limit", "4", *cache)
    assert again["routes"] == {"piqa_local": {"requests": 8, "mapped": 0, EMPTY_PREFIX: 0, CACHED: 8}}


@pytest.mark.parametrize("form", [
    ["--model_args", "target={target},transfer=oracle,transfer=zero"],
    ["--model_args", "target={target}", "transfer=oracle", "transfer=zero"],
    ["-a", "target={target}", "transfer=oracle", "-a", "transfer=zero"],
    ["--model_args", "target={target},transfer=oracle", "--model_args", "transfer=zero"],
    ["--model_args", '{{"target": "{target}", "transfer": "oracle", "transfer": "zero"}}'],
    ["--model_args", '{{"target": "{target}", "transfer": "oracle"}}', "--model_args", "transfer=zero"],
])
def test_a_model_arg_given_twice_is_refused_in_every_argv_form_before_any_model_loads(form, tiny_pair, task_dir,
                                                                                      tmp_path, monkeypatch):
    monkeypatch.setattr("pipeline.kv.pair.load_model", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    words = [word.format(target=tiny_pair["target"]) for word in form]
    with pytest.raises(ParamError, match=r"^kv-transfer transfer= given twice \(\"?oracle\"?, then \"?zero\"?\): "
                                         r"give it once$"):
        lm_eval_main(monkeypatch, tmp_path, task_dir, words)


def test_a_json_object_followed_by_more_model_args_is_refused_rather_than_dropped(tiny_pair, task_dir, tmp_path,
                                                                                  monkeypatch):
    words = ["--model_args", json.dumps({"target": str(tiny_pair["target"])}), "transfer=zero"]
    with pytest.raises(ParamError, match="lm-eval reads the JSON object and drops what follows it"):
        lm_eval_main(monkeypatch, tmp_path, task_dir, words)


def test_lm_evals_own_path_keyed_cache_is_refused(tiny_pair, task_dir, tmp_path):
    lm = KVTransferLM.from_args(target=str(tiny_pair["target"]), device="cpu")
    with pytest.raises(ParamError, match="lm-eval's use_cache keys its file by its path alone"):
        simple_evaluate(model=lm, tasks=["piqa_local"], limit=1, use_cache=str(tmp_path / "lm_eval_cache"),
                        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))


def test_the_lm_eval_face_takes_a_repair_and_refuses_a_malformed_one_before_loading(tiny_pair):
    with pytest.raises(RepairError, match="bad part 'sink:x'"):
        KVTransferLM.from_args(str(tiny_pair["target"]), str(tiny_pair["source"]), "direct", repair="sink:x",
                               device="cpu")
    lm = KVTransferLM.from_args(str(tiny_pair["target"]), str(tiny_pair["source"]), "direct", repair="sink:2",
                                device="cpu")
    assert lm.handoff.repair == Repair(sink=2)


def test_dtype_auto_loads_the_target_in_the_dtype_this_machine_runs_faster(tiny_pair, monkeypatch):
    for choice in ("bfloat16", "float32"):
        monkeypatch.setattr(devices, "machine_dtype", lambda choice=choice: (choice, {}))
        lm = KVTransferLM.from_args(target=str(tiny_pair["target"]), dtype="auto", device="cpu")
        assert lm.router.handoff.decoder.dtype == getattr(torch, choice)
