"""Scoring continuations after the handoff (`kv.scoring`): one context's continuations pack into rows no longer
than the window."""
from pipeline.kv.scoring import window_parts


def test_one_contexts_continuations_pack_into_rows_no_longer_than_the_window():
    requests = [([1, 2], [3] * length) for length in (3, 4, 2, 5)]
    assert window_parts([0, 1, 2, 3], requests, max_length=7) == [[0, 1], [2, 3]]
    assert window_parts([0, 1, 2, 3], requests, max_length=2) == [[0], [1], [2], [3]]  # a long one still fits alone
