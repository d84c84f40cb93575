"""Fixtures of the tiny world's tests: a small draw of the world."""
from __future__ import annotations

import pytest
from helpers.tiny import small_world


@pytest.fixture(scope="module")
def world():
    return small_world()
