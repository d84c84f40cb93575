"""End to end: `dvc repro` of the whole pipeline on a reduced tiny profile in a temporary copy of the
repository, then the report's invariants; and `dvc metrics diff` between two commits with other params."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import ROOT, merge
from helpers.scratch import scratch_copy

DVC = [sys.executable, "-m", "dvc"]

REDUCED = {
    "data": {"fit_sequences": 8, "calibration_sequences": 10, "select_sequences": 6, "eval_prompts": 10,
             "dev_items": 16, "eval_items": 24,
             "world": {"corpus_docs": 800}},
    "train": {"source": {"copy_steps": 60, "mixed_steps": 40, "warmup": 20, "eval_every": 100},
              "target": {"copy_steps": 60, "mixed_steps": 60, "warmup": 20, "eval_every": 120}},
    "fit": {"lambdas": [0.1, 10.0], "timing_repeats": 1, "mlp": {"max_epochs": 3}},
    "controls": {"prompts": 3, "corruption_flips": 16},
    "distill": {"start": ["linear_k1_lam0.1", "mlp_k3"], "context_lengths": [8, 16], "epochs": 2, "patience": 1},
    "evaluate": {"horizon": 4, "mapped": {"distilled_k1": "models/distilled/linear_k1_lam0.1+kl.safetensors"}},
    "measure": {"bootstrap_iters": 200},
    "candidates": {"length": 32, "warmup": 0, "repeats": 1},
    "repair": {"maps": {"distilled_k1": "models/distilled/linear_k1_lam0.1+kl.safetensors"},
               "grid": ["none", "tokens:0.1:recency"], "length": 32, "warmup": 0, "repeats": 1},
    "calibration": {"sizes": [4, 8], "candidates": ["linear_k1_lam0.1", "linear_k3_lam0.1", "mlp_k3"]},
    "length": {"fit_tokens": 12, "prompt_lengths": [12, 24], "continuation": 8, "candidate": "linear_k1_lam0.1"},
    "latency": {"lengths": [16, 48], "repeats": 1},
}


def attempt(cmd, cwd, **kw) -> subprocess.CompletedProcess:
    # dvc runs the stages' `python -m ...` through PATH: put this interpreter's environment first
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, **kw)


def run(cmd, cwd, **kw):
    result = attempt(cmd, cwd, **kw)
    assert result.returncode == 0, (f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-6000:]}")
    return result.stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A copy of the tracked tree with its own git history (so DVC and `metrics diff` work): stage outputs as HEAD
    has them, whatever a failed stage left in the workspace (tests/helpers/scratch.py)."""
    copy = tmp_path_factory.mktemp("repo")
    scratch_copy(ROOT, copy)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    os.environ.update(env)
    run(["git", "init", "-q"], copy)
    params = merge(yaml.safe_load((copy / "params.yaml").read_text()), REDUCED)
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "add", "-A"], copy)
    run(["git", "commit", "-qm", "reduced tiny profile"], copy)
    return copy


def typo(section: str):
    return lambda p: p[section].__setitem__("typo_key", 4)


# every section's typo and empty list is refused by the whole-file check in-process
# (tests/stages/test_check_params.py); here dvc itself, for a section read first (data), one read last (report) and
# an empty list: check_params stops it
@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    *[(typo(section), f"error: {section}.typo_key: unknown parameter") for section in ("data", "report")],
    (lambda p: p["fit"].__setitem__("lambdas", []), "error: fit.lambdas: expected at least one value"),
])
def test_a_bad_parameter_stops_dvc_repro_before_any_stage_works(repo, change, message):
    before = (repo / "params.yaml").read_text()
    params = yaml.safe_load(before)
    change(params)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        done = attempt(DVC + ["repro"], repo, timeout=600)
    finally:
        (repo / "params.yaml").write_text(before)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and message in output, output[-3000:]
    assert "Running stage 'check_params'" in output
    assert output.count("Running stage") == 1, output[-3000:]  # nothing after the check started


@pytest.mark.slow
def test_whole_pipeline_reproduces_on_a_reduced_tiny_profile(repo):
    run(DVC + ["repro"], repo, timeout=1800)
    report = json.loads((repo / "metrics" / "report.json").read_text())
    controls = json.loads((repo / "metrics" / "controls.json").read_text())
    assert all(entry["passed"] for entry in controls.values())
    variants = report["variants"]
    assert variants["oracle"]["next_token_top1"] == 1.0 and variants["oracle"]["agreement"] == 1.0
    assert {"oracle", "direct", "source", "zero", "selected", "shuffled", "mapped_k1"} <= set(variants)
    for name, entry in variants.items():  # retention recomputed from the accuracies, exactly as PROTOCOL says
        expected = ((entry["hellaswag"] - 0.25) / (variants["oracle"]["hellaswag"] - 0.25)
                    + (entry["piqa"] - 0.5) / (variants["oracle"]["piqa"] - 0.5)) / 2
        assert entry["retention"] == pytest.approx(expected, nan_ok=True), name
    markdown = (repo / "report.md").read_text()
    # the tiny profile's tasks are named as the tiny world's, the milestone by its metric
    assert "| Variant | Perplexity | Next-token top-1 | HellaSwag-shaped | PIQA-shaped |" in markdown
    assert "Tasks: the tiny world's HellaSwag-shaped and PIQA-shaped items" in markdown
    assert "| agreement milestone (next-token top-1) |" in markdown
    assert all(f"| {row} |" in markdown for row in ("Target full-prefill oracle", "Null control: zero cache",
                                                      "Null control: shuffled cache", "Source model alone"))
    for name, entry in variants.items():  # the gap closure from the same accuracies, against the source alone
        expected = sum((entry[t] - variants["source"][t]) / (variants["oracle"][t] - variants["source"][t])
                       for t in ("hellaswag", "piqa")) / 2 if all(
            variants["oracle"][t] > variants["source"][t] for t in ("hellaswag", "piqa")) else float("nan")
        assert entry["gap_closure"] == pytest.approx(expected, nan_ok=True), name
    headline = json.loads((repo / "metrics/headline/selected.json").read_text())
    assert headline["gap_closure"] == pytest.approx(variants["selected"]["gap_closure"], nan_ok=True)
    assert "gap_closure_floor" in report["criteria"]
    study = report["candidates"]  # every fitted candidate evaluated, the proxies correlated, the fronts named
    mappers = sorted(p.stem for p in (repo / "models/mappers").glob("*.safetensors"))
    distilled = sorted(p.stem for p in (repo / "models/distilled").glob("*.safetensors"))
    # ks 1 and 3 x lambdas 0.1 and 10 x linear, head_matched and low_rank (one rank), and the MLP at each k
    assert sorted(study["rows"]) == sorted(mappers + distilled) and len(mappers) == 2 * 2 * 3 + 2
    assert distilled == ["linear_k1_lam0.1+kl", "mlp_k3+kl"]  # each start map distilled, beside the fitted ones
    assert set(report["distillation"]["rows"]) == set(distilled) and "## Distillation" in markdown
    assert set(study["proxies"]) == {"r2_heldout", "attention_cosine", "agreement", "mean_kl"}
    assert any(row["pareto_measured"] for row in study["rows"].values())
    assert (repo / "report/frontier.png").stat().st_size > 0 and "## Every candidate" in markdown
    fit = json.loads((repo / "metrics/fit.json").read_text())
    assert fit["lambda_scale"] == "relative" and "lambda" in fit["chosen"]["linear_k1"]
    curve = report["calibration"]  # two sizes x three candidates; n=8 is the main fit's own data
    assert [(r["sequences"], r["candidate"]) for r in curve["rows"]] == [
        (n, c) for n in (4, 8) for c in ("linear_k1_lam0.1", "linear_k3_lam0.1", "mlp_k3")]
    assert set(curve["larger_k"]["by_size"]) == {"4", "8"} and "## How much calibration" in markdown
    # n=8 is the fit split itself: its refit equals the main fit's map, so the same R² and the same items
    point, fit_figures = (json.loads((repo / f"metrics/{name}.json").read_text()) for name in ("calibration/8", "fit"))
    for name in ("linear_k1_lam0.1", "linear_k3_lam0.1"):
        assert point["maps"][name]["r2_keys_select"] == fit_figures["maps"][name]["r2_keys_select"], name
        assert pd.read_parquet(repo / f"eval/calibration/8/{name}.parquet").equals(
            pd.read_parquet(repo / f"eval/candidates/{name}.parquet")), name
    assert sorted(p.name for p in (repo / "eval/calibration/8").iterdir()) == [
        "linear_k1_lam0.1.parquet", "linear_k3_lam0.1.parquet", "mlp_k3.parquet"]  # no scratch left
    length = report["length"]  # both maps at each prompt length, compared on the same prompts
    assert [r["length"] for r in length["rows"]] == [12, 24] and "## Longer prompts than the fit saw" in markdown
    assert sorted(p.name for p in (repo / "eval/length").iterdir()) == sorted(
        [f"{space}_L{n}.parquet" for space in ("rotated", "stripped") for n in (12, 24)]
        + [f"{space}_tasks.parquet" for space in ("rotated", "stripped")])
    assert sum(b["items"] for b in length["task_bins"]) == 2 * 24  # every eval item of both tasks, binned once
    select = json.loads((repo / "metrics/select.json").read_text())
    assert select["oracle"]["prompts"]["attention_cosine"] == pytest.approx(1.0, abs=1e-4)
    status = json.loads(run(DVC + ["status", "--json"], repo))
    assert status == {"pin_models": ["always changed"]}, status  # the one stage that looks outside the repo
    # the headline: one row per variant, a few columns (without --targets every metrics file is listed)
    shown = run(DVC + ["metrics", "show", "metrics/headline"], repo).splitlines()
    assert len(shown) == 1 + len(variants) and max(map(len, shown)) < 250, "\n".join(shown)


def stale_after(repo, change) -> set[str]:
    """Stages `dvc status` reports after `change(params)`, besides check_params, with params.yaml restored."""
    before = (repo / "params.yaml").read_text()
    params = yaml.safe_load(before)
    change(params)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        stale = set(json.loads(run(DVC + ["status", "--json"], repo)))
    finally:
        (repo / "params.yaml").write_text(before)
    assert "check_params" in stale  # every change is validated first; its output stays the same
    return stale - {"check_params", "pin_models"}  # pin_models runs every time; its output changes only with models


@pytest.mark.slow
def test_a_parameter_change_reruns_only_what_it_affects(repo):
    evaluation = stale_after(repo, lambda p: p["evaluate"].__setitem__("horizon", 3))
    assert evaluation and all(name.startswith(("evaluate", "report")) for name in evaluation), evaluation
    assert "evaluate" in evaluation  # status lists the stages whose own deps changed
    selection = stale_after(repo, lambda p: p["select"].__setitem__("horizon", 3))
    assert "select" in selection and not any(name.startswith(("extract", "fit", "prepare")) for name in selection)
    calibration = stale_after(repo, lambda p: p["calibration"]["sizes"].append(6))
    assert calibration == {"calibrate@6", "report"}, calibration  # the other sizes' fits and evaluations stand
    training = stale_after(repo, lambda p: p["train"]["target"].__setitem__("lr", 1e-3))
    assert "prepare_models" in training and "prepare_data" not in training, training


@pytest.mark.slow
def test_metrics_diff_lists_what_changed_between_commits(repo):
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "first run"], repo)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["measure"]["bootstrap_iters"] += 100  # other intervals, the same point estimates
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(DVC + ["repro"], repo, timeout=1800)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "second run"], repo)
    diff = json.loads(run(DVC + ["metrics", "diff", "HEAD~1", "HEAD", "--json"], repo))
    changed = {(Path(file).stem, key) for file, keys in diff.items() for key in keys}
    assert ("selected", "retention_low") in changed or ("selected", "retention_high") in changed, changed
    assert not {key for _, key in changed} & {"perplexity", "next_token_top1", "retention"}, changed
    params_diff = json.loads(run(DVC + ["params", "diff", "HEAD~1", "HEAD", "--json"], repo))
    assert "measure.bootstrap_iters" in params_diff["params.yaml"]


TIMING = {"wall_s", "peak_memory_mib", "peak_memory_mib_per_rank", "processes"}  # a stage's usage figures


def untimed(figures: dict) -> dict:
    """A variant's metrics without its usage figures (what differs between runs of the same computation)."""
    return {key: value for key, value in figures.items() if key not in TIMING}


@pytest.mark.slow
def test_a_baseline_evaluated_alone_writes_what_it_wrote_beside_the_others_in_one_process(repo):
    """The evaluate stage ran the oracle and the baselines one after the other in one process, sharing the pair's
    models: `direct` (both models, after the other variants used them) alone in a fresh process writes the same
    per-prompt and per-item files, and the same metrics apart from timing."""
    files = ["eval/direct/prompts.parquet", "eval/direct/items.parquet", "metrics/eval/direct.json"]
    together = {path: (repo / path).read_bytes() for path in files}
    try:
        run([sys.executable, "-m", "pipeline.evaluate", "direct"], repo, timeout=900)
        alone = {path: (repo / path).read_bytes() for path in files}
    finally:
        for path, content in together.items():
            (repo / path).write_bytes(content)
    for path in files[:2]:
        assert alone[path] == together[path], path
    assert untimed(json.loads(alone[files[2]])) == untimed(json.loads(together[files[2]]))


@pytest.mark.slow
def test_evaluation_on_two_processes_writes_what_one_process_wrote(repo):
    """After the one-process run above: evaluate@oracle and the selected mapper again as two torchrun processes
    (gloo), lm-eval splitting the task documents through the model's rank contract."""
    kept = repo.parent / "one-process"
    for path in ("eval/oracle", "eval/selected", "eval/oracle_outputs.safetensors", "metrics/eval"):
        source, copy = repo / path, kept / path
        copy.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, copy)
    before = (repo / "params.yaml").read_text()
    params = yaml.safe_load(before)
    params["evaluate"]["processes"] = 2
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        for variant in ("oracle", "selected"):
            run([sys.executable, "-m", "pipeline.evaluate", variant], repo, timeout=900)
    finally:
        (repo / "params.yaml").write_text(before)
    for variant in ("oracle", "selected"):
        figures = json.loads((repo / f"metrics/eval/{variant}.json").read_text())
        assert figures["processes"] == 2
        one = json.loads((kept / f"metrics/eval/{variant}.json").read_text())
        assert untimed(figures) == untimed(one)
        # per prompt: byte for byte (a batch of prompts is the same computation on either rank)
        assert (repo / f"eval/{variant}/prompts.parquet").read_bytes() == \
            (kept / f"eval/{variant}/prompts.parquet").read_bytes()
        # per task item: the same items, decisions and accuracies; the log-likelihoods within float32 rounding,
        # since lm-eval's split puts other contexts beside each one in a batch (other padding, other kernels)
        two, one = (pd.read_parquet(root / f"eval/{variant}/items.parquet") for root in (repo, kept))
        assert two.drop(columns="loglikelihoods").equals(one.drop(columns="loglikelihoods"))
        assert all(np.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(two.loglikelihoods, one.loglikelihoods))
        for sample in (kept / f"eval/{variant}/lm_eval").glob("lm_eval_samples_*.jsonl"):
            decided = [[{k: row[k] for k in ("doc_id", "acc", "acc_norm")}
                        for row in map(json.loads, path.read_text().splitlines())]
                       for path in (repo / f"eval/{variant}/lm_eval/{sample.name}", sample)]
            assert decided[0] == decided[1]
    assert (repo / "eval/oracle_outputs.safetensors").read_bytes() == \
        (kept / "eval/oracle_outputs.safetensors").read_bytes()


@pytest.mark.slow
def test_lm_evals_own_command_line_on_two_torchrun_processes_scores_each_item_as_one_process(repo):
    """lm-eval's CLI (through `pipeline.lm_eval_model`) as two torchrun processes: lm-eval splits the documents
    through the model's rank contract and rank 0 writes what one process writes, item for item."""
    command = ["-m", "pipeline.lm_eval_model", "run", "--model", "kv-transfer", "--model_args",
               "target=models/target,source=models/source,transfer=mapped,mapper=models/mapper.safetensors",
               "--include_path", "data/tasks", "--tasks", "kvh_piqa_eval", "--limit", "12", "--log_samples"]
    for name, launcher in (("one", []), ("two", ["-m", "torch.distributed.run", "--standalone",
                                                 "--nproc_per_node", "2"])):
        run([sys.executable, *launcher, *command, "--output_path", str(repo.parent / f"cli-{name}")], repo,
            timeout=900)

    def decided(name):
        (path,) = (repo.parent / f"cli-{name}").rglob("samples_kvh_piqa_eval_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return sorted(({k: row[k] for k in ("doc_id", "acc", "acc_norm")} for row in rows), key=lambda r: r["doc_id"])

    assert len(decided("one")) == 12 and decided("two") == decided("one")
