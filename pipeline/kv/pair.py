"""The mapped pair: source and target, their tokenizers and contract read at once (a refused pair or mode costs no
weight loading), each model loaded once on first use, and every handoff between them. A map is bound to the pair it
was fitted on unless allowed (models in memory leave maps unchecked).
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pipeline.kv.contract import pair_contract
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import Mapper, check_map_geometry, load_mapper
from pipeline.kv.modes import MAPPER_MODES, MODES
from pipeline.kv.repair import Repair
from pipeline.kv.router import Router
from pipeline.kv.speculative import SpeculativeParams
from pipeline.store import paths
from pipeline.store.cli import Refusal
from pipeline.store.fingerprints import PairFingerprints, model_differences
from pipeline.store.models import ModelsParams, load_config, load_model, load_tokenizer, require_weights, self_source
from pipeline.store.splits import TASKS
from pipeline.store.truncated import truncate

OVERRIDE = "allow_other_models=true (kv-transfer) or --allow-other-models (generate, check_pair)"


class OtherModelsError(Refusal, ValueError):
    """A map used with models it was not fitted on (or one that records none)."""


def check_models(label: str, fitted: dict | None, loaded: PairFingerprints, allow: bool) -> str | None:
    """Refuse a map whose models differ from the loaded ones; with `allow`, return the difference (or None)."""
    difference = model_differences(fitted, loaded)
    if difference is None or allow:
        return difference and f"{label} {difference}"
    fix = "refit it (dvc repro)" if fitted is None else "refit it on these models (dvc repro)"
    raise OtherModelsError(f"map {label} {difference}; {fix}, or pass {OVERRIDE} to use it anyway")


def positions(*configs) -> int:
    """The longest sequence every model of the pair has positions for."""
    return min(config.max_position_embeddings for config in configs if config is not None)


class Pair:
    """A target and (optionally) a source: names, tokenizers and contract now, weights on first use."""

    def __init__(self, target: str, source: str | None = None, dtype: str = "float32", device: str | None = None,
                 device_map: str | None = None, target_revision: str | None = None,
                 source_revision: str | None = None, max_tokens: int | None = None,
                 allow_other_models: bool = False):
        """`max_tokens`: the longest sequence a handoff will see (a shorter sliding window is refused now);
        `allow_other_models`: a map fitted on other models is used (its difference kept in `other_models`)."""
        self.allow_other_models, self.other_models = allow_other_models, []
        self.sides = {"target": (target, target_revision), "source": (source, source_revision)}  # name, revision
        self.dtype, self.device, self.device_map = dtype, device, device_map
        self.target_tokenizer = load_tokenizer(target, target_revision)
        beside = {"target": target, "target_revision": target_revision}  # what a self source is cut from
        self.source_tokenizer = load_tokenizer(source, source_revision, **beside) if source else None
        cut = self_source(source, **beside) if source else None
        self.self_layers = cut[0] if cut else None  # n of a self source, else None
        require_weights(target, target_revision)  # a folder without complete weights: one line now, not at load
        if source:
            require_weights(source, source_revision, **beside)
        configs = (load_config(target, target_revision),
                   load_config(source, source_revision, **beside) if source else None)
        self.contract = pair_contract(*configs, self.target_tokenizer, self.source_tokenizer, max_tokens)
        self.positions = positions(*configs)
        self.configs = configs[::-1]  # (source, target): what `bound_pair: loaded` counts the FLOP bounds at

    @classmethod
    def load(cls, models: ModelsParams, device: str, dtype: str | None = None, max_tokens: int | None = None,
             source: bool = True, allow_other_models: bool = False) -> "Pair":
        """The pipeline's pair (models/target, models/source); `source` False: the target alone."""
        return cls(str(paths.model("target")), str(paths.model("source")) if source else None,
                   dtype or models.dtype, device, models.device_map, max_tokens=max_tokens,
                   allow_other_models=allow_other_models)

    @classmethod
    def of(cls, target, source=None, max_tokens: int | None = None) -> "Pair":
        """A pair of models already loaded (no tokenizers: the contract compares what the configs say)."""
        pair = cls.__new__(cls)
        pair.sides = {"target": (target.config._name_or_path, None),
                      "source": (None if source is None else source.config._name_or_path, None)}
        pair.dtype, pair.device, pair.device_map = target.dtype, target.device, None
        pair.allow_other_models, pair.other_models = False, []
        pair.__dict__["fingerprints"] = None  # models in memory: no files to fingerprint
        pair.target_tokenizer = pair.source_tokenizer = None
        configs = (target.config, None if source is None else source.config)
        pair.contract = pair_contract(*configs, max_tokens=max_tokens)
        pair.positions = positions(*configs)
        pair.configs = configs[::-1]
        pair.__dict__["target"] = target  # the cached properties, filled
        if source is not None:
            pair.__dict__["source"] = source
        return pair

    @property
    def eval_tasks(self) -> dict[str, Path]:
        return {task: paths.task_items(task, "eval") for task in TASKS}

    @property
    def has_source(self) -> bool:
        return self.sides["source"][0] is not None

    @cached_property
    def fingerprints(self) -> PairFingerprints | None:
        """Both models' fingerprints, hashed when the first map is bound."""
        (source, source_revision), (target, target_revision) = self.sides["source"], self.sides["target"]
        return PairFingerprints(source, target, source_revision, target_revision)

    def bind(self, mapper: Mapper, label: str) -> None:
        """Refuse `mapper` unless fitted on this pair's models or the pair allows others."""
        if self.fingerprints is None:
            return
        difference = check_models(label, mapper.models, self.fingerprints, self.allow_other_models)
        if difference and difference not in self.other_models:
            self.other_models.append(difference)

    def _load(self, side: str):
        name, revision = self.sides[side]
        return load_model(name, revision, dtype=self.dtype, device=self.device, device_map=self.device_map)

    @cached_property
    def target(self):
        return self._load("target")

    @cached_property
    def source(self):
        if self.self_layers is not None:  # the target's own first layers, sharing its weights
            return truncate(self.target, self.self_layers)
        return self._load("source")

    def handoff(self, mode: str = "oracle", mapper: Mapper | str | Path | None = None,
                shuffle_seed: int = 0, repair: Repair = Repair(), keep: float | None = None,
                share: float | None = None, speculative: SpeculativeParams | None = None) -> Handoff:
        """The handoff of `mode`, refused before any weight loads where the contract leaves it undefined; `mapper` a
        fitted map or its file (ignored by modes that read none)."""
        self.contract.require(mode)
        if not MODES[mode].reads.target:  # the source decodes alone: the handoff's decoder
            return Handoff(self.source, mode=mode, keep=keep)
        if mode not in MAPPER_MODES:
            mapper = None
        elif isinstance(mapper, (str, Path)):
            label = str(mapper)
            mapper = load_mapper(mapper, device=self.device)
            self.bind(mapper, label)
        else:
            self.bind(mapper, f"{mapper.family} k={mapper.k}")
        if mapper is not None:
            (source, _), (target, _) = self.sides["source"], self.sides["target"]
            check_map_geometry(mapper, *self.configs, f"source {source!r} and target {target!r}")
        return Handoff(self.target, self.source if MODES[mode].reads.source else None, mode, mapper,
                       shuffle_seed=shuffle_seed, repair=repair, keep=keep, share=share, speculative=speculative)

    def router(self, mode: str, mapper: Mapper | str | Path | None = None, repair: Repair = Repair(),
               keep: float | None = None, share: float | None = None, speculative: SpeculativeParams | None = None,
               shuffle_seed: int = 0, batch_size: int = 16) -> Router:
        """The router of a handoff from values checked where they entered."""
        return Router(self.handoff(mode, mapper, shuffle_seed, repair, keep, share, speculative), batch_size)
