"""Several processes (`store.ranks`; torchrun, gloo on this CPU): a rank's share of the items, its device, a stage
that runs as one process; the stages on two processes write the same bytes as one, and a rank that dies ends the
stage instead of leaving the other waiting."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil  # accelerate's dependency: finds the stage's rank processes under torchrun
import pytest
import yaml
from helpers import ROOT, committed
from helpers.kvworld import make_world

from pipeline.store.artifacts import verify_file
from pipeline.store.ranks import ONE_PROCESS, Ranks, stage_ranks


def test_a_rank_takes_every_nth_item_from_its_own_index():
    assert [list(Ranks(rank, 3, rank).share(8)) for rank in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert list(ONE_PROCESS.share(4)) == [0, 1, 2, 3] and ONE_PROCESS.gather("x") == ["x"] and ONE_PROCESS.main


def test_a_rank_runs_on_its_own_gpu_and_one_process_where_it_is_told():
    assert Ranks(1, 2, 1).device("cuda") == "cuda:1"
    assert Ranks(1, 2, 1).device("cpu") == "cpu" and ONE_PROCESS.device("cuda") == "cuda"


def test_a_one_process_stage_writes_its_metrics_nested_with_its_usage_figures_beside(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with stage_ranks("cpu") as stage:
        assert stage.ranks == ONE_PROCESS and stage.device == "cpu"
        written = stage.write_metrics(tmp_path / "stage.json", {"score": 0.5, "per/layer": 1})
    assert json.loads((tmp_path / "stage.json").read_text()) == written
    assert list(written)[:2] == ["score", "per"] and written["per"] == {"layer": 1}  # `a/b` keys nest
    assert written["device"] == "cpu" and "wall_s" in written
    assert "per" not in json.loads(capsys.readouterr().out)  # only the top-level figures are shown


def _stage(root: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", *args], cwd=root, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


TIMING = ("wall_s", "peak_memory_mib", "peak_memory_mib_per_rank", "processes", "source_prefill_s",
          "time_vs_source_prefill", "extract_s", "forward_floor_s", "write_floor_s", "ratio_to_floor", "seconds",
          "cost_s")


def _untimed(path: Path) -> dict:
    """A metrics JSON without the fields, at any depth, that are timings or name the process count."""
    def drop(figures: dict) -> dict:
        return {k: drop(v) if isinstance(v, dict) else v for k, v in figures.items() if k not in TIMING}
    return drop(json.loads(path.read_text()))


DISTILLED = ["linear_k1_lam0.01", "mlp_k1", "linear_k2_lam1"]  # rank 0 of two distils the first and the last


@pytest.fixture(scope="module")
def two_worlds(tmp_path_factory):
    """The same small world twice: `one` runs each stage in one process, `two` in two torchrun processes."""
    base = make_world(tmp_path_factory.mktemp("ranks") / "one", fit=9, select=5, length=20)
    other = base.parent / "two"
    shutil.copytree(base, other)
    for root, processes in ((base, 1), (other, 2)):
        params = {"models": committed("models"), "machine": committed("machine", device="cpu", threads=1),
                  "extract": committed("extract", shard_sequences=2, batch_sequences=2, repeats=1,
                                       processes=processes),
                  "fit": committed("fit", ks=[1, 2], lambdas=[0.01, 1.0], timing_repeats=1,
                                   processes=processes, mlp={"ks": [1], "hidden": 16, "max_epochs": 3}),
                  "distill": committed("distill", start=DISTILLED, context_lengths=[6, 10], horizon=4, epochs=2,
                                       patience=1, processes=processes)}
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


@pytest.fixture(scope="module")
def fitted_worlds(two_worlds):
    """Both worlds after fit, each on its own number of processes."""
    for root in two_worlds:
        _stage(root, "pipeline.fit")
    return two_worlds


@pytest.mark.slow
def test_fit_on_two_processes_writes_the_same_mappers_and_tables_as_one(fitted_worlds):
    one, two = fitted_worlds
    mappers = _files(one / "models/mappers")
    # linear, head_matched and low_rank x 2 k x 2 lambdas (one rank), and the MLP
    assert len(mappers) == 13 and mappers == _files(two / "models/mappers")
    for table in ("fit_layers.csv", "fit_probe.csv"):
        assert (one / "metrics" / table).read_bytes() == (two / "metrics" / table).read_bytes()
    assert _untimed(one / "metrics/fit.json") == _untimed(two / "metrics/fit.json")


@pytest.mark.slow
def test_distill_on_two_processes_writes_the_same_maps_and_curves_as_one(fitted_worlds):
    one, two = fitted_worlds
    for root in (one, two):
        _stage(root, "pipeline.distill")
    assert _files(one / "models/distilled") == _files(two / "models/distilled")  # every map, byte for byte
    assert _files(one / "metrics/distill") == _files(two / "metrics/distill")  # every per-epoch curve
    assert sorted(_files(two / "models/distilled")) == sorted(f"{name}+kl.safetensors" for name in DISTILLED)
    figures = json.loads((two / "metrics/distill.json").read_text())
    assert figures["processes"] == 2 and len(figures["peak_memory_mib_per_rank"]) == 2
    assert _untimed(one / "metrics/distill.json") == _untimed(two / "metrics/distill.json")


def _rank_processes(launcher: psutil.Process) -> dict[str, psutil.Process]:
    """The stage's rank processes under `launcher` (the stage's own command), by their RANK."""
    found = {}
    for child in launcher.children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:  # a process that ended meanwhile
            continue
        if rank is not None:
            found[rank] = child
    return found


@pytest.mark.slow
def test_a_killed_rank_ends_the_stage_with_an_error_instead_of_leaving_the_other_waiting(tmp_path):
    root = make_world(tmp_path / "world", fit=40, select=10, length=40)
    params = {"models": committed("models"), "machine": committed("machine", device="cpu", threads=1),
              # enough repeats that the stage outlives the kill
              "extract": committed("extract", shard_sequences=2, batch_sequences=2, repeats=1000,
                                   processes=2)}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    stage = subprocess.Popen([sys.executable, "-m", "pipeline.extract", "source"], cwd=root, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        at_work = root / "caches/source/fit/shard-00001.safetensors"  # rank 1's first shard: it joined and works
        deadline = time.monotonic() + 300
        while not at_work.exists():
            assert stage.poll() is None and time.monotonic() < deadline, "the stage never started its work"
            time.sleep(0.1)
        ranks = _rank_processes(psutil.Process(stage.pid))
        ranks["1"].kill()
        killed = time.monotonic()
        try:
            _, err = stage.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the stage still runs 60 s after one of its ranks was killed")
        took = time.monotonic() - killed
    finally:
        if stage.poll() is None:
            os.killpg(stage.pid, signal.SIGKILL)
            stage.wait()
    assert stage.returncode != 0 and took < 60
    assert not ranks["0"].is_running()  # the rank left alive was ended too, not left waiting in a collective
    assert err.strip().splitlines()[-1].startswith("error: pipeline.extract failed on one of its 2 processes"), err


PROGRESS_BAR = re.compile(r"[\w ]+: +\d+%\|")  # tqdm's, as the stage's and transformers' loading print them


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_ctrl_c_mid_work_ends_the_stage_with_one_line_and_status_130_leaving_no_partial_file(tmp_path, processes):
    root = make_world(tmp_path / "world", fit=40, select=10, length=40)
    params = {"models": committed("models"), "machine": committed("machine", device="cpu", threads=1),
              # enough repeats that the stage outlives the interrupt
              "extract": committed("extract", shard_sequences=2, batch_sequences=2, repeats=1000,
                                   processes=processes)}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    stage = subprocess.Popen([sys.executable, "-m", "pipeline.extract", "source"], cwd=root, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        at_work = root / "caches/source/fit/shard-00001.safetensors"  # the last rank's first shard: all at work
        deadline = time.monotonic() + 300
        while not at_work.exists():
            assert stage.poll() is None and time.monotonic() < deadline, "the stage never started its work"
            time.sleep(0.1)
        ranks = _rank_processes(psutil.Process(stage.pid))
        assert len(ranks) == (processes if processes > 1 else 0)
        os.killpg(stage.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its foreground process group
        try:
            _, err = stage.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the stage still runs 60 s after Ctrl-C")
    finally:
        if stage.poll() is None:
            os.killpg(stage.pid, signal.SIGKILL)
            stage.wait()
    said = [line for line in err.splitlines() if line.strip() and not PROGRESS_BAR.match(line)]
    assert stage.returncode == 130 and said == ["interrupted: extract"], err
    assert not any(rank.is_running() for rank in ranks.values())
    assert not [path for path in root.rglob("*") if path.name.endswith((".tmp", ".old"))]
    assert not (root / "caches/source/manifest.json").exists() and not (root / "metrics/extract_source.json").exists()
    shards = sorted((root / "caches/source").rglob("*.safetensors"))
    assert shards and all(verify_file(shard) for shard in shards)  # each shard written whole, or not at all
