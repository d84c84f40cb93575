"""The `data` section: splits' sizes and lengths, and the sequences' and task items' source (tiny world, hub, local)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pipeline.store.haystack import RetrievalForm
from pipeline.store.params import Count, ParamError, Params, Positive, Share
from pipeline.tiny.world import WorldConfig


class HubDataset(Params):
    dataset: str | None  # hub id, used when `path` is null
    config: str | None
    split: str
    path: str | None  # a local .jsonl/.json/.parquet (or .txt / .raw for a corpus) instead of the hub
    labels_path: str | None  # PIQA's line-aligned labels file, when `path` has no label column

    @model_validator(mode="after")
    def _somewhere(self) -> HubDataset:
        if not self.dataset and not self.path:
            raise ValueError("give a hub `dataset` or a local `path`")
        return self


class Retrieval(Params):
    """The pass-key items' form (`store.haystack`): the needle states `{key}` once, the question ends the prompt."""
    needle: str
    question: str
    digits: Positive
    depths: Annotated[list[Share], Field(min_length=1)]

    @model_validator(mode="after")
    def _one_key(self) -> Retrieval:
        if self.needle.count("{key}") != 1 or "{key}" in self.question:
            raise ParamError("data.long.retrieval: the needle states {key} exactly once and the question never")
        return self

    def form(self) -> RetrievalForm:
        return RetrievalForm(self.needle, self.question, self.digits, tuple(self.depths))


class LengthPart(Params):
    prompts: Positive  # eval prompts of this length: windows of real text
    retrieval: Count  # pass-key items of this length, their haystacks from the same documents


class LongData(Params):
    """Eval parts at the operating lengths: per prompt length, windows of real text from documents of their own (the
    eval stream's documents dealt again), each prompt followed by `continuation` tokens, and pass-key items."""
    continuation: Positive
    lengths: Annotated[dict[Annotated[int, Field(ge=2)], LengthPart], Field(min_length=1)]
    retrieval: Retrieval


class DataParams(Params):
    kind: Literal["generated", "hub"]
    seed: int
    fit_sequences: Positive
    calibration_sequences: Positive  # the calibration curve's pool: fit's draw continued
    select_sequences: Positive
    eval_prompts: Positive
    sequence_length: Positive  # tokens per fit/select sequence (at most)
    prompt_length: Positive  # eval prompts: tokens before the continuation
    continuation_length: Positive
    dev_items: Positive  # per task
    eval_items: Positive | None  # per task; null: every item of the split the dev part leaves
    world: WorldConfig | None  # generated: the generator's settings; its counts come from the keys above
    tokenizer: str | None  # hub: the target's id or a local path
    tokenizer_revision: str | None
    corpus: HubDataset | None
    hellaswag: HubDataset | None
    piqa: HubDataset | None
    long: LongData | None  # hub: eval parts at the operating lengths (data/long/); null: none

    @model_validator(mode="after")
    def _consistent(self) -> DataParams:
        needed = ("world",) if self.kind == "generated" else ("tokenizer", "corpus", "hellaswag", "piqa")
        for name in needed:
            if getattr(self, name) is None:
                raise ParamError(f"data.{name}: required when data.kind is {self.kind!r}")
        if self.calibration_sequences < self.fit_sequences:
            raise ParamError(f"data.calibration_sequences: {self.calibration_sequences} is fewer than "
                             f"data.fit_sequences ({self.fit_sequences}); the pool continues the fit split")
        if self.long is not None and self.kind == "generated":
            raise ParamError("data.long: the operating lengths' parts are cut from real text (data.kind: hub); set "
                             "data.long: null for the generated world")
        if self.eval_items is None and self.kind == "generated":
            raise ParamError("data.eval_items: null (every item) needs real task data (data.kind: hub); "
                             "give the generated world a count")
        return self
