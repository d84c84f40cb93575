"""Stage `check_params`: the whole of params.yaml validated before any other stage does any work.

Each section is parsed by its stage's Params class, unknown keys refused, then `PARAMS_RULES` run between sections.
Writes metrics/params_check.json (the sections checked: bytes independent of the values, so later stages rerun only for
the params they read) and metrics/dtypes.json (`auto` resolved here, with its timings).
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import model_validator

from pipeline.kv.mapnames import MapName
from pipeline.kv.repair import Repair
from pipeline.kv.speculative import SpeculativeParams
from pipeline.measure.settings import MeasureParams
from pipeline.schema.calibrate import CalibrationParams
from pipeline.schema.candidates import CandidatesParams
from pipeline.schema.controls import ControlsParams, ToleranceParams
from pipeline.schema.convert_models import ConvertParams
from pipeline.schema.distill import DistillParams
from pipeline.schema.evaluate import SELECTED, EvaluateParams
from pipeline.schema.extract import ExtractParams
from pipeline.schema.fit import FitParams
from pipeline.schema.latency import LatencyParams
from pipeline.schema.length import LengthParams
from pipeline.schema.operating import OperatingParams
from pipeline.schema.prepare_data import DataParams
from pipeline.schema.prepare_models import TrainParams
from pipeline.schema.repair import RepairParams
from pipeline.schema.score_models import ScoreModelsParams
from pipeline.schema.select import SelectParams
from pipeline.store import paths
from pipeline.store.artifacts import write_json_atomic
from pipeline.store.cli import Refusal, entry, no_arguments
from pipeline.store.devices import cpu_matmul_ms, machine_dtype
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams, load_config, load_tokenizer
from pipeline.store.params import PARAMS_FILE, ParamError, Params, parse, read_params
from pipeline.store.shapes import shape_config
from pipeline.studies.settings import ReportParams

PLAIN = {"profile": str}  # top-level values that are not sections
MODEL_DTYPES = ("models", "extract", "latency")  # the sections whose `dtype` the models run in or store
AUTO_DTYPES = ("models", "latency")  # those that may say `auto`


class ParamsFile(Params):
    profile: str
    machine: MachineParams
    measure: MeasureParams
    data: DataParams
    convert: ConvertParams
    models: ModelsParams
    train: TrainParams
    score_models: ScoreModelsParams
    extract: ExtractParams
    fit: FitParams
    distill: DistillParams
    select: SelectParams
    controls: ControlsParams
    evaluate: EvaluateParams
    candidates: CandidatesParams
    repair: RepairParams
    speculative: SpeculativeParams  # read by the faces (kv.request), no stage yet
    calibration: CalibrationParams
    report: ReportParams
    length: LengthParams
    operating: OperatingParams
    latency: LatencyParams
    tolerances: ToleranceParams

    @model_validator(mode="after")
    def _rules_between_sections(self) -> ParamsFile:
        for rule in PARAMS_RULES:
            rule(self)
        return self


def trained_pair_is_declared(params: ParamsFile) -> None:
    train, models = params.train, params.models
    if models.kind == "trained" and (train.target is None or (train.source is None and not models.self_layers)):
        raise ParamError("train.source and train.target: required when models.kind is 'trained' (train.target "
                         "alone when models.source is self:<n>)")


def named_config(params: ParamsFile, side: str):
    """A hub-kind side's config where readable without weights: `convert.<side>.shape` until convert_models wrote
    it, a local folder's config.json; None for a hub id or a folder lacking one (pin_models refuses it)."""
    name = getattr(params.models, side)
    spec = next((getattr(params.convert, s) for s, path in paths.CONVERTED_SIDES.items() if Path(name) == path), None)
    if spec is not None and not Path(name, "config.json").is_file():
        return shape_config(spec.shape)
    try:
        return load_config(name) if Path(name).is_dir() else None
    except Refusal:
        return None


def depth_of(params: ParamsFile, side: str, positions: bool = False) -> int | None:
    """A side's decoder layers (`positions`: its positions) where params alone tell it; None for a hub model, known
    once its config is fetched."""
    if side == "source" and params.models.self_layers and not positions:
        return params.models.self_layers
    if params.models.kind == "trained":
        train = getattr(params.train, side)
        return train.max_positions if positions else train.layers
    name = "max_position_embeddings" if positions else "num_hidden_layers"
    if params.models.kind == "random":
        return getattr(shape_config(getattr(params.models, side)), name)
    config = named_config(params, side)
    return None if config is None else getattr(config, name)


def repairs_within_the_target(params: ParamsFile) -> None:
    layers, positions = depth_of(params, "target"), depth_of(params, "target", positions=True)
    named = [("repair.grid", text) for text in params.repair.grid]
    named += [("select.repairs", text) for text in params.select.repairs]
    named += [(f"evaluate.repair.{name}", text) for name, text in params.evaluate.repair.items() if text != SELECTED]
    named += [(f"operating.repaired.{name}.repair", entry.repair) for name, entry in params.operating.repaired.items()
              if entry.repair != SELECTED]
    target = f"{params.models.kind} {params.models.target}"
    for key, text in named:
        repair = Repair.parse(text)
        if layers is not None and repair.exact_layers > layers:
            raise ParamError(f"{key}: {text} recomputes {repair.exact_layers} layers, but the target has {layers} "
                             f"({target}); give layers:N with N <= {layers}")
        if positions is not None and repair.sink >= positions:
            raise ParamError(f"{key}: {text} recomputes a sink of {repair.sink} tokens, but the target has "
                             f"{positions} positions ({target}); give sink:S with S < {positions}")
        problem = layers is not None and repair.policy_refusal(layers)
        if problem:
            raise ParamError(f"{key}: {text}: {problem} ({target})")


def self_source_within_the_target(params: ParamsFile) -> None:
    layers, depth = params.models.self_layers, depth_of(params, "target")
    if layers and depth is not None and layers >= depth:
        raise ParamError(f"models.source: self:{layers} asks for {layers} of the target's {depth} decoder layers "
                         f"({params.models.kind} {params.models.target}); use self:<n> with 1 <= n <= {depth - 1}")


def model_paths_are_relative(params: ParamsFile) -> None:
    here = Path.cwd().resolve()
    for side in ("source", "target"):
        name = getattr(params.models, side)
        if Path(name).is_absolute() and Path(name).resolve().is_relative_to(here):
            relative = Path(name).resolve().relative_to(here)
            raise ParamError(f"models.{side}: {name} is inside this repository; name it relative to its root "
                             f"({relative}), as the stage that builds a folder there (convert_models) and "
                             f"every clone's pins do")


def ks_within_the_source(params: ParamsFile) -> None:
    layers = depth_of(params, "source")
    for key, ks in (("fit.ks", params.fit.ks), ("fit.mlp.ks", params.fit.mlp.ks)):
        if layers is not None and max(ks, default=0) > layers:
            raise ParamError(f"{key}: k={max(ks)} exceeds the source's {layers} layers "
                             f"({params.models.kind} {params.models.source}); lower it")


def conversions_feed_the_pair(params: ParamsFile) -> None:
    for side, folder in paths.CONVERTED_SIDES.items():
        if getattr(params.convert, side) is not None and Path(getattr(params.models, side)) != folder:
            raise ParamError(f"convert.{side}: converts a checkpoint into {folder}, but models.{side} is "
                             f"{getattr(params.models, side)}; set models.{side}: {folder}, or convert.{side}: null")


def data_fits_the_pair(params: ParamsFile) -> None:
    """Generated data has the trained pair's word-level vocabulary (random real-shape models read it as meaningless
    ids); hub data's `data.tokenizer` must be the target's (folders: the same vocabulary; else the same name)."""
    if params.data.kind == "generated" and params.models.kind == "hub":
        raise ParamError(f"data.kind: generated (the tiny world's word-level vocabulary) with models.kind hub "
                         f"({params.models.target}): the world's data fits only its trained pair; use a profile with "
                         f"real data (data.kind: hub), e.g. -S profile=qwen25-coder with models.source/models.target")
    if params.data.kind != "hub" or params.models.kind != "hub":
        return
    tokenizer, target = params.data.tokenizer, params.models.target
    if Path(tokenizer) == Path(target):
        return
    ours, theirs = (vocabulary(name) for name in (tokenizer, target))
    if ours is None or theirs is None or ours != theirs:
        raise ParamError(f"data.tokenizer: {tokenizer} is not the target's tokenizer ({target}"
                         f"{'' if ours is None or theirs is None else f': vocabulary {ours} against {theirs}'}); "
                         f"set data.tokenizer: {target}")


def vocabulary(name: str) -> int | None:
    """The vocabulary size of a local folder's tokenizer, None where none is readable without a download."""
    if not Path(name, "tokenizer.json").is_file() and not Path(name, "tokenizer_config.json").is_file():
        return None
    return len(load_tokenizer(name))


def fit_splits_are_extracted(params: ParamsFile) -> None:
    for split in ("fit", "select"):  # fit solves on the one and scores on the other
        if split not in params.extract.splits:
            raise ParamError(f"extract.splits: the fit stage reads the {split!r} caches; add {split!r} "
                             f"(got {params.extract.splits})")


def candidates_are_fitted(params: ParamsFile) -> None:
    grid = params.fit.candidates()
    named = [("calibration.candidates", str(map_name("calibration.candidates", name).start))
             for name in params.calibration.candidates]
    named += [("distill.start", name) for name in params.distill.start]
    for key, name in [*named, ("length.candidate", params.length.candidate)]:
        if name not in grid:
            raise ParamError(f"{key}: {name!r} is not a map of the fit grid (fit.families, fit.ks, fit.lambdas, "
                             f"fit.mlp.ks make: {', '.join(grid)})")


def distilled_candidates_have_a_learning_rate(params: ParamsFile) -> None:
    for name in params.calibration.candidates:
        parsed = map_name("calibration.candidates", name)
        if parsed.distilled and parsed.family not in params.distill.lrs:
            raise ParamError(f"calibration.candidates: {name!r} is distilled from a {parsed.family} map but "
                             f"distill.lrs has no {parsed.family} entry; add one")


def calibration_sizes_fit_the_pool(params: ParamsFile) -> None:
    for size in params.calibration.sizes:
        if size > params.data.calibration_sequences:
            raise ParamError(f"calibration.sizes: {size} sequences, but data.calibration_sequences is "
                             f"{params.data.calibration_sequences}; raise it or drop the size")


def mappers_are_produced(params: ParamsFile) -> None:
    produced = mapper_files(params.fit, params.distill)
    named = [(f"evaluate.mapped.{variant}", path) for variant, path in params.evaluate.mapped.items()]
    named += [(f"repair.maps.{name}", path) for name, path in params.repair.maps.items()]
    named += [(f"operating.maps.{name}", path) for name, path in params.operating.maps.items()]
    for key, path in [*named, ("latency.mapper", params.latency.mapper)]:
        if path not in produced:
            raise ParamError(f"{key}: {path} is not written by fit, distill or select "
                             f"(they write: {', '.join(produced)})")


def selected_repair_is_chosen(params: ParamsFile) -> None:
    named = [(f"evaluate.repair.{name}", setting) for name, setting in params.evaluate.repair.items()]
    named += [(f"operating.repaired.{name}.repair", entry.repair) for name, entry in params.operating.repaired.items()]
    for key, setting in named:
        if setting == SELECTED and params.select.repairs == ["none"]:
            raise ParamError(f"{key}: reads the setting select chose, but select.repairs is [none] (the variant "
                             f"would be `selected` again); add settings to select.repairs")


def operating_lengths_have_data(params: ParamsFile) -> None:
    declared = sorted(params.data.long.lengths) if params.data.long else []
    for length in params.operating.lengths:
        if length not in declared:
            raise ParamError(f"operating.lengths: {length} has no eval part (data.long.lengths: {declared or 'none'});"
                             f" add it to data.long.lengths or drop it")


def report_variant_is_evaluated(params: ParamsFile) -> None:
    if params.report.mapped_variant not in params.evaluate.mapped:
        raise ParamError(f"report.mapped_variant: {params.report.mapped_variant!r} is not a variant of "
                         f"evaluate.mapped ({', '.join(params.evaluate.mapped)})")


# run in this order once every section is valid; each names the keys it compares
PARAMS_RULES = (trained_pair_is_declared, model_paths_are_relative, repairs_within_the_target,
         self_source_within_the_target, ks_within_the_source, fit_splits_are_extracted, candidates_are_fitted,
         distilled_candidates_have_a_learning_rate, calibration_sizes_fit_the_pool, mappers_are_produced,
         selected_repair_is_chosen, operating_lengths_have_data, report_variant_is_evaluated,
         conversions_feed_the_pair, data_fits_the_pair)


SECTIONS = {name: field.annotation for name, field in ParamsFile.model_fields.items() if name not in PLAIN}


def mapper_files(fit: FitParams, distill: DistillParams) -> list[str]:
    """Every mapper file fit, distill and select leave: select's choice and, per k of the linear family, its best
    ridge strength besides the fitted and distilled maps."""
    best = [paths.best_map(k) for k in fit.ks] if "linear" in fit.families else []
    distilled = [paths.distilled_map(str(MapName.parse(name).distilled_name)) for name in distill.start]
    fitted = [paths.fitted_map(name) for name in fit.candidates()]
    return [str(path) for path in (paths.SELECTED_MAPPER, *best, *fitted, *distilled)]


def map_name(key: str, name: str) -> MapName:
    try:
        return MapName.parse(name)
    except ValueError as err:
        raise ParamError(f"{key}: {err}") from None


def check(params: dict) -> list[str]:
    """Returns the sections checked; raises ParamError naming the first bad key."""
    for key in params:
        if key not in SECTIONS and key not in PLAIN:
            raise ParamError(f"{key}: unknown section of {PARAMS_FILE} (known: {', '.join([*PLAIN, *SECTIONS])})")
    for key, kind in PLAIN.items():
        if not isinstance(params.get(key), kind):
            raise ParamError(f"{key}: expected a {kind.__name__}, got {params.get(key)!r}")
    for name in SECTIONS:
        if name not in params:
            raise ParamError(f"{name}: missing section of {PARAMS_FILE}")
    parse(ParamsFile, params, "")
    return [*PLAIN, *SECTIONS]


def slow_bfloat16(params: dict) -> str | None:
    """Why bfloat16 would crawl on this CPU (without AMX or avx512_bf16 it runs many times slower than float32), or
    None. Measured, so not a rule of the file: a profile is valid on every machine."""
    keys = [f"{section}.dtype" for section in MODEL_DTYPES if params[section]["dtype"] == "bfloat16"]
    if not keys or parse(MachineParams, params["machine"], "machine").torch_device != "cpu":
        return None
    float32_ms, bfloat16_ms = cpu_matmul_ms()
    if bfloat16_ms <= float32_ms:
        return None
    return (f"{', '.join(keys)}: bfloat16 runs a matmul in {bfloat16_ms:.1f} ms on this CPU against {float32_ms:.1f} "
            f"ms in float32 ({bfloat16_ms / float32_ms:.0f}x slower: no AMX or avx512_bf16); run on a CPU with "
            f"bfloat16 support, or with {' '.join(f'-S {key}=float32' for key in keys)} (its figures then differ "
            f"from a bfloat16 run)")


def dtypes(params: dict) -> dict:
    """The dtype each model section runs in, and where one is `auto`, the figures that chose it (`machine_dtype`)."""
    record = {f"{section}.dtype": params[section]["dtype"] for section in AUTO_DTYPES}
    if "auto" not in record.values():
        return record | {"auto": None}
    choice, figures = machine_dtype()
    return {key: choice if value == "auto" else value for key, value in record.items()} | {
        "auto": {"choice": choice, **figures}}


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.check_params", __doc__, argv)
    params = read_params()
    result = {"valid": True, "checked": check(params)}
    if reason := slow_bfloat16(params):
        raise ParamError(reason)
    write_json_atomic(paths.DTYPE_CHOICE, dtypes(params))
    write_json_atomic(paths.PARAMS_CHECK, result)
    print(json.dumps(result))


if __name__ == "__main__":
    entry(main)
