"""Scoring continuations after the handoff (`kv.scoring`): one context's continuations pack into rows no longer
than the window."""
from pipeline.kv.scoring import fill


def test_one_contexts_continuations_pack_into_rows_no_longer_than_the_window():
    lengths = [3, 4, 2, 5]  # the continuations' tokens
    assert fill([0, 1, 2, 3], lengths.__getitem__, 7) == [[0, 1], [2, 3]]
    assert fill([0, 1, 2, 3], lengths.__getitem__, 2) == [[0], [1], [2], [3]]  # a long one still fits alone
