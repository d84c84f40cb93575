"""Tests of the tiny world: determinism, nesting, disjointness, every item kind in both tasks and parts, and the
corpus's statement kinds."""


import pandas as pd
import pytest
from helpers.tiny import SMALL, small_world

from pipeline.store.splits import ITEM_KINDS, OverlapError, check_disjoint


def test_same_seed_gives_identical_world(world):
    again = small_world()
    assert world.keys() == again.keys()
    for name in world:
        assert world[name].equals(again[name]), name


def test_different_seed_gives_different_world(world):
    other = small_world(SMALL.model_copy(update=dict(seed=1)))
    for name in world:
        assert not world[name].content_hash.equals(other[name].content_hash), name


def test_smaller_draw_is_prefix_of_larger_draw(world):
    larger = small_world(SMALL.model_copy(update=dict(corpus_docs=600)), fit=9, items_per_part=60)
    for name in ("corpus", "fit", "hellaswag_dev", "piqa_eval"):
        n = len(world[name])
        assert larger[name].head(n).reset_index(drop=True).equals(world[name]), name


def test_all_splits_are_disjoint(world):
    check_disjoint(world)
    assert len(world) == 8


def test_overlap_of_a_document_id_is_detected(world):
    leaked = world["hellaswag_dev"].head(1)
    frames = dict(world, hellaswag_eval=pd.concat([world["hellaswag_eval"].iloc[1:], leaked]))
    with pytest.raises(OverlapError, match="doc_id 'hellaswag-dev-000000'.*'hellaswag_dev'.*'hellaswag_eval'"):
        check_disjoint(frames)


def test_overlap_of_content_under_a_new_id_is_detected(world):
    copied = world["fit"].head(1).assign(doc_id="eval-999999")
    with pytest.raises(OverlapError, match="content_hash"):
        check_disjoint(dict(world, eval=pd.concat([world["eval"], copied])))


def test_every_kind_is_in_both_tasks_and_parts(world):
    for name in ("hellaswag_dev", "hellaswag_eval", "piqa_dev", "piqa_eval"):
        assert set(world[name].kind) == set(ITEM_KINDS), name


def test_corpus_holds_every_statement_kind_in_both_rendered_forms(world):
    corpus = world["corpus"]
    story, qa = corpus[corpus.kind == "story"].text, corpus[corpus.kind == "qa"].text
    assert story.str.contains(" from ").any() and story.str.startswith("story: ").all()
    assert qa.str.contains("?\nAnswer: ", regex=False).all()
    assert qa.str.contains("where is").any() and qa.str.contains("what does").any()
    assert set(corpus.kind) == {"story", "qa", "bio", "copy"}
