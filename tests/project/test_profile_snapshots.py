"""Every profile composes to its snapshot (tests/data/profiles/, written by tools/profiles.py): an edit of conf/
changes exactly the profiles its snapshots' diff shows."""
import pytest
import yaml
from profiles import SNAPSHOTS, composed, differences, profiles


@pytest.mark.parametrize("profile", profiles())
def test_every_profile_composes_to_its_snapshot(profile):
    snapshot = SNAPSHOTS / f"{profile}.yaml"
    assert snapshot.is_file(), f"no snapshot {snapshot}: write it with `python tools/profiles.py`"
    moved = differences(yaml.safe_load(snapshot.read_text()), yaml.safe_load(composed(profile)))
    assert not moved, (f"profile {profile} composes differently from {snapshot.name}: {'; '.join(moved)}; if "
                       f"deliberate, rewrite the snapshots with `python tools/profiles.py` and commit their diff")


def test_a_changed_value_is_named_with_its_dotted_key_and_both_values():
    before = {"fit": {"ks": [1, 4], "mlp": {"hidden": 64}}, "gone": 1}
    after = {"fit": {"ks": [1, 4], "mlp": {"hidden": 32}}, "new": {"x": 2}}
    assert differences(before, after) == ["fit.mlp.hidden: 64 -> 32", "gone: 1 -> '<absent>'",
                                          "new: '<absent>' -> {'x': 2}"]
