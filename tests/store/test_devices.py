"""Devices and usage figures (`store.devices`): several ranks' usage is the slowest and the largest with each peak
beside, a stage's figures say when a queued experiment may have shared the machine, and a matmul is timed in each
dtype asked for, and `auto` is the faster dtype of this machine."""
import pytest

from pipeline.store import devices
from pipeline.store.devices import SHARED_NOTE, StageUsage, matmul_ms, usage_of_ranks
from pipeline.store.models import ModelsParams


def test_usage_of_several_ranks_is_the_slowest_and_the_largest_with_each_peak_beside():
    one = {"wall_s": 3.0, "peak_memory_mib": 100.0, "peak_memory_of": "process rss", "device": "cpu"}
    two = dict(one, wall_s=5.0, peak_memory_mib=80.0)
    assert usage_of_ranks([one]) == one
    both = usage_of_ranks([one, two])
    assert (both["wall_s"], both["peak_memory_mib"], both["peak_memory_mib_per_rank"], both["processes"]) == \
        (5.0, 100.0, [100.0, 80.0], 2)


def test_stage_figures_say_when_a_queued_experiment_may_have_shared_the_machine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert "timing_note" not in StageUsage("cpu").figures()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # dvc repro / dvc exp run in the workspace itself
    assert "timing_note" not in StageUsage("cpu").figures()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "elsewhere"))  # an executor's copy under .dvc/tmp/exps
    assert StageUsage("cpu").figures()["timing_note"] == SHARED_NOTE


def test_a_matmul_is_timed_in_each_dtype_asked_for_in_milliseconds():
    times = matmul_ms(("float32", "float32"), threads=1, size=64)
    assert len(times) == 2 and all(0 < ms < 1000 for ms in times)


@pytest.mark.parametrize("timings, chosen", [((6.7, 227.5), "float32"), ((11.4, 3.8), "bfloat16")],
                         ids=["avx2 only: bfloat16 crawls", "amx: bfloat16 the faster"])
def test_dtype_auto_becomes_the_dtype_this_cpu_runs_a_matmul_faster_in(monkeypatch, timings, chosen):
    monkeypatch.setattr(devices, "matmul_ms", lambda dtypes, threads: list(timings))
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    devices.machine_dtype.cache_clear()
    devices.cpu_matmul_ms.cache_clear()
    try:
        section = {"kind": "random", "source": "tiny", "target": "tiny", "source_revision": None,
                   "target_revision": None, "dtype": "auto", "device_map": None}
        assert ModelsParams.model_validate(section).dtype == chosen
        assert devices.machine_dtype()[1] == {"device": "cpu", "threads": devices.torch.get_num_threads(),
                                              "float32_ms": timings[0], "bfloat16_ms": timings[1]}
        assert ModelsParams.model_validate({**section, "dtype": "float16"}).dtype == "float16"  # named: as named
    finally:
        devices.machine_dtype.cache_clear()
        devices.cpu_matmul_ms.cache_clear()
