"""The lazy import (`store.lazy`): a lazy module reads and writes through to the module, gives the library's own
objects, and a module that does not exist fails at its first use."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from pipeline.store.lazy import lazy


def test_a_lazy_module_reads_through_to_the_module(tmp_path, monkeypatch):
    (tmp_path / "kvh_lazy_probe.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvh_lazy_probe", raising=False)
    probe = lazy("kvh_lazy_probe")
    assert "kvh_lazy_probe" not in sys.modules and "(imported)" not in repr(probe)
    assert probe.VALUE == 42
    module = sys.modules["kvh_lazy_probe"]
    assert isinstance(module, types.ModuleType) and "(imported)" in repr(probe)
    monkeypatch.setattr(module, "VALUE", 7)  # a patched attribute is seen: the proxy copies nothing
    assert probe.VALUE == 7
    monkeypatch.delitem(sys.modules, "kvh_lazy_probe")


def test_setting_an_attribute_of_a_lazy_module_sets_the_modules_own(tmp_path, monkeypatch):
    (tmp_path / "kvh_lazy_target.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvh_lazy_target", raising=False)
    probe = lazy("kvh_lazy_target")
    probe.VALUE = 5  # imports the module, then sets its attribute (not the proxy's)
    assert sys.modules["kvh_lazy_target"].VALUE == 5 and "VALUE" not in vars(probe)
    monkeypatch.delitem(sys.modules, "kvh_lazy_target")


def test_a_lazy_module_gives_the_libraries_own_objects():
    assert lazy("torch").cat is torch.cat and lazy("torch.nn.functional").gelu is torch.nn.functional.gelu


def test_a_lazy_module_that_does_not_exist_fails_at_its_first_use():
    missing = lazy("kvh_no_such_module")
    with pytest.raises(ModuleNotFoundError, match="kvh_no_such_module"):
        missing.anything
