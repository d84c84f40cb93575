"""One evaluation of a handoff (the eval prompts against the oracle's stored outputs, and lm-eval's tasks) and its
typed record. `Evaluation.figures()` is the JSON a stage writes: `{"prompts": {...}, "tasks": {"<task>": {...}}}`."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

from pipeline.kv.router import Router
from pipeline.measure.compare import FIRST_STEP_PARTS, Prompt, oracle_outputs, timed_oracle, timed_rows, variant_rows
from pipeline.measure.confident import confidence_summary
from pipeline.measure.prompt_metrics import PROMPT_METRICS, attention_layers, prompt_figures
from pipeline.measure.taskeval import evaluate_tasks
from pipeline.store.lazy import lazy
from pipeline.store.ranks import ONE_PROCESS, Ranks

pd = lazy("pandas")
adapter = lazy("pipeline.measure.adapter")  # lm-eval's model over a router: it imports lm-eval itself

TASK_METRICS = ("acc", "acc_norm")  # the task metrics per item kind
COUNTS = ("confident_prompts", "confident_prompt_share", "confident_positions", "confident_position_share")


class OracleStore(NamedTuple):
    top_k: int
    horizon: int
    attention: bool = False  # its attention outputs too (the select stage's cosine)


@dataclass
class TaskFigures:
    acc: float
    acc_norm: float
    acc_stderr: float
    acc_norm_stderr: float
    n: int
    kinds: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> {acc, acc_norm}


@dataclass
class PromptFigures:
    """Over the prompt rows: every measured `PROMPT_METRICS` entry, the counts beside them and, timed, the TTFT."""

    n: int  # prompts
    tokens: int  # scored continuation positions
    metrics: dict[str, float | None]  # PROMPT_METRICS name -> figure (None: undefined, e.g. no confident prompt)
    counts: dict[str, float | int | None]  # `COUNTS`: the confident prompts and positions, counts and shares
    attention_layers: list[float] | None = None  # per target layer, where the oracle's attention outputs were stored
    ttft: dict | None = None  # timed: median_ms, mean_ms and parts_ms (each part's median)

    @classmethod
    def of(cls, rows: pd.DataFrame, margin: float | None) -> PromptFigures:
        summary = {} if margin is None else confidence_summary(rows, margin)
        timed = None
        if "ttft_ms" in rows:
            timed = {"median_ms": float(rows.ttft_ms.median()), "mean_ms": float(rows.ttft_ms.mean()),
                     "parts_ms": {part: float(rows[f"{part}_ms"].median()) for part in FIRST_STEP_PARTS}}
        return cls(int(len(rows)), int(rows.tokens.sum()), prompt_figures(rows, margin),
                   {key: summary[key] for key in COUNTS if key in summary},
                   attention_layers(rows) if "attention_cosine" in rows else None, timed)

    def ratios(self, oracle: PromptFigures) -> dict[str, float]:
        return {metric.ratio: self.metrics[name] / oracle.metrics[name] for name, metric in PROMPT_METRICS.items()
                if metric.ratio and name in self.metrics}

    def as_json(self, oracle: PromptFigures | None = None) -> dict:
        out = {"n": self.n, "tokens": self.tokens, **self.metrics, **self.counts}
        if oracle is not None:
            out.update(self.ratios(oracle))
        if self.attention_layers is not None:
            out["attention_cosine_layers"] = self.attention_layers
        if self.ttft is not None:
            out["ttft"] = self.ttft
        return out


@dataclass
class Evaluation:
    """None, {}: what was not asked, or another rank's share."""

    prompts: PromptFigures | None
    tasks: dict[str, TaskFigures]
    prompt_rows: pd.DataFrame | None
    item_rows: pd.DataFrame | None
    oracle: dict | None = None  # the oracle's stored outputs, where this evaluation computed them

    def figures(self, digits: int = 6, oracle: Evaluation | None = None) -> dict:
        """With the `oracle`'s evaluation, the prompt figures compared as ratios too."""
        out: dict = {}
        if self.prompts is not None:
            out["prompts"] = self.prompts.as_json(None if oracle is None else oracle.prompts)
        if self.tasks:
            out["tasks"] = {task: dict(vars(figures)) for task, figures in self.tasks.items()}
        return rounded(out, digits)

    def write_rows(self, prompts: Path | None = None, items: Path | None = None) -> None:
        for path, rows in ((prompts, self.prompt_rows), (items, self.item_rows)):
            if path is not None and rows is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                rows.to_parquet(path, index=False)


def rounded(value, digits: int):
    if isinstance(value, dict):
        return {key: rounded(item, digits) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item, digits) for item in value]
    return round(value, digits) if isinstance(value, float) else value


def task_figures(summary: dict, items: pd.DataFrame) -> dict[str, TaskFigures]:
    out = {}
    for task, result in summary.items():
        marked = items[items.task == task].dropna(subset=["kind"])
        kinds = {kind: {metric: float(part[metric].mean()) for metric in TASK_METRICS}
                 for kind, part in marked.groupby("kind", sort=True)}
        out[task] = TaskFigures(**result, kinds=kinds)  # acc, acc_norm, their stderr and n (`evaluate_tasks`)
    return out


def evaluate(router: Router, prompts: Sequence[Prompt] = (), oracle: dict | None = None, *,
             margin: float | None = None, store: OracleStore | None = None, tasks: dict[str, Path] | None = None,
             tokenizer=None, timed: bool = False, warmup: int = 0, ranks: Ranks = ONE_PROCESS,
             raw_to: Path | None = None, progress: bool = True, task_limit: int | None = None) -> Evaluation:
    """`router`'s handoff on `prompts` against the `oracle`'s stored outputs (None: the router is the oracle's, its
    outputs computed as `store` says and returned) and on `tasks` (lm-eval's raw output to `raw_to`); `timed`: each
    prompt alone, after `warmup` untimed runs of the first. Under several `ranks`, rank 0 gets all."""
    prompts = list(prompts)
    if prompts and oracle is None and store is None:
        raise ValueError("evaluate: without the oracle's stored outputs, say how to store them (store=OracleStore)")
    if timed and ranks.size > 1:
        raise ValueError("evaluate: a timed evaluation runs in one process (several would share the machine's time)")
    if timed and ((store is not None and store.attention) or (oracle is not None and "attention" in oracle)):
        raise ValueError("evaluate: a timed evaluation reads no attention outputs; compare them untimed")
    rows = None
    if prompts and timed:
        if oracle is None:
            oracle, rows = timed_oracle(router, prompts, store.top_k, store.horizon, warmup, progress)
        else:
            rows = timed_rows(router, prompts, oracle, warmup, progress)
    elif prompts:
        if oracle is None:
            oracle = oracle_outputs(router.handoff, prompts, store.top_k, store.horizon, router.batch_size, progress,
                                    ranks, store.attention)
        rows = variant_rows(router.handoff, prompts, oracle, router.batch_size, progress, ranks)
    lm = adapter.HandoffLM(router, tokenizer, ranks=ranks) if tasks else None  # `tokenizer`: the target's
    summary, items = evaluate_tasks(lm, tasks, raw_to, task_limit) if tasks else ({}, None)
    figures = None if rows is None else PromptFigures.of(rows, margin)
    return Evaluation(figures, task_figures(summary, items) if summary else {}, rows, items,
                      oracle if store is not None else None)
