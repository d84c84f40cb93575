"""Stage prepare_data: the generated world and the hub path (on the real rows in tests/data)."""
import pandas as pd
import pytest
from helpers import HELLASWAG, PIQA, PIQA_LABELS, WIKITEXT, committed, hellaswag_rows, piqa_rows
from lm_eval.tasks import TaskManager, get_task_dict

from pipeline.measure.tasks import write_task_config
from pipeline.prepare_data import run
from pipeline.schema.prepare_data import DataParams
from pipeline.store.models import ModelNotAvailableError
from pipeline.store.params import ParamError, parse
from pipeline.store.splits import check_disjoint, document

SMALL_WORLD = committed("data.world", corpus_docs=300)
SPLITS = ["fit", "select", "eval", "hellaswag_dev", "hellaswag_eval", "piqa_dev", "piqa_eval"]


def generated_params(**overrides) -> DataParams:
    data = committed("data", kind="generated", fit_sequences=6, select_sequences=4, eval_prompts=5, sequence_length=64,
                     prompt_length=30, continuation_length=10, dev_items=12, eval_items=10, world=SMALL_WORLD)
    return _parsed(data, overrides)


def _parsed(data: dict, overrides: dict) -> DataParams:
    """The data params with `overrides`; the calibration pool is the fit split itself unless it is given."""
    data = {**data, "calibration_sequences": overrides.get("fit_sequences", data["fit_sequences"]), **overrides}
    return parse(DataParams, data, "data")


def local(path, labels_path=None) -> dict:
    """A `data.<name>` entry reading a local file instead of the hub."""
    return {"dataset": None, "config": None, "split": "validation", "path": str(path),
            "labels_path": None if labels_path is None else str(labels_path)}


def hub_params(tmp_path, tokenizer, **overrides) -> DataParams:
    tokenizer.save_pretrained(tmp_path / "tok")
    data = committed(
        "data", kind="hub", world=None, fit_sequences=4, select_sequences=3, eval_prompts=5, sequence_length=64,
        prompt_length=32, continuation_length=16, dev_items=20, eval_items=30, tokenizer=str(tmp_path / "tok"),
        corpus=local(WIKITEXT), hellaswag=local(HELLASWAG), piqa=local(PIQA, PIQA_LABELS),
    )
    return _parsed(data, overrides)


def frames(folder):
    return {name: pd.read_parquet(folder / f"{name}.parquet") for name in SPLITS}


def test_generated_data_is_deterministic_and_disjoint(tmp_path):
    run(generated_params(), tmp_path / "a")
    run(generated_params(), tmp_path / "b")
    a, b = frames(tmp_path / "a"), frames(tmp_path / "b")
    for name in SPLITS:
        pd.testing.assert_frame_equal(a[name], b[name])
    check_disjoint(a)
    assert (tmp_path / "a" / "corpus.parquet").is_file() and (tmp_path / "a" / "tokenizer").is_dir()
    assert all(len(ids) == 10 for ids in a["eval"].continuation_ids)


def test_generated_subsamples_are_nested(tmp_path):
    run(generated_params(), tmp_path / "small")
    run(generated_params(fit_sequences=9, dev_items=20), tmp_path / "large")
    small, large = frames(tmp_path / "small"), frames(tmp_path / "large")
    pd.testing.assert_frame_equal(small["fit"], large["fit"].head(6))
    pd.testing.assert_frame_equal(small["hellaswag_dev"], large["hellaswag_dev"].head(12))
    pd.testing.assert_frame_equal(small["select"], large["select"])


@pytest.mark.parametrize("kind", ["generated", "hub"])
def test_the_calibration_pool_continues_the_fit_split_and_stays_disjoint_from_the_rest(tmp_path, tokenizer, kind):
    make = (lambda **o: generated_params(**o)) if kind == "generated" else (
        lambda **o: hub_params(tmp_path, tokenizer, **o))
    run(make(fit_sequences=4, calibration_sequences=9), tmp_path / "data")
    written = frames(tmp_path / "data")
    pool = pd.read_parquet(tmp_path / "data" / "calibration.parquet")
    assert len(pool) == 9 and len(written["fit"]) == 4
    pd.testing.assert_frame_equal(pool.head(4), written["fit"])  # the fit split is the pool's start
    check_disjoint({"calibration": pool, **{k: v for k, v in written.items() if k != "fit"}})
    run(make(fit_sequences=4), tmp_path / "alone")  # a larger pool leaves every other file as it was
    for name in SPLITS:
        assert (tmp_path / "alone" / f"{name}.parquet").read_bytes() == \
            (tmp_path / "data" / f"{name}.parquet").read_bytes(), name
    with pytest.raises(ParamError, match="data.calibration_sequences: 3 is fewer than data.fit_sequences"):
        make(fit_sequences=4, calibration_sequences=3)


def test_hub_path_reads_local_real_rows(tmp_path, tokenizer):
    run(hub_params(tmp_path, tokenizer), tmp_path / "data")
    data = frames(tmp_path / "data")
    check_disjoint(data)
    assert [len(data[n]) for n in SPLITS] == [4, 3, 5, 20, 30, 20, 30]
    assert len(pd.read_parquet(tmp_path / "data" / "corpus.parquet")) == 0
    assert set(data["piqa_eval"].label) <= {0, 1}
    # lm-eval's own task definitions read the written files
    for task in ("hellaswag", "piqa"):
        write_task_config(tmp_path / "tasks", task, f"{task}_check", tmp_path / "data" / f"{task}_eval.parquet")
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    tasks = get_task_dict(["hellaswag_check", "piqa_check"], manager)
    hs = list(tasks["hellaswag_check"].validation_docs())
    assert len(hs) == 30 and hs[0]["query"] and len(hs[0]["choices"]) == 4
    pq = tasks["piqa_check"]
    assert pq.doc_to_text(list(pq.validation_docs())[0]).startswith("Question: ")


def test_hub_subsamples_are_nested(tmp_path, tokenizer):
    run(hub_params(tmp_path, tokenizer), tmp_path / "small")
    run(hub_params(tmp_path, tokenizer, eval_items=40, fit_sequences=5), tmp_path / "large")
    small, large = frames(tmp_path / "small"), frames(tmp_path / "large")
    assert list(small["hellaswag_eval"].ind) == list(large["hellaswag_eval"].ind[:30])
    assert list(small["fit"].doc_id) == list(large["fit"].doc_id[:4])


def test_eval_items_null_takes_every_item_the_dev_part_leaves(tmp_path, tokenizer):
    run(hub_params(tmp_path, tokenizer, eval_items=None), tmp_path / "data")
    data = frames(tmp_path / "data")
    check_disjoint(data)
    assert len(data["hellaswag_dev"]) == len(data["piqa_dev"]) == 20
    for task, rows in (("hellaswag", hellaswag_rows(300)), ("piqa", piqa_rows(300))):
        groups = {f"{task}-{row.get('source_id') or row['goal']}" for row in rows}  # the files' item groups
        assert set(data[f"{task}_eval"].doc_id) | set(data[f"{task}_dev"].doc_id) == groups  # every one used
        assert len(data[f"{task}_eval"]) > 250
    run(hub_params(tmp_path, tokenizer), tmp_path / "some")
    some = frames(tmp_path / "some")
    assert list(some["hellaswag_eval"].ind) == list(data["hellaswag_eval"].ind[:30])  # a draw of 30 starts it
    with pytest.raises(ParamError, match="data.eval_items: null"):
        generated_params(eval_items=None)


def test_missing_hub_dataset_fails_fast_naming_it(tmp_path, tokenizer):
    params = hub_params(tmp_path, tokenizer, hellaswag={**local(HELLASWAG), "dataset": "Rowan/hellaswag", "path": None})
    with pytest.raises(ModelNotAvailableError, match="Rowan/hellaswag"):
        run(params, tmp_path / "data")


def test_missing_local_file_is_named(tmp_path, tokenizer):
    params = hub_params(tmp_path, tokenizer, piqa=local(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        run(params, tmp_path / "data")


@pytest.mark.parametrize("data, message", [
    ({"fit_sequencs": 3}, r"data\.fit_sequencs: unknown parameter"),
    ({"world": None}, r"data\.world: required when data\.kind is 'generated'"),
    ({"kind": "hub", "tokenizer": "x", "corpus": local("c.txt"), "hellaswag": local("h.jsonl"), "piqa": {"pth": "x"}},
     r"data\.piqa\.pth: unknown"),
    ({"eval_items": 0}, r"data\.eval_items: expected a number > 0"),
])
def test_bad_data_params_are_named(data, message):
    with pytest.raises(ParamError, match=message):
        parse(DataParams, committed("data", **data), "data")


def test_world_counts_are_not_world_params():
    with pytest.raises(ParamError, match=r"data\.world\.fit: unknown parameter"):
        parse(DataParams, committed("data", world={"fit": 10}), "data")


def test_a_corpus_of_few_long_documents_feeds_more_sequences_through_windows(tmp_path, tokenizer):
    # 15 articles, dealt 5 to a split: 12 fit sequences need windows beyond the first of each document
    run(hub_params(tmp_path, tokenizer, fit_sequences=12), tmp_path / "data")
    fit = frames(tmp_path / "data")["fit"]
    assert len(fit) == 12 and fit.doc_id.is_unique and fit.content_hash.is_unique
    documents = {doc_id.split("/")[0] for doc_id in fit.doc_id}
    assert len(documents) <= 5 and all(len(ids) == 64 for ids in fit.token_ids)
    check_disjoint(frames(tmp_path / "data"))  # windows stay in their document's split
    first = fit[~fit.doc_id.str.contains("/")]
    run(hub_params(tmp_path, tokenizer, fit_sequences=len(first)), tmp_path / "small")
    pd.testing.assert_frame_equal(frames(tmp_path / "small")["fit"], first)  # one per document while they suffice
    run(hub_params(tmp_path, tokenizer, fit_sequences=9), tmp_path / "nine")
    pd.testing.assert_frame_equal(frames(tmp_path / "nine")["fit"], fit.head(9))  # nested


def test_too_few_windows_is_refused_naming_the_split(tmp_path, tokenizer):
    with pytest.raises(ParamError, match=r"data.calibration_sequences: the corpus's fit documents hold only \d+ "
                                         r"windows of 64 tokens for 5000 sequences"):
        run(hub_params(tmp_path, tokenizer, fit_sequences=5000), tmp_path / "data")


RETRIEVAL = {"needle": "\nThe pass key is {key}. Remember it.\n",
             "question": "\nWhat is the pass key? The pass key is ", "digits": 5, "depths": [0.1, 0.5, 0.9]}


def long_params(tmp_path, tokenizer, lengths=None, **overrides) -> DataParams:
    lengths = lengths or {96: {"prompts": 3, "retrieval": 3}, 160: {"prompts": 2, "retrieval": 2}}
    return hub_params(tmp_path, tokenizer, long={"continuation": 8, "lengths": lengths, "retrieval": RETRIEVAL},
                      **overrides)


def long_frames(folder) -> dict[str, pd.DataFrame]:
    return {path.stem: pd.read_parquet(path) for path in sorted((folder / "long").glob("*.parquet"))}


def test_each_operating_length_has_windows_of_its_length_from_documents_of_its_own(tmp_path, tokenizer):
    run(long_params(tmp_path, tokenizer), tmp_path / "data")
    long, short = long_frames(tmp_path / "data"), frames(tmp_path / "data")
    assert sorted(long) == ["eval_160", "eval_96", "retrieval_160", "retrieval_96"]
    for length, count in ((96, 3), (160, 2)):
        prompts = long[f"eval_{length}"]
        assert len(prompts) == count and prompts.doc_id.is_unique
        assert all(len(p) == length for p in prompts.prompt_ids) and all(len(c) == 8 for c in prompts.continuation_ids)
        assert all(list(t) == list(p) + list(c) for t, p, c in zip(prompts.token_ids, prompts.prompt_ids,
                                                                   prompts.continuation_ids))
    documents = {name: {document(d) for d in frame.doc_id}
                 for name, frame in {**short, "calibration": pd.read_parquet(tmp_path / "data" / "calibration.parquet"),
                                     **long}.items() if name in ("calibration", "select", "eval") or "_" in name
                 and name.split("_")[0] in ("eval", "retrieval")}
    groups = {"calibration": documents["calibration"], "select": documents["select"], "eval": documents["eval"],
              96: documents["eval_96"] | documents["retrieval_96"],
              160: documents["eval_160"] | documents["retrieval_160"]}
    for a in groups:
        for b in groups:
            assert a == b or not groups[a] & groups[b], (a, b)  # no document in two splits, the lengths included


def test_the_operating_lengths_leave_the_fit_and_select_splits_as_they_were(tmp_path, tokenizer):
    run(hub_params(tmp_path, tokenizer), tmp_path / "without")
    run(long_params(tmp_path, tokenizer), tmp_path / "with")
    for name in ("fit", "select", "hellaswag_eval", "piqa_dev"):
        assert (tmp_path / "with" / f"{name}.parquet").read_bytes() == \
            (tmp_path / "without" / f"{name}.parquet").read_bytes(), name
    assert not any((tmp_path / "without" / "long").iterdir())  # written empty without data.long


def test_a_length_whose_documents_are_too_few_is_refused_naming_its_key(tmp_path, tokenizer):
    with pytest.raises(ParamError, match=r"data\.long\.lengths\.160\.prompts: the corpus's eval_160 documents hold "
                                         r"only \d+ windows of 168 tokens for 500 sequences"):
        run(long_params(tmp_path, tokenizer, {160: {"prompts": 500, "retrieval": 0}}), tmp_path / "data")


@pytest.mark.parametrize("data, message", [
    ({"long": {"continuation": 8, "lengths": {}, "retrieval": RETRIEVAL}}, r"data\.long\.lengths: "),
    ({"long": {"continuation": 8, "lengths": {64: {"prompts": 2, "retrieval": 1}},
               "retrieval": {**RETRIEVAL, "needle": "no key here"}}}, r"data\.long\.retrieval: the needle states"),
    ({"long": {"continuation": 8, "lengths": {64: {"prompts": 2, "retrieval": 1}},
               "retrieval": {**RETRIEVAL, "depths": [1.5]}}},
     r"data\.long\.retrieval\.depths\[0\]: expected a number <= 1"),
])
def test_bad_long_params_are_named(tmp_path, tokenizer, data, message):
    with pytest.raises(ParamError, match=message):
        hub_params(tmp_path, tokenizer, **data)


def test_the_generated_world_has_no_operating_lengths():
    with pytest.raises(ParamError, match=r"data\.long: the operating lengths' parts are cut from real text"):
        generated_params(long={"continuation": 8, "lengths": {64: {"prompts": 2, "retrieval": 0}},
                               "retrieval": RETRIEVAL})
