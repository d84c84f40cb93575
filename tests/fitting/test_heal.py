"""Healing a sibling from the target's logits (`fitting.heal`): the kept KL, calibration windows cut into rows,
and healing lowers the KL to the target on held-out rows."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers.kvworld import VOCAB
from helpers.sibling import IDS, KV_HEADS, LAYERS, llama_target, project_folder, rows, sibling_params, whole

from pipeline.fitting.heal import Teacher, TopTeacher, cut_rows, heal, kept_kl, kl_per_position, scored
from pipeline.fitting.importance import importance
from pipeline.fitting.prune import choose_cut, pruned
from pipeline.store import paths


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return project_folder(tmp_path_factory.mktemp("sibling"))


def test_the_kept_kl_is_the_full_kl_with_one_token_left_over_and_below_it_with_fewer_kept():
    target, student = llama_target(), pruned(llama_target(), whole(channels=16, heads=2))
    row = [IDS[0].tolist()]
    with torch.no_grad():
        teacher_logits, student_logits = target(input_ids=IDS).logits, student(input_ids=IDS).logits
        full = kl_per_position(teacher_logits, student_logits)  # (1, T)
        every = kept_kl(TopTeacher(target, row, VOCAB - 1, 1).kept([0]), student_logits)  # the rest: one token
        few = kept_kl(TopTeacher(target, row, 4, 1).kept([0]), student_logits)
    torch.testing.assert_close(every, full, atol=1e-5, rtol=1e-4)
    assert bool((few <= full + 1e-6).all()) and bool((few > 0).all())


def test_calibration_windows_are_cut_into_full_rows_in_order_and_a_short_window_stays_whole():
    long, short = list(range(10)), [7, 8]
    assert cut_rows([long, short], 4) == [[0, 1, 2, 3], [4, 5, 6, 7], short]  # the tail 8, 9 is left out
    assert cut_rows([long], 5) == [long[:5], long[5:]] and cut_rows([short], 2) == [short]
    with pytest.raises(ValueError, match="row length 0"):
        cut_rows([long], 0)


def test_healing_lowers_the_kl_to_the_target_on_held_out_rows(project):
    target = llama_target()
    student = pruned(target, choose_cut(importance(target, [(IDS, torch.ones_like(IDS))]), list(range(LAYERS)), 16, 2,
                                        KV_HEADS))
    held_out = Teacher(target, rows(project, paths.split("select")))
    before = scored(student, held_out, list(range(8)), 4)
    settings = sibling_params()
    result = heal(student, TopTeacher(target, rows(project, paths.CALIBRATION_POOL), settings.top_k, 4), held_out,
                  settings, time.perf_counter())
    after = scored(student, held_out, list(range(8)), 4)
    assert result["steps"] == 40 and result["stopped_by"] == "steps"
    assert after["kl"] < 0.85 * before["kl"], (before, after)
    assert [point["step"] for point in result["curve"]] == [0, 20, 40]
