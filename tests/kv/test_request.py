"""The request (`kv.request`): one set of rules for kv-transfer's model args and generate's flags, each refusal one
line in the face's own spelling, before any model loads."""
from pathlib import Path

import pytest

from pipeline.kv.modes.registry import MODES
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.request import GENERATE, KV_TRANSFER, USES, Transfer
from pipeline.store.params import ParamError

VALUES = {"mapper": None, "repair": "sink:2", "fallback": "entropy", "threshold": "1", "disagree": None,
          "shuffle_seed": "3"}


@pytest.fixture(scope="module")
def map_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("request") / "map.safetensors"
    path.write_bytes(b"not read here")
    return str(path)


def asked(field: str, map_file: str) -> dict:
    """`field` given (and what it needs beside it to be complete)."""
    value = {"mapper": map_file, "disagree": f"{map_file}:{map_file}"}.get(field, VALUES[field])
    gate = {"fallback": "entropy", "threshold": "1"} if field in ("threshold", "fallback") else {}
    gate = {"fallback": "disagree", "threshold": "1"} if field == "disagree" else gate
    return {**gate, field: value}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("field", sorted(USES))
def test_each_arg_is_taken_by_the_modes_that_read_it_and_refused_by_the_others(mode, field, map_file):
    args = asked(field, map_file)
    if mode == "mapped" and field != "mapper":
        args["mapper"] = map_file
    spelt = f"{mode}:0.5" if MODES[mode].parameter else mode  # a mode that takes a value is written with it
    if mode in USES[field]:
        Transfer.of(KV_TRANSFER, mode=spelt, **args)
        return
    with pytest.raises(ParamError, match=rf"^kv-transfer transfer={mode} does not use (\w+)=: leave it out"):
        Transfer.of(KV_TRANSFER, mode=spelt, **args)


def test_the_faces_spell_one_rule_their_own_way():
    with pytest.raises(ParamError, match=r"^kv-transfer threshold= and disagree= gate a handoff: give fallback="):
        Transfer.of(KV_TRANSFER, mode="direct", threshold="1")
    with pytest.raises(ParamError, match=r"^--threshold and --disagree gate a handoff: give --fallback <score> too$"):
        Transfer.of(GENERATE, mode="direct", threshold=1.0)
    with pytest.raises(ParamError, match=r"^kv-transfer threshold: nan would never fall back"):
        Transfer.of(KV_TRANSFER, mode="direct", fallback="kl", threshold="nan")


def test_a_malformed_repair_is_the_repair_parsers_refusal_unwrapped():
    with pytest.raises(Exception) as refused:
        Transfer.of(KV_TRANSFER, mode="mapped", mapper="x", repair="sink:x")
    assert type(refused.value).__name__ == "RepairError" and "bad part 'sink:x'" in str(refused.value)


@pytest.mark.parametrize("mode, needs", [("oracle", False), ("zero", False), ("source", True), ("direct", True),
                                         ("shuffled", True)])
def test_a_mode_that_reads_a_source_needs_one(mode, needs):
    request = Transfer.of(KV_TRANSFER, mode=mode)
    request.require_source(True, "source=<path>")
    if needs:
        with pytest.raises(ParamError, match=rf"^kv-transfer transfer={mode} needs a source model: give source="):
            request.require_source(False, "source=<path>")
    else:
        request.require_source(False, "source=<path>")


def test_a_repair_larger_than_the_target_is_refused_from_its_config(tiny_pair):
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]))
    layers = pair.contract.target.geometry["layers"]
    Transfer.of(KV_TRANSFER, mode="direct", repair=f"layers:{layers}").check_geometry(pair)
    with pytest.raises(ParamError, match=rf"layers:{layers + 1} exceeds the target's {layers} layers"):
        Transfer.of(KV_TRANSFER, mode="direct", repair=f"layers:{layers + 1}").check_geometry(pair)
    with pytest.raises(ParamError, match=rf"sink:{pair.positions} is not below the models' {pair.positions}"):
        Transfer.of(KV_TRANSFER, mode="direct", repair=f"sink:{pair.positions}").check_geometry(pair)
    assert "target" not in pair.__dict__  # decided from the config: no weights loaded
    assert Transfer.of(KV_TRANSFER, mode="direct", repair="none").setting is None
    assert Transfer.of(GENERATE, mode="zero", repair=Repair.parse("sink:2")).setting == Repair.parse("sink:2")


def test_a_stage_asks_with_its_own_values_a_map_file_as_a_path_and_a_share_of_each_context(map_file):
    request = Transfer.stage(mode="mapped", mapper=Path(map_file), repair=Repair.parse("sink:2"), keep=0.5)
    assert (request.mapper, str(request.setting), request.keep) == (map_file, "sink:2", 0.5)
    for share in (0, 1.5):
        with pytest.raises(ParamError, match=rf"^stage keep: expected a share in \(0, 1\], got {share}$"):
            Transfer.stage(mode="oracle", keep=share)
    with pytest.raises(ParamError, match=r"^stage mapper: no mapper file at .*missing\.safetensors; give one"):
        Transfer.stage(mode="mapped", mapper=Path(map_file).with_name("missing.safetensors"))
