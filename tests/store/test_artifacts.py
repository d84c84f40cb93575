"""Checksummed artifacts: round trip, any flipped byte refused with the file's name, atomic writes."""
import os
import shutil
import signal

import pandas as pd
import pytest
import torch
from helpers import ROOT

from pipeline.store import artifacts, paths
from pipeline.store.artifacts import ArtifactError, load_artifact, nested, save_artifact
from pipeline.store.cli import Refusal


def _artifact(tmp_path):
    path = tmp_path / "thing.safetensors"
    tensors = {"weight": torch.randn(4, 8), "bias": torch.arange(6, dtype=torch.int64)}
    save_artifact(path, tensors, {"k": 4, "source_layers": [[0, 1, 2, 3]]})
    return path, tensors


def test_round_trip_is_bit_identical(tmp_path):
    path, tensors = _artifact(tmp_path)
    loaded, meta = load_artifact(path)
    assert meta == {"k": 4, "source_layers": [[0, 1, 2, 3]]}
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)


def test_writing_is_deterministic(tmp_path):
    tensors = {"w": torch.randn(3, 3)}
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_artifact(a, tensors, {"x": 1})
    save_artifact(b, tensors, {"x": 1})
    assert a.read_bytes() == b.read_bytes()


def test_every_flipped_byte_is_refused_naming_the_file(tmp_path):
    path, _ = _artifact(tmp_path)
    raw = path.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    for offset in range(len(raw)):  # header length, header JSON (metadata, checksum) and tensor bytes
        corrupted = bytearray(raw)
        corrupted[offset] ^= 0x01
        path.write_bytes(corrupted)
        with pytest.raises(ArtifactError, match="thing.safetensors"):
            load_artifact(path)
    assert header_end < len(raw)


def test_missing_and_truncated_files_are_refused(tmp_path):
    with pytest.raises(ArtifactError, match="nothing.safetensors"):
        load_artifact(tmp_path / "nothing.safetensors")
    path, _ = _artifact(tmp_path)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ArtifactError, match="thing.safetensors"):
        load_artifact(path)


def test_interrupted_write_never_appears_under_final_name(tmp_path, monkeypatch):
    def crash(_fd):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(artifacts.os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        save_artifact(tmp_path / "half.safetensors", {"w": torch.randn(100)}, {})
    assert os.listdir(tmp_path) == []


def test_interrupted_write_keeps_the_previous_version(tmp_path, monkeypatch):
    path, tensors = _artifact(tmp_path)
    before = path.read_bytes()
    monkeypatch.setattr(artifacts.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        save_artifact(path, {"other": torch.zeros(2)}, {})
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["thing.safetensors"]


def test_an_interrupt_just_after_the_temporary_is_created_leaves_nothing(tmp_path, monkeypatch):
    """The window `tempfile.mkstemp` left open: the file made, its handle not yet closed (a rank's Ctrl-C in CI)."""
    def interrupted(_fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts.os, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_artifact(tmp_path / "shard.safetensors", {"w": torch.randn(4)}, {})
    assert os.listdir(tmp_path) == []


def test_a_folder_interrupted_between_its_two_renames_is_the_previous_one(tmp_path, monkeypatch):
    final = tmp_path / "zero"
    with artifacts.atomic_dir(final) as staging:
        (staging / "items.parquet").write_text("before")
    replace, calls = os.replace, []

    def second_interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the old folder retired, the new one not yet in its place
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(artifacts.os, "replace", second_interrupted)
    with pytest.raises(KeyboardInterrupt), artifacts.atomic_dir(final) as staging:
        (staging / "items.parquet").write_text("after")
    monkeypatch.setattr(artifacts.os, "replace", replace)
    assert (final / "items.parquet").read_text() == "before"
    assert os.listdir(tmp_path) == ["zero"]


def test_a_staging_folder_left_by_a_killed_run_is_removed_by_the_next(tmp_path):
    final = tmp_path / "eval" / "zero"
    leftover = tmp_path / "eval" / ".zero.abc123.tmp"
    (leftover / "tasks").mkdir(parents=True)
    (leftover / "tasks" / "half.yaml").write_text("x")
    other = tmp_path / "eval" / ".oracle.abc123.tmp"
    other.mkdir()
    with artifacts.atomic_dir(final) as staging:
        (staging / "items.parquet").write_text("done")
    assert not leftover.exists() and other.exists()  # only this output's leftovers
    assert sorted(p.name for p in final.parent.iterdir()) == [".oracle.abc123.tmp", "zero"]


@pytest.fixture
def umask():
    """Set the process's umask for the test; the previous one comes back after it."""
    masks = []
    yield lambda mask: masks.append(os.umask(mask))
    if masks:
        os.umask(masks[0])


# umask, then the mode of a file and of a folder that atomic writes leave
MODES = [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775), (0o077, 0o600, 0o700)]


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o777


@pytest.mark.parametrize("mask,file_mode,folder_mode", MODES, ids=[f"umask {m[0]:03o}" for m in MODES])
def test_atomic_writes_leave_the_modes_the_umask_gives_a_new_file_or_folder(tmp_path, umask, mask, file_mode,
                                                                           folder_mode):
    umask(mask)
    path, _ = _artifact(tmp_path)
    artifacts.write_json_atomic(tmp_path / "pins.json", {"a": 1})
    with artifacts.atomic_dir(tmp_path / "best") as staging:
        artifacts.write_bytes_atomic(staging / "map.safetensors", b"map")
        (staging / "plain.csv").write_text("a\n")
    modes = {name: _mode(tmp_path / name) for name in ("thing.safetensors", "pins.json", "best",
                                                       "best/map.safetensors", "best/plain.csv")}
    assert modes == {"thing.safetensors": file_mode, "pins.json": file_mode, "best": folder_mode,
                     "best/map.safetensors": file_mode, "best/plain.csv": file_mode}


def test_the_umask_is_unchanged_by_an_atomic_write(tmp_path, umask):
    umask(0o027)
    artifacts.write_json_atomic(tmp_path / "a.json", {})
    assert os.umask(0o027) == 0o027


def test_failed_or_missing_controls_are_a_refusal_naming_the_control(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = paths.CONTROLS_VERDICT
    with pytest.raises(Refusal, match="not found: run the controls stage"):
        artifacts.require_controls_passed()
    path.parent.mkdir()
    path.write_text('{"decode": true, "rope": false}')
    with pytest.raises(Refusal, match=r"^controls failed \(rope\): no variant is evaluated"):
        artifacts.require_controls_passed()
    path.write_text('{"decode": true}')
    artifacts.require_controls_passed()


def test_metrics_keys_with_slashes_nest_into_groups():
    assert nested({"a": 1, "maps/m1/r2": 0.5, "maps/m1/k": 1, "maps/m2/r2": 0.25}) == {
        "a": 1, "maps": {"m1": {"r2": 0.5, "k": 1}, "m2": {"r2": 0.25}}}


@pytest.mark.parametrize("flat", [{"a": 1, "a/b": 2}, {"a/b": 2, "a": 1}])
def test_a_metric_that_is_both_a_value_and_a_group_is_refused(flat):
    with pytest.raises(ValueError, match="'a'"):
        nested(flat)


def _pair(tmp_path, content: str) -> list:
    folders = [tmp_path / "models" / side for side in ("source", "target")]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(content)
    return folders


def _contents(folders) -> list[str]:
    return [(folder / "config.json").read_text() for folder in folders]


def test_a_pair_of_folders_interrupted_while_staged_keeps_the_old_pair_and_no_temporary(tmp_path):
    folders = _pair(tmp_path, "old")
    with pytest.raises(KeyboardInterrupt):
        with artifacts.atomic_dirs(folders) as staging:
            (staging[0] / "config.json").write_text("new")
            raise KeyboardInterrupt  # the target still training
    assert _contents(folders) == ["old", "old"]
    assert sorted(path.name for path in (tmp_path / "models").iterdir()) == ["source", "target"]


def test_a_signal_during_the_swap_of_a_pair_comes_after_both_folders_are_swapped(tmp_path, monkeypatch):
    folders = _pair(tmp_path, "old")
    replace, calls = os.replace, []

    def replace_then_sigterm(source, target):  # SIGTERM once the first folder is swapped in, before the second
        replace(source, target)
        calls.append(target)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(artifacts.os, "replace", replace_then_sigterm)
    before = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with artifacts.atomic_dirs(folders) as staging:
                for folder in staging:
                    (folder / "config.json").write_text("new")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert len(calls) == 4 and _contents(folders) == ["new", "new"]  # without the held signal: a new target, old source
    assert sorted(path.name for path in (tmp_path / "models").iterdir()) == ["source", "target"]


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A working directory with the pipeline's dvc.yaml, where the stages run."""
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_truncated_parquet_table_is_one_line_naming_it_and_the_stage_that_makes_it(project):
    table = project / "data" / "eval.parquet"
    table.parent.mkdir()
    pd.DataFrame({"prompt_ids": [[1, 2, 3]] * 8}).to_parquet(table)
    assert artifacts.read_table("data/eval.parquet").prompt_ids.tolist()[0].tolist() == [1, 2, 3]
    table.write_bytes(table.read_bytes()[:-40])  # a copy cut short
    with pytest.raises(ArtifactError, match=r"^data/eval\.parquet: not a readable parquet table \([^\n]+\); "
                                            r"regenerate it: dvc repro -f prepare_data$"):
        artifacts.read_table("data/eval.parquet")
    table.unlink()
    with pytest.raises(ArtifactError, match=r"^data/eval\.parquet: not found; make it \(dvc repro prepare_data\)$"):
        artifacts.read_table("data/eval.parquet")
    with pytest.raises(ArtifactError, match=r"^rows\.parquet: not found$"):  # a user's file: no stage makes it
        artifacts.read_table("rows.parquet")


@pytest.mark.parametrize("path, stage", [
    ("data/long/eval_64.parquet", "prepare_data"),
    ("eval/oracle/prompts.parquet", "evaluate"),
    ("eval/selected/items.parquet", "evaluate_mapped"),  # eval/${key}
    ("eval/candidates/mlp_k1.parquet", "candidates"),  # its own folder, not eval/${key}'s
    ("eval/calibration/10/items.parquet", "calibrate"),
    ("rows.parquet", None),  # a user's file
])
def test_the_stage_that_makes_a_file_is_read_from_dvc_yaml(path, stage, project):
    assert paths.maker(path) == stage
