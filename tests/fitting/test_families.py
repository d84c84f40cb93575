"""fitting.families' spilled parts: a fit's per-layer tensors on disk, gone when the fit ends, done or interrupted."""
import pytest
import torch

from pipeline.fitting.families import Parts


def test_the_parts_folder_is_removed_when_the_fit_is_interrupted(tmp_path):
    folder = tmp_path / "mappers" / ".parts.tmp"
    with pytest.raises(KeyboardInterrupt):
        with Parts(folder) as parts:
            parts.put("linear_k1_lam1", 0, "keys", (torch.ones(2, 2),))
            assert len(list(folder.iterdir())) == 1
            raise KeyboardInterrupt  # SIGTERM to the process group mid-fit: before, 38 parts stayed in .parts
    assert list((tmp_path / "mappers").iterdir()) == []


def test_only_the_owner_of_the_parts_removes_them(tmp_path):
    folder = tmp_path / ".parts.tmp"
    with Parts(folder) as owner:
        with Parts(folder, fresh=False) as joined:  # another rank: it joins the folder as it is
            joined.put("mlp_k1", 0, "values", (torch.zeros(3),))
        assert folder.is_dir()  # the joined rank's end left it
        assert [t.tolist() for (t,) in owner.take("mlp_k1", 1, "values")] == [[0.0, 0.0, 0.0]]
    assert not folder.exists()
