"""The tiny world's task items (`tiny.items`): HellaSwag and PIQA items render as lm-eval renders them, their
choices are distinct and of equal length, and a context never states a town."""
import ast
from pathlib import Path

import datasets
import lm_eval.tasks
import yaml
from lm_eval.tasks.hellaswag.utils import process_docs
from lm_eval.utils import apply_template

from pipeline.tiny.items import render_hellaswag, render_piqa
from pipeline.tiny.world import TOWNS

HELLASWAG_COLUMNS = ["ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "label", "split", "split_type",
                     "source_id"]
PIQA_YAML = Path(lm_eval.tasks.__file__).parent / "piqa" / "piqa.yaml"


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
