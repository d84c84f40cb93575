"""Stages on several processes (torchrun, gloo on this CPU): the same bytes as one process."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, committed
from kvworld import make_world

from pipeline.store.devices import SHARED_NOTE, StageUsage, usage_of_ranks
from pipeline.store.ranks import SINGLE, World


def test_a_rank_takes_every_nth_item_from_its_own_index():
    assert [list(World(rank, 3, rank).share(8)) for rank in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert list(SINGLE.share(4)) == [0, 1, 2, 3] and SINGLE.gather("x") == ["x"] and SINGLE.main


def test_a_rank_runs_on_its_own_gpu_and_one_process_where_it_is_told():
    assert World(1, 2, 1).device("cuda") == "cuda:1"
    assert World(1, 2, 1).device("cpu") == "cpu" and SINGLE.device("cuda") == "cuda"


def test_usage_of_several_ranks_is_the_slowest_and_the_largest_with_each_peak_beside():
    one = {"wall_s": 3.0, "peak_memory_mib": 100.0, "peak_memory_of": "process rss", "device": "cpu"}
    two = dict(one, wall_s=5.0, peak_memory_mib=80.0)
    assert usage_of_ranks([one]) == one
    both = usage_of_ranks([one, two])
    assert (both["wall_s"], both["peak_memory_mib"], both["peak_memory_mib_per_rank"], both["processes"]) == \
        (5.0, 100.0, [100.0, 80.0], 2)


def _stage(root: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", *args], cwd=root, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


TIMING = ("wall_s", "peak_memory_mib", "peak_memory_mib_per_rank", "processes", "source_prefill_s",
          "time_vs_source_prefill", "extract_s", "forward_floor_s", "write_floor_s", "ratio_to_floor")


def _untimed(path: Path) -> dict:
    """A metrics JSON without the fields that are timings or name the process count."""
    return {k: v for k, v in json.loads(path.read_text()).items() if k.split("/")[-1] not in TIMING}


@pytest.fixture(scope="module")
def two_worlds(tmp_path_factory):
    """The same small world twice: `one` runs each stage in one process, `two` in two torchrun processes."""
    base = make_world(tmp_path_factory.mktemp("ranks") / "one", fit=9, select=5, length=20)
    other = base.parent / "two"
    shutil.copytree(base, other)
    for root, processes in ((base, 1), (other, 2)):
        params = {"models": committed("models", device="cpu"),
                  "extract": committed("extract", shard_sequences=2, batch_sequences=2, repeats=1, threads=1,
                                       processes=processes),
                  "fit": committed("fit", ks=[1, 2], lambdas=[0.01, 1.0], threads=1, timing_repeats=1,
                                   processes=processes, mlp={"ks": [1], "hidden": 16, "max_epochs": 3})}
        (root / "params.yaml").write_text(yaml.safe_dump(params))
        for model in ("source", "target"):
            _stage(root, "pipeline.extract", model)
    return base, other


@pytest.mark.slow
def test_extract_on_two_processes_writes_the_same_caches_as_one(two_worlds):
    one, two = two_worlds
    assert _files(one / "caches") == _files(two / "caches")  # every shard and the manifest, byte for byte
    manifest = json.loads((two / "caches/source/manifest.json").read_text())
    assert len(manifest["splits"]["fit"]["shards"]) == 5  # 9 sequences, 2 per shard: ranks wrote 0,2,4 and 1,3
    figures = json.loads((two / "metrics/extract_source.json").read_text())
    assert figures["processes"] == 2 and len(figures["peak_memory_mib_per_rank"]) == 2
    assert _untimed(one / "metrics/extract_source.json") == _untimed(two / "metrics/extract_source.json")


@pytest.mark.slow
def test_extract_under_accelerate_launch_writes_the_same_caches_as_one_process(two_worlds, tmp_path):
    one, _ = two_worlds
    other = tmp_path / "accelerate"
    shutil.copytree(one, other, ignore=shutil.ignore_patterns("caches", "metrics"))
    # on a CPU, `--multi_gpu` is accelerate's torchrun launcher (`--cpu` with several processes wants mpirun);
    # the stage runs on gloo because models.device is cpu
    launcher = Path(sys.executable).parent / "accelerate"
    result = subprocess.run([str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                             "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "pipeline.extract", "source"],
                            cwd=other, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((other / "metrics/extract_source.json").read_text())["processes"] == 2
    assert _files(one / "caches/source") == _files(other / "caches/source")


@pytest.mark.slow
def test_fit_on_two_processes_writes_the_same_mappers_and_tables_as_one(two_worlds):
    one, two = two_worlds
    for root in (one, two):
        _stage(root, "pipeline.fit")
    mappers = _files(one / "models/mappers")
    assert len(mappers) == 9 and mappers == _files(two / "models/mappers")  # 2 families x 2 k x 2 lambdas + mlp
    for table in ("fit_layers.csv", "fit_probe.csv"):
        assert (one / "metrics" / table).read_bytes() == (two / "metrics" / table).read_bytes()
    assert _untimed(one / "metrics/fit.json") == _untimed(two / "metrics/fit.json")


def test_stage_figures_say_when_a_queued_experiment_may_have_shared_the_machine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert "timing_note" not in StageUsage("cpu").figures()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # dvc repro / dvc exp run in the workspace itself
    assert "timing_note" not in StageUsage("cpu").figures()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "elsewhere"))  # an executor's copy under .dvc/tmp/exps
    assert StageUsage("cpu").figures()["timing_note"] == SHARED_NOTE
