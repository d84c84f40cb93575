"""A fitted map distilled through the frozen target (PROTOCOL.md, "Distilled map"): trained on what the target does
after the handoff, not on key and value closeness. A batch holds rows of one prefix length (last-token protocol):

    source's content cache of c[0..n-2] -> map per target layer -> target RoPE at 0..P-1 -> target dtype (`map_cache`)
    target: mapped cache + c[n-1] e[0..h-1]   -> log p_mapped at the h + 1 positions it reads
    target: own cache of c[0..n-2] + the same -> log p_oracle (`extract`'s stored cache; no grad)
    loss = mean over positions of KL(p_oracle || p_mapped)
           + kv_weight * mean over target layers and kinds of MSE(mapped, own content) / variance(own content)

Both models stay frozen. Bit-identical given the seed and the thread count on one CPU device (on CUDA,
CUBLAS_WORKSPACE_CONFIG must be set before torch starts); the `Clock`'s timings never change the map's bytes.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from typing import Annotated, Iterator, NamedTuple, Sequence

from pydantic import Field
from tqdm.auto import tqdm

from pipeline.fitting.distill_rows import Batch, Oracle, Rows, Splits, StoredOracle, in_order, oracle, widened
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import Layers
from pipeline.kv.mapper import Mapper, map_cache
from pipeline.kv.rope import Rotation
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy
from pipeline.store.params import Params, Positive, PositiveFloat

torch = lazy("torch")
F = lazy("torch.nn.functional")

class DistillSettings(Params):
    """The `distill` section's training keys (`schema.distill.DistillParams` adds which maps and which rows)."""

    # AdamW's learning rates per map family (linear, head_matched, mlp, ...), each probed with every kv_weight
    lrs: dict[str, Annotated[list[PositiveFloat], Field(min_length=1)]]
    probe_steps: Positive  # optimizer steps of each probe, scored on the select rows
    weight_decay: Annotated[float, Field(ge=0)]  # AdamW's decoupled decay, towards zero (not towards the start map)
    # weights of the key/value regression beside the KL (0: the KL alone); the (rate, weight) pair of the lowest
    # select KL after its probe trains the full run (one pair in all: taken as it is, no probe)
    kv_weights: Annotated[list[Annotated[float, Field(ge=0)]], Field(min_length=1)]
    batch_size: Positive  # rows per optimizer step, and per forward when the select rows are scored
    epochs: Positive  # at most; fewer when the select KL stops falling
    patience: Positive  # epochs without a new lowest select KL before training stops
    seed: int

    def pairs(self, family: str) -> list[tuple[float, float]]:
        """The (rate, kv_weight) pairs the probes try, in the order a tie goes by: rates, then weights, as declared."""
        return [(lr, kv_weight) for lr in self.lrs[family] for kv_weight in self.kv_weights]


# the parts of the work timed; rows: reading the stored source caches
TIMED_PARTS = ("oracle", "rows", "mapped_step", "map_update", "select_scoring")


class Clock:
    """Seconds per part of the work, summed over calls; on CUDA each part waits for the device."""

    def __init__(self):
        self.seconds: Counter = Counter({part: 0.0 for part in TIMED_PARTS})

    @contextmanager
    def timed(self, part: str, device) -> Iterator[None]:
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        sync()
        began = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.seconds[part] += time.perf_counter() - began


class Losses(NamedTuple):
    total: torch.Tensor  # () the objective
    kl: torch.Tensor  # (B, h + 1) KL(oracle || mapped) per position
    kv: torch.Tensor  # () the normalised regression (0 when its weight is 0)
    agrees: torch.Tensor  # (B,) whether the mapped and the oracle argmax agree at the handoff position


def trainable(start: Mapper, device) -> Mapper:
    """A copy of `start` whose tensors are leaf parameters on `device`, float32 (float64 for a float64 start)."""
    if start.key_space == "rotated":
        raise ValueError("the start map reads and writes rotated keys (the no-strip ablation); distillation starts "
                         "from a content-space map")
    dtype = torch.promote_types(start.keys[0][0].dtype, torch.float32)
    keys, values = ([tuple(torch.nn.Parameter(t.detach().to(device, dtype).clone()) for t in tensors)
                     for tensors in layers] for layers in (start.keys, start.values))
    return replace(start, keys=keys, values=values, extra=dict(start.extra))


def map_tensors(mapper: Mapper) -> list[torch.Tensor]:
    """The map's tensors in one fixed order: keys then values, layer by layer, the family's tensor order within."""
    return [t for tensors in mapper.keys + mapper.values for t in tensors]


def kv_regression(mapped: Layers, own: Layers) -> torch.Tensor:
    """Mean over target layers and kinds of MSE(mapped, own) / variance(own), the variance centred per head and
    dimension over rows and tokens: one minus the pooled R², so each layer and kind weighs alike at any scale."""
    terms = []
    for mapped_pair, own_pair in zip(mapped, own, strict=True):
        for mapped_kind, own_kind in zip(mapped_pair, own_pair):
            own_kind = widened(own_kind)  # (B, H_t, P, D_t)
            variance = (own_kind - own_kind.mean(dim=(0, 2), keepdim=True)).pow(2).mean()
            terms.append((mapped_kind - own_kind).pow(2).mean() / variance)
    return torch.stack(terms).mean()


def losses(mapper: Mapper, batch: Batch, handoff: Handoff, kv_weight: float, reference: Oracle | None = None
           ) -> Losses:
    """Differentiable in the map's tensors, which must sit on the target's device. `reference` None: the oracle is
    computed here."""
    reference = oracle(handoff, batch) if reference is None else reference
    rotation = Rotation(handoff.decoder_spec, torch.arange(batch.prefix.shape[1], device=handoff.device))
    source = [(k.to(handoff.device), v.to(handoff.device)) for k, v in batch.source]
    layers = list(map_cache(mapper, source, rotation, handoff.decoder.dtype, handoff.device))  # what the handoff maps
    content, cache = [mapped for mapped, _ in layers], [cached for _, cached in layers]
    logprobs = F.log_softmax(widened(handoff.step_logits(cache, batch.steps)), dim=-1)  # (B, h + 1, V)
    kl = F.kl_div(logprobs, reference.logprobs, reduction="none", log_target=True).sum(-1)  # (B, h + 1)
    kv = kv_regression(content, reference.content) if kv_weight else torch.zeros((), device=kl.device)
    agrees = logprobs[:, 0].argmax(-1) == reference.logprobs[:, 0].argmax(-1)  # (B,)
    return Losses(kl.mean() + kv_weight * kv, kl, kv, agrees)


def reference_of(rows: Rows, chosen: list[int], handoff: Handoff, clock: Clock) -> Oracle:
    if isinstance(rows, StoredOracle):
        return rows.oracle(chosen)
    with clock.timed("oracle", handoff.device):
        return oracle(handoff, rows.take(chosen))


@no_grad
def evaluate(mapper: Mapper, groups: Sequence[Rows], handoff: Handoff, batch: int, clock: Clock | None = None
             ) -> dict:
    """Mean KL(oracle || mapped) over every position of every group's rows, and the share of rows whose argmax at
    the handoff position is the oracle's (V0's next-token agreement)."""
    clock = clock or Clock()
    kl_sum, positions, agreeing = 0.0, 0, 0
    for rows in groups:
        for chosen in in_order(len(rows), batch):
            reference = reference_of(rows, chosen, handoff, clock)
            with clock.timed("select_scoring", handoff.device):
                scored = losses(mapper, rows.take(chosen), handoff, 0.0, reference)
            kl_sum, positions = kl_sum + float(scored.kl.sum()), positions + scored.kl.numel()
            agreeing += int(scored.agrees.sum())
    return {"kl": kl_sum / positions, "agreement": agreeing / sum(len(rows) for rows in groups)}


def epoch_batches(groups: Sequence[Rows], batch: int, generator: torch.Generator) -> list[tuple[int, list[int]]]:
    """(group, rows) batches: each group's rows shuffled and cut, then all batches shuffled (one length a batch)."""
    batches = []
    for group, rows in enumerate(groups):
        order = torch.randperm(len(rows), generator=generator).tolist()
        batches += [(group, order[first : first + batch]) for first in range(0, len(order), batch)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def check_frozen(target) -> None:
    trainable_names = [name for name, p in target.named_parameters() if p.requires_grad]
    if trainable_names:
        raise ValueError(f"the target must be frozen for distillation, but {len(trainable_names)} of its parameters "
                         f"require grad (first: {trainable_names[0]}); call target.requires_grad_(False)")
    if target.training:
        raise ValueError("the target is in training mode (dropout would make the oracle random); call target.eval()")


@contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Deterministic algorithms and a seeded global generator inside; the caller's settings restored after."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def tensors_digest(mapper: Mapper) -> str:
    """sha256 over the map's tensors (dtype, shape, bytes, in `map_tensors` order): names the start map."""
    hasher = hashlib.sha256()
    for tensor in map_tensors(mapper):
        tensor = tensor.detach().cpu().contiguous()
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def fit_steps(mapper: Mapper, optimizer, groups: Sequence[Rows], order: list[tuple[int, list[int]]],
              handoff: Handoff, kv_weight: float, clock: Clock, bar) -> dict:
    """One optimizer step per batch of `order`; the mean fit losses."""
    totals = {"fit_loss": 0.0, "fit_kl": 0.0, "fit_kv": 0.0}
    for group, chosen in order:
        reference = reference_of(groups[group], chosen, handoff, clock)
        with clock.timed("rows", handoff.device):
            batch = groups[group].take(chosen)
        with clock.timed("mapped_step", handoff.device):
            step = losses(mapper, batch, handoff, kv_weight, reference)
            step.total.backward()
        with clock.timed("map_update", handoff.device):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for name, value in (("fit_loss", step.total), ("fit_kl", step.kl.mean()), ("fit_kv", step.kv)):
            totals[name] += float(value.detach())
        bar.update(len(chosen))
    bar.close()
    return {name: value / len(order) for name, value in totals.items()}


def fresh(start: Mapper, handoff: Handoff, settings: DistillSettings, lr: float):
    """A trainable copy of `start`, its AdamW, and the row order's generator (on the CPU whatever the device): every
    run from the start sees the same rows in the same order."""
    mapper = trainable(start, handoff.device)
    optimizer = torch.optim.AdamW(map_tensors(mapper), lr=lr, weight_decay=settings.weight_decay)
    return mapper, optimizer, torch.Generator().manual_seed(settings.seed)


def probe(start: Mapper, batches: Splits, handoff: Handoff, settings: DistillSettings, lr: float, kv_weight: float,
          clock: Clock, label: str | None) -> float:
    """The select KL after `settings.probe_steps` steps from `start`: the full run's first steps at that pair."""
    mapper, optimizer, generator = fresh(start, handoff, settings, lr)
    order = []
    while len(order) < settings.probe_steps:
        order += epoch_batches(batches.fit, settings.batch_size, generator)
    order = order[: settings.probe_steps]
    bar = tqdm(total=sum(len(rows) for _, rows in order), desc=f"{label} probe lr={lr:g} kv_weight={kv_weight:g}",
               unit="row", leave=False, disable=label is None)
    fit_steps(mapper, optimizer, batches.fit, order, handoff, kv_weight, clock, bar)
    return evaluate(mapper, batches.select, handoff, settings.batch_size, clock)["kl"]


def chosen_pair(probes: list[dict]) -> tuple[float, float]:
    """The (rate, kv_weight) of the probe of the lowest select KL (the first tried on a tie; a diverged, NaN probe
    never wins)."""
    best = min(probes, key=lambda row: math.inf if math.isnan(row["select_kl"]) else row["select_kl"])
    return best["lr"], best["kv_weight"]


def probe_facts(probes: list[dict], settings: DistillSettings) -> dict:
    """The probes as a map's facts record them. With one kv_weight declared, every probe used the facts' own
    `kv_weight` and the record is the one written before the weight was a grid (rate and select KL per probe), so
    those maps keep their bytes; with several, each probe names its weight and the grid is kept."""
    if len(settings.kv_weights) == 1:
        return {"probes": [{"lr": row["lr"], "select_kl": row["select_kl"]} for row in probes]}
    return {"kv_weights": list(settings.kv_weights), "probes": probes}


def distill(start: Mapper, batches: Splits, handoff: Handoff, settings: DistillSettings, clock: Clock | None = None,
            label: str | None = None) -> tuple[Mapper, list[dict]]:
    """Train a copy of `start` at the (rate, kv_weight) pair whose probe scores the lowest select KL; keep the epoch
    (0: the start itself) of the lowest select KL. Returns the map, on the CPU in the start's dtype, and per epoch its
    fit losses, select KL and agreement. `label` names the map on the progress bars (None: no bars)."""
    check_frozen(handoff.decoder)
    counts = [sum(len(rows) for rows in groups) for groups in batches]
    if not all(counts):
        raise ValueError(f"distillation needs fit and select rows, got {counts[0]} and {counts[1]}")
    clock = clock or Clock()
    with deterministic(settings.seed):
        pairs = settings.pairs(start.family)
        probes = [{"lr": lr, "kv_weight": kv_weight,
                   "select_kl": probe(start, batches, handoff, settings, lr, kv_weight, clock, label)}
                  for lr, kv_weight in pairs] if len(pairs) > 1 else []
        lr, kv_weight = chosen_pair(probes) if probes else pairs[0]
        mapper, optimizer, generator = fresh(start, handoff, settings, lr)
        parameters = map_tensors(mapper)
        scored = evaluate(mapper, batches.select, handoff, settings.batch_size, clock)
        history = [{"epoch": 0, "select_kl": scored["kl"], "select_agreement": scored["agreement"]}]
        best_kl, best_epoch, best = scored["kl"], 0, [p.detach().clone() for p in parameters]
        steps = 0
        for epoch in range(1, settings.epochs + 1):
            order = epoch_batches(batches.fit, settings.batch_size, generator)
            bar = tqdm(total=sum(len(rows) for _, rows in order), desc=f"{label} epoch {epoch}/{settings.epochs}",
                       unit="row", leave=False, disable=label is None, postfix={"select_kl": f"{scored['kl']:.4g}"})
            fitted = fit_steps(mapper, optimizer, batches.fit, order, handoff, kv_weight, clock, bar)
            steps += len(order)
            scored = evaluate(mapper, batches.select, handoff, settings.batch_size, clock)
            history.append({"epoch": epoch, **fitted, "select_kl": scored["kl"],
                            "select_agreement": scored["agreement"]})
            if scored["kl"] < best_kl:
                best_kl, best_epoch, best = scored["kl"], epoch, [p.detach().clone() for p in parameters]
            elif epoch - best_epoch >= settings.patience:
                break
    facts = {"start": {"family": start.family, "k": start.k, "lambda": start.ridge_lambda,
                       "tensors_sha256": tensors_digest(start)},
             "kl_weight": 1.0, "kv_weight": kv_weight, "lr": lr, "lrs": list(settings.lrs[start.family]),
             "probe_steps": settings.probe_steps if probes else 0, **probe_facts(probes, settings),
             "weight_decay": settings.weight_decay, "batch": settings.batch_size, "seed": settings.seed, "steps": steps,
             "epochs": history[-1]["epoch"], "best_epoch": best_epoch, "select_kl_start": history[0]["select_kl"],
             "select_kl": best_kl}
    return finished(start, best, facts), history


def finished(start: Mapper, tensors: list[torch.Tensor], facts: dict) -> Mapper:
    """`start` with `tensors` (in `map_tensors` order), on the CPU in its dtype, and `facts` as its record."""
    flat = iter(t.detach().to("cpu", start.keys[0][0].dtype).contiguous() for t in tensors)
    keys, values = ([tuple(next(flat) for _ in layer_tensors) for layer_tensors in layers]
                    for layers in (start.keys, start.values))
    return replace(start, keys=keys, values=values, distilled=facts)
