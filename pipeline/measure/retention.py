"""PROTOCOL's retention, (acc_variant - chance) / (acc_oracle - chance), which overstates what the handoff buys where
the source alone is far above chance; so the gap closure measures from the source (0: the source alone, 1: the oracle).
A variant's figure is the mean over tasks; intervals are paired bootstraps (items resampled per task, one draw)."""
from __future__ import annotations

from pipeline.measure.stats import mcnemar, paired_bootstrap
from pipeline.measure.tasks import CHANCE
from pipeline.store.lazy import lazy
from pipeline.store.splits import TASKS

np = lazy("numpy")
pd = lazy("pandas")


def gap_closure(acc_variant: float, acc_source: float, acc_oracle: float) -> float:
    if acc_oracle <= acc_source:
        return float("nan")
    return (acc_variant - acc_source) / (acc_oracle - acc_source)


def retention(acc_variant: float, acc_oracle: float, chance: float) -> float:
    return gap_closure(acc_variant, chance, acc_oracle)  # the gap from chance; NaN where the oracle is at chance


def mean_retention(acc: dict[str, float], oracle: dict[str, float]) -> float:
    return float(np.mean([retention(acc[t], oracle[t], CHANCE[t]) for t in TASKS]))


def mean_gap_closure(acc: dict[str, float], source: dict[str, float], oracle: dict[str, float]) -> float:
    return float(np.mean([gap_closure(acc[t], source[t], oracle[t]) for t in TASKS]))


def paired_items(items: dict[str, pd.DataFrame], a: str, b: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    left = items[a].set_index(["task", "item"])[metric]
    right = items[b].set_index(["task", "item"])[metric]
    joined = pd.concat([left.rename("a"), right.rename("b")], axis=1, join="inner")
    return joined.a.to_numpy(), joined.b.to_numpy()


def task_draws(items: dict[str, pd.DataFrame], variants: list[str], metric: str, iters: int, seed: int):
    """Per task: (task, each variant's `metric` per item, its means over `iters` resamples (iters,)), the same draw
    for every variant, on the items every variant scored (a study's first n beside an oracle's all: those n)."""
    rng = np.random.default_rng(seed)
    for task in TASKS:
        frames = {name: items[name][items[name].task == task].set_index("item")[metric] for name in variants}
        common = sorted(set.intersection(*(set(frame.index) for frame in frames.values())))
        values = {name: frame.loc[common].to_numpy() for name, frame in frames.items()}
        count = len(values[variants[0]])
        picks = rng.integers(0, count, size=(iters, count))
        yield task, values, {name: v[picks].mean(1) for name, v in values.items()}


def _interval(draws: np.ndarray) -> tuple[float, float]:
    low, high = np.nanpercentile(draws, [2.5, 97.5])
    return float(low), float(high)


def closure_interval(items: dict[str, pd.DataFrame], variant: str, metric: str, iters: int, seed: int,
                     from_source: bool = False) -> dict:
    """Retention (the gap closed from chance) or, `from_source`, the gap closure (from the source alone), with its
    interval; a draw where the oracle does not beat the baseline counts as undefined."""
    draws = np.zeros(iters)
    point = []
    names = [variant, "source", "oracle"] if from_source else [variant, "oracle"]
    for task, values, means in task_draws(items, names, metric, iters, seed):
        acc_v, acc_o = means[variant], means["oracle"]
        base, base_point = (means["source"], values["source"].mean()) if from_source else (CHANCE[task],) * 2
        with np.errstate(divide="ignore", invalid="ignore"):
            draws += np.where(acc_o > base, (acc_v - base) / (acc_o - base), np.nan) / len(TASKS)
        point.append(gap_closure(values[variant].mean(), base_point, values["oracle"].mean()))
    low, high = _interval(draws)
    return {"gap_closure" if from_source else "retention": float(np.mean(point)), "low": low, "high": high}


PROMPT_MEASURES = ("next_token_top1", "log_perplexity")  # per-prompt measures a gap closure can be read on


def prompt_gap_closure(prompts: dict[str, pd.DataFrame], variant: str, measure: str, iters: int, seed: int) -> dict:
    """Gap closure on next-token top-1 or the log-perplexity (tokens pooled, lower better), paired bootstrap over
    prompts; a draw where the oracle does not beat the source counts as undefined."""
    frames = {name: prompts[name].sort_values("prompt") for name in (variant, "source", "oracle")}
    if len({len(frame) for frame in frames.values()}) != 1:
        raise ValueError(f"{variant}, source and oracle were scored on different numbers of prompts")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(frames[variant]), size=(iters, len(frames[variant])))  # (iters, prompts)

    def measured(frame: pd.DataFrame, rows) -> np.ndarray:
        if measure == "next_token_top1":
            return frame.first_agree.to_numpy(float)[rows].mean(-1)
        return frame.nll.to_numpy(float)[rows].sum(-1) / frame.tokens.to_numpy(float)[rows].sum(-1)

    everything = np.arange(len(frames[variant]))
    point = {name: measured(frame, everything) for name, frame in frames.items()}
    draws = {name: measured(frame, picks) for name, frame in frames.items()}
    sign = 1.0 if measure == "next_token_top1" else -1.0  # higher top-1 is better, lower log-perplexity is
    with np.errstate(divide="ignore", invalid="ignore"):
        closure = np.where(sign * (draws["oracle"] - draws["source"]) > 0,
                           (draws[variant] - draws["source"]) / (draws["oracle"] - draws["source"]), np.nan)
    low, high = _interval(closure)
    return {"gap_closure": float((point[variant] - point["source"]) / (point["oracle"] - point["source"])),
            "low": low, "high": high}


def comparison(items, prompts, a: str, b: str, metric: str, iters: int, seed: int) -> dict:
    x, y = paired_items(items, a, b, metric)
    tasks = paired_bootstrap(x, y, iters, seed)
    pa, pb = prompts[a].sort_values("prompt"), prompts[b].sort_values("prompt")
    agreement = paired_bootstrap(pa.first_agree.to_numpy(), pb.first_agree.to_numpy(), iters, seed)
    return {"tasks_diff": tasks["diff"], "tasks_low": tasks["low"], "tasks_high": tasks["high"], "tasks_n": tasks["n"],
            "tasks_mcnemar_p": mcnemar(x, y), "next_token_diff": agreement["diff"], "next_token_low": agreement["low"],
            "next_token_high": agreement["high"], "next_token_n": agreement["n"],
            "next_token_mcnemar_p": mcnemar(pa.first_agree.to_numpy(), pb.first_agree.to_numpy())}
