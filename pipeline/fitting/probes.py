"""Single-layer ridge probes: which source layers predict each target layer's cache, scored (R², per kind) on a
seeded share of the fit sequences held out. One pass over the shards serves a group of target layers for all source
layers, the group sized so the float64 accumulators fit a byte budget; X^T X is computed in the first pass only."""
from __future__ import annotations

from tqdm.auto import tqdm

from pipeline.fitting import ridge
from pipeline.store.cachefiles import KINDS, Shard
from pipeline.store.lazy import lazy
from pipeline.store.ranks import ONE_PROCESS, Ranks

torch = lazy("torch")

Pairs = list[tuple[Shard, Shard]]


def holdout_sequences(pairs: Pairs, fraction: float, seed: int) -> set[str]:
    """doc_ids of a seeded share of the split's sequences (at least one, never all)."""
    doc_ids = [doc for source, _ in pairs for doc in source.doc_ids]
    if len(doc_ids) < 2:
        raise ValueError(f"the fit split has {len(doc_ids)} sequence(s); holding out whole sequences needs 2 or more")
    count = min(len(doc_ids) - 1, max(1, round(fraction * len(doc_ids))))
    order = torch.randperm(len(doc_ids), generator=torch.Generator().manual_seed(seed))
    return {doc_ids[i] for i in order[:count].tolist()}


def held_rows(shard: Shard, held: set[str]) -> torch.Tensor:
    """(tokens,) bool: rows of the shard's sequences that are in `held`."""
    flags = torch.tensor([doc in held for doc in shard.doc_ids])
    return flags.repeat_interleave(torch.tensor(shard.lengths))


def probe_r2(pairs: Pairs, held: set[str], source_layers: int, target_layers: int, width_s: int, width_t: int,
             ridge_lambda: float, budget_bytes: float, device: str | torch.device,
             ranks: Ranks = ONE_PROCESS, rows_budget_bytes: float = 0) -> dict[str, torch.Tensor]:
    """Held-out R² per kind (target_layers, source_layers), on the CPU. When the source's rows of the split fit
    `rows_budget_bytes` (in their storage dtype) they are read once for every pass. Under several processes each takes
    every N-th group of target layers and every process gets the whole table."""
    # per pass: 2 kinds x (train, held) x source_layers x (X^T X + X^T Y over the group's target columns)
    fixed, per_target = 8 * 4 * source_layers * width_s * width_s, 8 * 4 * source_layers * width_s * width_t
    group = max(1, min(target_layers, int((budget_bytes - fixed) // per_target)))
    scores = {kind: torch.zeros(target_layers, source_layers, dtype=torch.float64) for kind in KINDS}
    held_count = sum(int(held_rows(source, held).sum()) for source, _ in pairs)
    train_count = sum(source.tokens for source, _ in pairs) - held_count
    inputs: dict[tuple, ridge.Moments] = {}  # per (kind, source layer): n, sum_x and X^T X, from the first pass
    held_inputs: dict[tuple, ridge.Moments] = {}  # the same for the held-out rows
    groups = [list(range(target_layers))[i : i + group] for i in range(0, target_layers, group)]
    mine = [groups[i] for i in ranks.share(len(groups))]
    kept = {}  # (shard index, kind) -> the source's stored rows of every layer, when they fit the budget
    if len(mine) > 1 and stored_bytes(pairs, source_layers, width_s) <= rows_budget_bytes:
        kept = {(i, kind): source.read(kind, list(range(source_layers)), stored=True)
                for i, (source, _) in enumerate(pairs) for kind in KINDS}
    for targets in tqdm(mine, desc="probe passes", unit="pass", disable=not ranks.main):
        out_width = len(targets) * width_t
        first = not inputs
        train, held_out = ({(kind, p): ridge.summary(count, width_s, out_width, device)
                            for kind in KINDS for p in range(source_layers)} for count in (train_count, held_count))
        for index, (source, target) in enumerate(pairs):
            mask = held_rows(source, held)
            for kind in KINDS:
                y = torch.cat(target.read(kind, targets), dim=1)  # (tokens, G * Ht*Dt)
                for p in range(source_layers):
                    # (tokens, Hs*Ds): kept from the first read, or read once per pass
                    x = kept[index, kind][p].float() if kept else source.read(kind, [p])[0]
                    train[kind, p].update(x[~mask], y[~mask], inputs=first)
                    held_out[kind, p].update(x[mask], y[mask], inputs=first)
        if first:  # X^T X of a source layer does not depend on the target group: computed once per run
            inputs, held_inputs = train, held_out
        train = {key: m.with_inputs_of(inputs[key]) for key, m in train.items()}
        held_out = {key: m.with_inputs_of(held_inputs[key]) for key, m in held_out.items()}
        for kind in KINDS:
            for p in range(source_layers):
                weight, bias = ridge.solve(train[kind, p], ridge_lambda)
                held_m = held_out[kind, p]
                r2 = ridge.pooled_r2(ridge.residual_ss(held_m, weight, bias), ridge.total_ss(held_m),
                                     len(targets))
                scores[kind][targets, p] = r2.cpu()
        del train, held_out
    if ranks.size > 1:  # each group's rows come from the rank that computed it
        parts = ranks.all_gather({kind: scores[kind] for kind in KINDS})
        for index, targets in enumerate(groups):
            for kind in KINDS:
                scores[kind][targets] = parts[index % ranks.size][kind][targets]
    return scores


def stored_bytes(pairs: Pairs, source_layers: int, width_s: int) -> int:
    """Bytes of the source's rows of the split (keys and values, every layer) in their storage dtype."""
    itemsize = pairs[0][0].stored_itemsize if pairs else 0
    return sum(source.tokens for source, _ in pairs) * width_s * source_layers * len(KINDS) * itemsize


def ranking(scores: dict[str, torch.Tensor]) -> list[list[int]]:
    """Per target layer, source layers from best to worst probe (mean of key and value R²; ties to lower index)."""
    mean = sum(scores.values()) / len(scores)  # (L_t, L_s)
    return [torch.sort(-row, stable=True).indices.tolist() for row in mean]
