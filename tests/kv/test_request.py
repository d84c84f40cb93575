"""The request (`kv.request`): one set of rules for kv-transfer's model args and generate's flags, each refusal one
line in the face's own spelling, before any model loads."""
from pathlib import Path

import pytest
from helpers import committed

from pipeline.kv.modes import MODES
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.request import GENERATE, KV_TRANSFER, USES, Transfer
from pipeline.kv.speculative import SpeculativeParams
from pipeline.store.params import ParamError, parse

VALUES = {"mapper": None, "repair": "sink:2", "shuffle_seed": "3"}


@pytest.fixture(scope="module")
def map_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("request") / "map.safetensors"
    path.write_bytes(b"not read here")
    return str(path)


def asked(field: str, map_file: str) -> dict:
    """`field` given, with a value that is accepted where the mode reads it."""
    return {field: map_file if field == "mapper" else VALUES[field]}


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
    with pytest.raises(ParamError, match=r"^kv-transfer transfer=oracle does not use repair=: leave it out \(repair= "
                                         r"is read by zero, direct, mapped, shuffled\)$"):
        Transfer.of(KV_TRANSFER, mode="oracle", repair="sink:2")
    with pytest.raises(ParamError, match=r"^--transfer oracle does not use --repair: leave it out \(--repair is read "
                                         r"by zero, direct, mapped, shuffled\)$"):
        Transfer.of(GENERATE, mode="oracle", repair=Repair.parse("sink:2"))
    with pytest.raises(ParamError, match=r"^kv-transfer shuffle_seed: expected an integer >= 0, got -1$"):
        Transfer.of(KV_TRANSFER, mode="shuffled", shuffle_seed="-1")
    with pytest.raises(ParamError, match=r"^--shuffle-seed: expected an integer >= 0, got -1$"):
        Transfer.of(GENERATE, mode="shuffled", shuffle_seed=-1)


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
    with pytest.raises(ParamError, match=rf"policy key_norm@{layers + 1}: the target has only {layers} layers"):
        Transfer.of(KV_TRANSFER, mode="direct", repair=f"tokens:0.5:key_norm@{layers + 1}").check_geometry(pair)
    assert "target" not in pair.__dict__  # decided from the config: no weights loaded
    for none in ({}, {"repair": "none"}):  # left out or named: one form, the empty setting
        assert Transfer.of(KV_TRANSFER, mode="direct", **none).repair == Repair()
    assert Transfer.of(GENERATE, mode="zero", repair=Repair.parse("sink:2")).repair == Repair.parse("sink:2")


def test_a_face_asks_for_a_map_file_and_a_share_of_each_context_each_checked(map_file):
    request = Transfer.of(KV_TRANSFER, mode="mapped", mapper=map_file, repair="sink:2", keep="0.5")
    assert (request.mapper, str(request.repair), request.keep) == (map_file, "sink:2", 0.5)
    for share in (0, 1.5):
        with pytest.raises(ParamError, match=rf"^kv-transfer keep: expected a share in \(0, 1\], got {share}$"):
            Transfer.of(KV_TRANSFER, mode="oracle", keep=share)
    with pytest.raises(ParamError, match=r"^kv-transfer mapper: no mapper file at .*missing\.safetensors; give one"):
        Transfer.of(KV_TRANSFER, mode="mapped", mapper=str(Path(map_file).with_name("missing.safetensors")))


def test_a_mode_that_takes_a_value_is_written_with_it_and_reads_its_declared_settings_from_params():
    request = Transfer.of(KV_TRANSFER, mode="speculative:0.1")
    assert (request.mode, request.share) == ("speculative", 0.1)
    assert request.speculative == parse(SpeculativeParams, committed("speculative"), "speculative")
    assert Transfer.of(GENERATE, mode="oracle").speculative is None


@pytest.mark.parametrize("face, mode, message", [
    (KV_TRANSFER, "speculative", r"^kv-transfer transfer=speculative needs its value, the share p .*: give "
                                 r"transfer=speculative:P$"),
    (GENERATE, "speculative", r"^--transfer speculative needs its value, .*: give --transfer speculative:P$"),
    (KV_TRANSFER, "oracle:0.1", r"^kv-transfer transfer=oracle:0.1: mode oracle takes no value; give transfer=oracle$"),
    (KV_TRANSFER, "speculative:0", r"^kv-transfer transfer speculative:P: expected a share in \(0, 1\], got 0$"),
    (KV_TRANSFER, "speculative:1.5", r"^kv-transfer transfer speculative:P: expected a share in \(0, 1\], got 1.5$"),
    (KV_TRANSFER, "sideways:0.1", r"^kv-transfer transfer: expected one of oracle, .*, got 'sideways'$"),
    (KV_TRANSFER, "mapped", r"^kv-transfer transfer=mapped needs a mapper: give mapper=<mapper file>$"),
    (GENERATE, "mapped", r"^--transfer mapped needs a mapper: give --mapper <mapper file>$"),
])
def test_a_missing_unwanted_or_bad_value_of_a_mode_is_refused_in_one_line(face, mode, message):
    with pytest.raises(ParamError, match=message):
        Transfer.of(face, mode=mode)


def test_speculative_takes_no_repair_and_source_attention_needs_a_handed_over_cache(map_file):
    with pytest.raises(ParamError, match=r"^kv-transfer transfer=speculative does not use repair=: leave it out"):
        Transfer.of(KV_TRANSFER, mode="speculative:0.5", repair="sink:2")
    with pytest.raises(ParamError, match=r"^kv-transfer repair tokens:0.1:source_attention: policy source_attention "
                                         r"ranks by the source's scores"):
        Transfer.of(KV_TRANSFER, mode="zero", repair="tokens:0.1:source_attention")
    repaired = Transfer.of(KV_TRANSFER, mode="mapped", mapper=map_file, repair="tokens:0.1:source_attention")
    assert repaired.speculative is not None and Transfer.of(KV_TRANSFER, mode="mapped", mapper=map_file,
                                                            repair="tokens:0.1:attention").speculative is None


def test_look_ahead_settings_given_are_read_and_refused_where_nothing_reads_them():
    settings = parse(SpeculativeParams, committed("speculative", last=2), "speculative")
    assert Transfer.of(KV_TRANSFER, mode="speculative:0.2", speculative=settings).speculative.last == 2
    with pytest.raises(ParamError, match=r"^kv-transfer transfer=oracle reads no look-ahead settings"):
        Transfer.of(KV_TRANSFER, mode="oracle", speculative=settings)


def test_look_ahead_layers_past_the_source_are_refused_from_its_config(tiny_pair):
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]))
    settings = parse(SpeculativeParams, committed("speculative", layers=[0, -2]), "speculative")
    Transfer.of(KV_TRANSFER, mode="speculative:0.5", speculative=settings).check_geometry(pair)
    far = parse(SpeculativeParams, committed("speculative", layers=[9]), "speculative")
    with pytest.raises(ParamError, match=r"speculative.layers: layer 9 is outside the source's 2 layers"):
        Transfer.of(KV_TRANSFER, mode="speculative:0.5", speculative=far).check_geometry(pair)
