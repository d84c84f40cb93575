"""Stage `prepare_data`: the sequence sets and task items of the study, as Parquet under data/, with their tokenizer.

Splits `fit`, `select`, `eval` (prompt and continuation) and `calibration` (fit's draw continued: its first
`fit_sequences` rows are `fit`), HellaSwag / PIQA items (`dev`, `eval`) and each `data.long` length's prompts and
pass-key items, from the tiny world (`generated`) or a hub or local corpus (`hub`). Draws are seeded and nested (the
first n of a larger draw are the smaller); fit aside, no two splits or lengths share a document (id or content hash).
"""
from __future__ import annotations

import functools
import itertools
import json
import random
import re
from pathlib import Path

from pipeline.measure.tasks import write_task_config
from pipeline.schema.prepare_data import DataParams, HubDataset
from pipeline.store import paths
from pipeline.store.artifacts import atomic_dir, atomic_path, read_table
from pipeline.store.cli import entry, no_arguments
from pipeline.store.haystack import retrieval_items
from pipeline.store.lazy import lazy
from pipeline.store.models import ModelNotAvailableError, hub_reachable, load_tokenizer
from pipeline.store.params import ParamError, load_section
from pipeline.store.splits import SEQUENCE_SPLITS, TASK_PARTS, TASKS, check_disjoint, content_hash
from pipeline.tiny.corpus import generate_world
from pipeline.tiny.tokenizer import train_tokenizer

datasets = lazy("datasets")
pd = lazy("pandas")


def generated(params: DataParams) -> tuple[dict[str, pd.DataFrame], object]:
    # eval documents shorter than prompt + continuation are skipped: draw spares, keep the first n
    counts = {"fit": params.calibration_sequences, "select": params.select_sequences, "eval": 3 * params.eval_prompts}
    world = generate_world(params.world, counts, max(params.dev_items, params.eval_items))
    tokenizer = train_tokenizer(world["corpus"]["text"])
    frames = {"corpus": world["corpus"]}
    for split in SEQUENCE_SPLITS:
        frames[split] = tokenize_sequences(world[split], tokenizer, params, split)
    if len(frames["eval"]) < params.eval_prompts:
        raise ParamError(
            f"data.prompt_length + data.continuation_length = {params.prompt_length + params.continuation_length} "
            f"tokens: only {len(frames['eval'])} of {len(world['eval'])} eval documents are that long; shorten them")
    frames["eval"] = frames["eval"].head(params.eval_prompts)
    frames["calibration"], frames["fit"] = frames["fit"], frames["fit"].head(params.fit_sequences)
    for task in TASKS:
        frames[f"{task}_dev"] = world[f"{task}_dev"].head(params.dev_items).reset_index(drop=True)
        frames[f"{task}_eval"] = world[f"{task}_eval"].head(params.eval_items).reset_index(drop=True)
    return frames, tokenizer


def tokenize_sequences(docs: pd.DataFrame, tokenizer, params: DataParams, split: str) -> pd.DataFrame:
    """Token ids of each document, cut to sequence_length; eval documents split into prompt and continuation."""
    rows = []
    for doc in docs.itertuples(index=False):
        ids = tokenizer.encode(doc.text)[: params.sequence_length]
        row = dict(doc_id=doc.doc_id, text=doc.text, token_ids=ids, content_hash=doc.content_hash)
        if split == "eval":
            needed = params.prompt_length + params.continuation_length
            if len(ids) < needed:
                continue
            row["prompt_ids"] = ids[: params.prompt_length]
            row["continuation_ids"] = ids[params.prompt_length : needed]
        rows.append(row)
    return pd.DataFrame(rows)


def _load_rows(source: HubDataset, what: str) -> list[dict]:
    """Rows of a dataset from a local file or the hub; a clear error naming it when neither is available."""
    if source.path:
        path = Path(source.path)
        if not path.is_file():
            raise FileNotFoundError(f"data.{what}.path: {path} not found")
        if path.suffix == ".parquet":
            rows = read_table(path).to_dict("records")
        elif path.suffix in (".jsonl", ".json"):
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            rows = [{"text": path.read_text()}]
    else:  # a hub dataset: the schema refuses a source with neither
        if not hub_reachable():
            raise ModelNotAvailableError(
                f"dataset {source.dataset!r} ({what}) cannot be fetched: the Hugging Face hub is unreachable. "
                f"Download it where the hub is reachable, or set data.{what}.path to a local file "
                f"(.jsonl/.parquet; for the corpus also plain text)"
            )
        rows = list(datasets.load_dataset(source.dataset, source.config, split=source.split))
    if source.labels_path:
        labels = Path(source.labels_path).read_text().split()
        if len(labels) != len(rows):
            raise ParamError(f"data.{what}.labels_path: {len(labels)} labels for {len(rows)} rows")
        rows = [dict(row, label=int(label)) for row, label in zip(rows, labels)]
    return rows


_HEADING = re.compile(r"^ = [^=].* = $")


def corpus_documents(rows: list[dict]) -> list[str]:
    """Articles of a WikiText-style corpus (split at top-level ` = Title = ` lines), or one row per document."""
    lines = [line for row in rows for line in row["text"].splitlines()]
    if not any(_HEADING.match(line) for line in lines):
        return [row["text"] for row in rows if row["text"].strip()]
    documents, current = [], []
    for line in lines:
        if _HEADING.match(line) and current:
            documents.append("\n".join(current))
            current = []
        current.append(line)
    documents.append("\n".join(current))
    return [d for d in documents if d.strip()]


def _first_groups(stream: list[str], groups: dict[str, list[dict]], wanted: int) -> set[str]:
    """The groups whose items the first `wanted` items of `stream` come from."""
    before = itertools.accumulate((len(groups[key]) for key in stream), initial=0)  # items ahead of each group
    return {key for key, count in zip(stream, before) if count < wanted}


def _interleaved(keys: list[str], seed: int, parts: int) -> list[list[str]]:
    """A seeded permutation of keys dealt into `parts` streams: each stream's first n are nested draws."""
    order = sorted(keys)
    random.Random(seed).shuffle(order)
    return [order[i::parts] for i in range(parts)]


def pick_windows(stream: list[str], wanted: int, windows_of) -> list[tuple[str, int]]:
    """The first `wanted` (doc_id, window) pairs: window 0 of every document of the stream that has one, in stream
    order, then window 1 of those that have it, and so on, so a few long documents (WikiText-2's test file) can still
    feed a large fit set; `windows_of(doc_id)` counts a document's whole windows. Nested: a smaller draw starts a larger
    one; a split's windows come only from its own documents."""
    chosen, counts = [], {}
    for doc_id in stream:
        if len(chosen) == wanted:
            return chosen
        counts[doc_id] = windows_of(doc_id)
        if counts[doc_id] >= 1:
            chosen.append((doc_id, 0))
    window = 1
    while len(chosen) < wanted and any(count > window for count in counts.values()):
        chosen += [(doc_id, window) for doc_id in stream if counts[doc_id] > window][: wanted - len(chosen)]
        window += 1
    return chosen


def split_windows(stream: list[str], wanted: int, size: int, prompt_length: int | None, encode, by_id, tokenizer,
                  key: str, split: str, first: int | None = None) -> pd.DataFrame:
    """The first `wanted` windows of `size` tokens of a split's documents, as rows, cut at `prompt_length` where
    given; `first`: the tokens a document's first window keeps (`size` when None)."""
    chosen = pick_windows(stream, wanted, lambda doc_id: len(encode(doc_id)) // size)
    if len(chosen) < wanted:
        raise ParamError(f"data.{key}: the corpus's {split} documents hold only {len(chosen)} windows of {size} "
                         f"tokens for {wanted} sequences; use a larger corpus, fewer or shorter sequences")
    rows = []
    for doc_id, window in chosen:
        ids, doc_hash = encode(doc_id), by_id.at[doc_id, "content_hash"]
        token_ids = ids[window * size : (window + 1) * size]
        if window == 0:  # the document itself: its id, text and hash, its first `first` tokens
            row = dict(doc_id=doc_id, text=by_id.at[doc_id, "text"], token_ids=ids[: first or size],
                       content_hash=doc_hash)
        else:  # a later window: its own doc_id (`<doc_id>/w<k>`) and content hash
            row = dict(doc_id=f"{doc_id}/w{window}", text=tokenizer.decode(token_ids), token_ids=token_ids,
                       content_hash=content_hash(f"{doc_hash}/w{window}"))
        if prompt_length is not None:
            row["prompt_ids"] = token_ids[:prompt_length]
            row["continuation_ids"] = token_ids[prompt_length:]
        rows.append(row)
    return pd.DataFrame(rows)


def long_parts(params: DataParams, streams: list[list[str]], encode, by_id, tokenizer) -> dict[str, pd.DataFrame]:
    """Each operating length's eval prompts (`long/eval_<n>`: windows of n + continuation tokens) and pass-key items
    (`long/retrieval_<n>`, their haystacks from the same documents), one stream of documents per length."""
    long, frames = params.long, {}
    for (length, part), stream in zip(sorted(long.lengths.items()), streams):
        frames[f"long/eval_{length}"] = split_windows(stream, part.prompts, length + long.continuation, length, encode,
                                                      by_id, tokenizer, f"long.lengths.{length}.prompts",
                                                      f"eval_{length}")
        if part.retrieval:
            documents = [(doc_id, encode(doc_id)) for doc_id in stream if len(encode(doc_id)) >= length]
            if not documents:
                raise ParamError(f"data.long.lengths.{length}.retrieval: no document of its stream holds {length} "
                                 f"tokens; use a larger corpus or a shorter length")
            frames[f"long/retrieval_{length}"] = retrieval_items(documents, length, part.retrieval,
                                                                 long.retrieval.form(), tokenizer, params.seed + length)
    return frames


def hub(params: DataParams) -> tuple[dict[str, pd.DataFrame], object]:
    tokenizer = load_tokenizer(params.tokenizer, params.tokenizer_revision)
    documents = corpus_documents(_load_rows(params.corpus, "corpus"))
    docs = pd.DataFrame({"doc_id": [f"doc-{i:06d}" for i in range(len(documents))], "text": documents})
    docs["content_hash"] = docs["text"].map(content_hash)
    docs = docs.drop_duplicates("content_hash")
    streams = _interleaved(list(docs["doc_id"]), params.seed, len(SEQUENCE_SPLITS))
    long_streams = []
    if params.long is not None:  # the eval stream's documents dealt again: the short eval, then each length
        parts = 1 + len(params.long.lengths)
        streams[-1], *long_streams = [streams[-1][i::parts] for i in range(parts)]
    by_id = docs.set_index("doc_id")
    encode = functools.cache(lambda doc_id: tokenizer.encode(by_id.at[doc_id, "text"]))
    # the models come from the hub, not from training here: the training corpus is empty (same schema)
    frames = {"corpus": pd.DataFrame({"doc_id": [], "kind": [], "text": [], "loss_from": [], "content_hash": []})}
    for split, stream, wanted, key in zip(SEQUENCE_SPLITS, streams,
                                          (params.calibration_sequences, params.select_sequences, params.eval_prompts),
                                          ("calibration_sequences", "select_sequences", "eval_prompts")):
        size = params.prompt_length + params.continuation_length if split == "eval" else params.sequence_length
        frames[split] = split_windows(stream, wanted, size, params.prompt_length if split == "eval" else None,
                                      encode, by_id, tokenizer, key, split, first=params.sequence_length)
    frames["calibration"], frames["fit"] = frames["fit"], frames["fit"].head(params.fit_sequences)
    if params.long is not None:
        frames.update(long_parts(params, long_streams, encode, by_id, tokenizer))
    for task, group_of in (("hellaswag", lambda r: str(r.get("source_id") or r["ind"])), ("piqa", lambda r: r["goal"])):
        groups: dict[str, list[dict]] = {}
        for index, row in enumerate(_load_rows(getattr(params, task), task)):
            row.setdefault("ind", index)
            row["doc_id"] = f"{task}-{group_of(row)}"
            row["content_hash"] = content_hash(json.dumps({k: row[k] for k in sorted(row) if k != "doc_id"},
                                                          default=str))
            row["kind"] = None
            groups.setdefault(row["doc_id"], []).append(row)
        streams = _interleaved(list(groups), params.seed, 2)
        if params.eval_items is None:  # the whole split but the dev part: the dev stream's unused groups join eval
            dev_groups = _first_groups(streams[1], groups, params.dev_items)
            streams[0] = streams[0] + [key for key in streams[1] if key not in dev_groups]
        for part, stream, wanted in zip(("eval", "dev"), streams, (params.eval_items, params.dev_items)):
            items = [row for key in stream for row in groups[key]][:wanted]
            if wanted is not None and len(items) < wanted:
                raise ParamError(f"data: {task} has only {len(items)} items for its {part} part, {wanted} asked")
            frames[f"{task}_{part}"] = pd.DataFrame(items)
    return frames, tokenizer


def run(params: DataParams, out: Path) -> dict[str, int]:
    frames, tokenizer = generated(params) if params.kind == "generated" else hub(params)
    # the pool holds the fit split (nested draws): every other split is disjoint from it, so from fit too; the
    # sequence splits and each operating length (its prompts and pass-key items) hold documents of their own
    long = paths.LONG.name + "/"
    checked = {name: frame for name, frame in frames.items() if name != "fit"}
    groups = {split: [split] for split in ("calibration", "select", "eval")}
    for name in checked:
        if name.startswith(long):
            groups.setdefault(name.rsplit("_", 1)[1], []).append(name)
    check_disjoint(checked, groups)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out / paths.LONG.name) as staging:  # empty without data.long
        for name, frame in frames.items():
            if name.startswith(long):
                frame.to_parquet(staging / f"{name.removeprefix(long)}.parquet", index=False)
            else:
                with atomic_path(out / f"{name}.parquet") as tmp:
                    frame.to_parquet(tmp, index=False)
    with atomic_dir(out / "tokenizer") as staging:
        tokenizer.save_pretrained(staging)
    with atomic_dir(out / "tasks") as staging:  # lm-eval task configs of the task files, for --include_path
        for task in TASKS:
            for part in TASK_PARTS:
                write_task_config(staging, task, f"kvh_{task}_{part}", out / f"{task}_{part}.parquet")
    return {name: len(frame) for name, frame in frames.items()}


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.prepare_data", __doc__, argv)
    counts = run(load_section(DataParams, "data"), paths.DATA)
    print(json.dumps(counts, indent=2))


if __name__ == "__main__":
    entry(main)
