"""What a user asks of a handoff, validated before any model loads: one request (`Transfer`) for every face (the
stages' values are checked by their params schema instead). Every refusal is one line naming the arg as the face
spells it (`Face`) and the fix.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from pipeline.kv.modes import MAPPER_MODES, MODES, OWN_MODES, SOURCE_MODES, split_mode
from pipeline.kv.repair import Repair
from pipeline.kv.speculative import SECTION, SpeculativeParams
from pipeline.store import inputs
from pipeline.store.params import ParamError, load_section

# a cache the decoding model did not prefill (a sparse one it did, for the tokens it holds)
REPAIRED_MODES = tuple(name for name, mode in MODES.items() if name not in OWN_MODES and not mode.sparse)
# the modes that read each optional field; any other mode given it refuses it
USES = {"mapper": MAPPER_MODES, "repair": REPAIRED_MODES, "shuffle_seed": ("shuffled",)}


class Face(NamedTuple):
    tool: str  # "kv-transfer" or "" (generate's flags name themselves)
    args: dict[str, str]

    def name(self, field: str) -> str:
        """The field as a value's name in a refusal: `kv-transfer keep`, `--keep`."""
        return f"{self.tool} {self.args[field]}".strip()

    def given(self, field: str, value=None) -> str:
        """The field as the user wrote it: `keep=` / `transfer=oracle`, `--keep` / `--transfer oracle`."""
        spelt = self.args[field] + ("=" if self.tool else "")
        return spelt if value is None else f"{spelt}{'' if self.tool else ' '}{value}"


FIELDS = ("mode", "mapper", "repair", "shuffle_seed", "keep", "allow_other_models")
KV_TRANSFER = Face("kv-transfer", {**{field: field for field in FIELDS}, "mode": "transfer"})
GENERATE = Face("", {**{field: "--" + field.replace("_", "-") for field in FIELDS}, "mode": "--transfer"})


class Transfer(BaseModel):
    """One handoff asked for, checked on construction."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    face: Face
    mode: str
    mapper: str | None = None
    repair: Repair = Repair()
    shuffle_seed: int | None = None
    keep: float | None = None  # the share of each context's end the handoff reads (the truncated prompt)
    share: float | None = None  # the mode's value, written after its name (`speculative:0.1`)
    speculative: SpeculativeParams | None = None  # the look-ahead settings, where the mode or the repair reads them
    allow_other_models: bool = False

    @classmethod
    def of(cls, face: Face, **args) -> "Transfer":
        """The request of a face's `args` (strings from lm-eval or typed by argparse); the first bad one refused."""
        try:
            return cls.model_validate({"face": face, **args})
        except ValidationError as error:
            cause = error.errors()[0].get("ctx", {}).get("error")
            if isinstance(cause, Exception):
                raise cause from None
            raise ParamError(f"{face.tool or 'generate'}: {error.errors()[0]['msg']}") from None

    @model_validator(mode="before")
    @classmethod
    def _read(cls, values: dict) -> dict:
        face, values = values["face"], {k: v for k, v in values.items() if v is not None}
        mode = _mode(face, values)
        for field, modes in USES.items():
            if field in values and mode not in modes:
                raise ParamError(f"{face.tool} {face.given('mode', mode)} does not use {face.given(field)}: leave it "
                                 f"out ({face.given(field)} is read by {', '.join(modes)})".strip())
        if "repair" in values and not isinstance(values["repair"], Repair):
            values["repair"] = Repair.parse(values["repair"])
        if "shuffle_seed" in values:
            values["shuffle_seed"] = inputs.at_least(values["shuffle_seed"], face.name("shuffle_seed"), 0)
        if "keep" in values:
            values["keep"] = inputs.share(values["keep"], face.name("keep"))
        allow = str(values.get("allow_other_models", False)).lower()
        values["allow_other_models"] = inputs.choice(allow, face.name("allow_other_models"), ("true", "false"))
        values["allow_other_models"] = values["allow_other_models"] == "true"
        _lookahead(face, mode, values)
        return values

    @model_validator(mode="after")
    def _rules(self) -> "Transfer":
        face, setting = self.face, self.repair
        if setting.reads_source and not MODES[self.mode].hands_over:
            raise ParamError(f"{face.name('repair')} {setting}: policy {setting.select_by} ranks by the source's "
                             f"scores, made where the source's cache is handed over: use it with "
                             f"{', '.join(SOURCE_MODES)}")
        if MODES[self.mode].needs_map and self.mapper is None:
            raise ParamError(f"{face.tool} {face.given('mode', self.mode)} needs a mapper: give "
                             f"{face.given('mapper', '<mapper file>')}".strip())
        if self.mapper is not None and not Path(self.mapper).is_file():
            raise ParamError(f"{face.name('mapper')}: no mapper file at {self.mapper}; give one that fit, distill or "
                             f"select wrote (under models/)")
        return self

    def needs_source(self) -> bool:
        return MODES[self.mode].reads.source

    def require_source(self, has_source: bool, how: str) -> None:
        """Refuse a mode that reads a source model when none is given; `how`: the face's way to give one."""
        if self.needs_source() and not has_source:
            raise ParamError(f"{self.face.tool} {self.face.given('mode', self.mode)} needs a source model: give "
                             f"{how}".strip())

    def check_geometry(self, pair) -> None:
        """Refuse a repair larger than `pair`'s target and look-ahead settings reading layers past its source; a model
        the contract refuses is left to its refusal."""
        source = pair.contract.source
        if self.speculative is not None and source is not None and source.geometry is not None:
            problem = self.speculative.layer_refusal(source.geometry["layers"])
            if problem:
                raise ParamError(f"{self.face.tool} {problem}".strip())
        setting, geometry = self.repair, pair.contract.target.geometry
        if setting.empty or geometry is None:
            return
        layers, positions = geometry["layers"], pair.positions
        if setting.exact_layers > layers:
            raise ParamError(f"{self.face.name('repair')} {setting}: layers:{setting.exact_layers} exceeds the "
                             f"target's {layers} layers; give at most layers:{layers}")
        if setting.sink >= positions:
            raise ParamError(f"{self.face.name('repair')} {setting}: sink:{setting.sink} is not below the models' "
                             f"{positions} positions; give a smaller sink")
        problem = setting.policy_refusal(layers)
        if problem:
            raise ParamError(f"{self.face.name('repair')} {setting}: {problem}")


def _mode(face: Face, values: dict) -> str:
    """The mode's name, its value (`NAME:VALUE`) read into `share` where it takes one, else refused."""
    if "share" in values:
        raise ParamError(f"{face.tool} share: write it after the mode's name, {face.given('mode', 'speculative:P')}"
                         .strip())
    text = values.get("mode")
    name, value = split_mode(text) if isinstance(text, str) else (text, None)
    mode = inputs.choice(name, face.name("mode"), MODES)
    parameter = MODES[mode].parameter
    if parameter is not None and value is None:
        raise ParamError(f"{face.tool} {face.given('mode', mode)} needs its value, {parameter}: give "
                         f"{face.given('mode', mode + ':P')}".strip())
    if parameter is None and value is not None:
        raise ParamError(f"{face.tool} {face.given('mode', text)}: mode {mode} takes no value; give "
                         f"{face.given('mode', mode)}".strip())
    if value is not None:
        values["share"] = inputs.share(value, f"{face.name('mode')} {mode}:P".strip())
    values["mode"] = mode
    return mode


def _lookahead(face: Face, mode: str, values: dict) -> None:
    """The look-ahead settings where the mode or the repair's policy reads them (as given, else params')."""
    reads = MODES[mode].sparse or ("repair" in values and values["repair"].reads_source)
    if not reads:
        if "speculative" in values:
            raise ParamError(f"{face.tool} {face.given('mode', mode)} reads no look-ahead settings: leave out "
                             f"speculative".strip())
        return
    if "speculative" in values:
        return
    try:
        values["speculative"] = load_section(SpeculativeParams, SECTION)
    except ParamError as error:
        raise ParamError(f"{face.tool} {face.given('mode', mode)} reads params' `{SECTION}` section: {error}"
                         .strip()) from None

