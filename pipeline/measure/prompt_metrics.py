"""The prompt metrics: every figure of a variant's per-prompt rows against the oracle, one entry each (a new metric is
one entry). A `ratio` figure compares across texts only as a ratio to the oracle's (perplexities of different texts
do not compare)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.measure.confident import confidence_summary
from pipeline.measure.retrieval import RECALL, recall_agreement
from pipeline.store.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")

FIDELITY, CONFIDENT = "fidelity", "confident"  # the groups


@dataclass(frozen=True)
class PromptMetric:
    name: str
    label: str  # how the report names it (a proxy's row: `<label> (select)`)
    higher: bool  # higher is better
    compute: Callable[[pd.DataFrame, float], float | None]  # (rows, confident margin) -> figure; None: undefined
    group: str = FIDELITY
    proxy: bool = False  # the candidates study correlates it, measured on the select split, with retention
    ratio: str | None = None  # compared across texts as figure / the oracle's, under this name
    needs: str | None = None  # a column the rows hold only sometimes: without it the metric is not measured

    def measured(self, rows: pd.DataFrame, margin: float | None) -> bool:
        return (self.needs is None or self.needs in rows) and (margin is not None or self.group != CONFIDENT)

    def better(self, value: float) -> float:
        return value if self.higher else -value


def attention_layers(rows: pd.DataFrame) -> list[float]:
    return (np.array(rows.attention_cosine.tolist()).sum(0) / rows.tokens.sum()).tolist()  # (L_t,)


def confident(name: str) -> Callable[[pd.DataFrame, float], float | None]:
    def compute(rows: pd.DataFrame, margin: float) -> float | None:
        return confidence_summary(rows, margin)[name]
    return compute


def recall(name: str) -> Callable[[pd.DataFrame, float], float | None]:
    def compute(rows: pd.DataFrame, _) -> float | None:
        return recall_agreement(rows.agree_by_position, rows[RECALL])[name]
    return compute


ENTRIES = (
    PromptMetric("perplexity", "perplexity", False, lambda rows, _: float(np.exp(rows.nll.sum() / rows.tokens.sum())),
                 ratio="ppl_ratio"),
    PromptMetric("next_token_top1", "next-token top-1", True, lambda rows, _: float(rows.first_agree.mean())),
    PromptMetric("attention_cosine", "attention-output cosine", True,
                 lambda rows, _: float(np.mean(attention_layers(rows))), proxy=True,
                 needs="attention_cosine"),
    PromptMetric("agreement", "agreement", True, lambda rows, _: float(rows.agree.sum() / rows.tokens.sum()),
                 proxy=True),
    PromptMetric("mean_kl", "mean KL", False, lambda rows, _: float(rows.kl.sum() / rows.tokens.sum()), proxy=True),
    PromptMetric("rollout_agreement", "rollout agreement", True,
                 lambda rows, _: float(rows.rollout_agree.sum() / rows.horizon.sum())),
    PromptMetric("confident_top1", "confident-prompt top-1", True, confident("confident_top1"), CONFIDENT, True),
    PromptMetric("confident_agreement", "confident-position agreement", True, confident("confident_agreement"),
                 CONFIDENT, True),
    PromptMetric("oracle_weighted_agreement", "oracle-weighted agreement", True,
                 confident("oracle_weighted_agreement"), CONFIDENT, True),
    PromptMetric("recall_agreement", "agreement on recall positions", True, recall("recall_agreement"), needs=RECALL),
    PromptMetric("other_agreement", "agreement on the other positions", True, recall("other_agreement"),
                 needs=RECALL),
)
PROMPT_METRICS: dict[str, PromptMetric] = {metric.name: metric for metric in ENTRIES}


def in_group(group: str) -> list[PromptMetric]:
    return [metric for metric in PROMPT_METRICS.values() if metric.group == group]


def prompt_figures(rows: pd.DataFrame, margin: float | None) -> dict[str, float | None]:
    """Every metric the rows measure, by name (None: undefined on them, e.g. no confident prompt)."""
    return {name: metric.compute(rows, margin) for name, metric in PROMPT_METRICS.items()
            if metric.measured(rows, margin)}
