"""Tests of the tiny world: determinism, nesting, disjointness, lm-eval schemas, tokenizer round trip."""

import ast
from pathlib import Path

import datasets
import lm_eval.tasks
import pandas as pd
import pytest
import yaml
from helpers import committed
from lm_eval.tasks.hellaswag.utils import process_docs
from lm_eval.utils import apply_template
from transformers import AutoTokenizer

from pipeline.store.params import parse
from pipeline.store.splits import ITEM_KINDS, OverlapError, check_disjoint
from pipeline.tiny.corpus import generate_world
from pipeline.tiny.items import render_hellaswag, render_piqa, task_items
from pipeline.tiny.tokenizer import train_tokenizer
from pipeline.tiny.world import TOWNS, WorldConfig

SMALL = parse(WorldConfig, committed("data.world", corpus_docs=400), "data.world")


def small_world(cfg: WorldConfig = SMALL, fit: int = 6, items_per_part: int = 40) -> dict[str, pd.DataFrame]:
    return generate_world(cfg, {"fit": fit, "select": 4, "eval": 5}, items_per_part)

HELLASWAG_COLUMNS = ["ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "label", "split", "split_type",
                     "source_id"]
PIQA_YAML = Path(lm_eval.tasks.__file__).parent / "piqa" / "piqa.yaml"


@pytest.fixture(scope="module")
def world():
    return small_world()


@pytest.fixture(scope="module")
def tokenizer(world):
    return train_tokenizer(world["corpus"].text)


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


def test_hellaswag_items_render_through_lm_eval_process_docs(world):
    for part in ("dev", "eval"):
        items = world[f"hellaswag_{part}"]
        assert set(HELLASWAG_COLUMNS) <= set(items.columns)
        processed = process_docs(datasets.Dataset.from_pandas(items[HELLASWAG_COLUMNS], preserve_index=False))
        for doc, (_, item) in zip(processed, items.iterrows()):
            query, choices, gold = render_hellaswag(item)
            assert (doc["query"], doc["choices"], doc["gold"]) == (query, choices, gold)
            assert query.startswith("story: ") and " Later " in query


def test_piqa_items_render_through_lm_eval_templates(world):
    # unlike hellaswag.yaml, piqa.yaml has no `!function` tag, so a plain YAML load reads lm-eval's templates
    config = yaml.safe_load(PIQA_YAML.read_text())
    for part in ("dev", "eval"):
        for _, item in world[f"piqa_{part}"].iterrows():
            doc = {"goal": item.goal, "sol1": item.sol1, "sol2": item.sol2, "label": int(item.label)}
            query, choices, gold = render_piqa(item)
            assert apply_template(config["doc_to_text"], doc) == query
            assert ast.literal_eval(apply_template(config["doc_to_choice"], doc)) == choices
            assert doc[config["doc_to_target"]] == gold
            assert query.startswith("Question: ") and query.endswith("?\nAnswer:")


def test_every_kind_is_in_both_tasks_and_parts(world):
    for name in ("hellaswag_dev", "hellaswag_eval", "piqa_dev", "piqa_eval"):
        assert set(world[name].kind) == set(ITEM_KINDS), name


def test_choices_are_distinct_and_of_equal_length_so_acc_norm_ranks_like_acc(world):
    for task, render in (("hellaswag", render_hellaswag), ("piqa", render_piqa)):
        for _, item in world[f"{task}_dev"].iterrows():
            _, choices, _ = render(item)
            assert len(set(choices)) == len(choices) == (4 if task == "hellaswag" else 2)
            assert len({len(c) for c in choices}) == 1, choices


def test_item_contexts_never_state_a_town(world):
    for task, render in (("hellaswag", render_hellaswag), ("piqa", render_piqa)):
        for _, item in world[f"{task}_eval"].iterrows():
            words = set(render(item)[0].split())
            assert not words & set(TOWNS)


def test_corpus_holds_every_statement_kind_in_both_rendered_forms(world):
    corpus = world["corpus"]
    story, qa = corpus[corpus.kind == "story"].text, corpus[corpus.kind == "qa"].text
    assert story.str.contains(" from ").any() and story.str.startswith("story: ").all()
    assert qa.str.contains("?\nAnswer: ", regex=False).all()
    assert qa.str.contains("where is").any() and qa.str.contains("what does").any()
    assert set(corpus.kind) == {"story", "qa", "bio", "copy"}


def test_tokenizer_round_trips_rendered_items_and_splits_at_the_word_boundary(world, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for task, render in (("hellaswag", render_hellaswag), ("piqa", render_piqa)):
        for _, item in world[f"{task}_eval"].iterrows():
            query, choices, _ = render(item)
            context = tokenizer.encode(query)
            for choice in choices:
                whole = tokenizer.encode(f"{query} {choice}")
                assert whole[: len(context)] == context
                assert tokenizer.unk_token_id not in whole
                assert tokenizer.decode(whole) == f"{query} {choice}"
                assert reloaded.encode(f"{query} {choice}") == whole


def test_tokenizer_adds_no_special_tokens_and_has_bos_eos(tokenizer):
    assert tokenizer.encode("story: ann") == tokenizer.encode("story: ann", add_special_tokens=False)
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"
    assert len(tokenizer) < 128


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown task 'arc'"):
        task_items(SMALL, "arc", "dev", 1)
