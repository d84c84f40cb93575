"""`python -m pipeline.generate`: each mode's departure from the oracle is where the tokens first differ, a refused
mode or flag is one line, a repair's recomputed tokens are printed; on tiny models built here."""
import io
import shutil

import pandas as pd
import pytest
from helpers import ROOT, build_model, tiny_config

from pipeline.generate import departure, main, run
from pipeline.kv.mapper import identity_mapper, save_mapper
from pipeline.kv.pair import OtherModelsError, Pair
from pipeline.kv.repair import Repair, RepairError
from pipeline.store.artifacts import ArtifactError
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.models import IncompatiblePairError
from pipeline.store.params import ParamError


@pytest.mark.parametrize("tokens, oracle, expected", [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 4], [1, 2, 3], 2),
    ([5, 2, 3], [1, 2, 3], 0),
    ([1, 2], [1, 2, 3], 2),  # stopped at EOS where the oracle went on
    ([1, 2, 3, 4], [1, 2, 3], 3),
])
def test_departure_is_the_first_new_token_where_a_mode_leaves_the_oracle(tokens, oracle, expected):
    assert departure(tokens, oracle) == expected


def _row(out: str, mode: str) -> list[str]:
    """The cells of `mode`'s row in the summary table."""
    line = next(line for line in out.splitlines() if line.startswith(f"| {mode} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_direct_reports_where_its_tokens_first_differ_from_the_oracles(tiny_pair, tokenizer):
    prompt = tokenizer.encode("Question: How do I open a jar?\nAnswer:")
    pair = Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), "float32", "cpu")
    out = io.StringIO()
    [[oracle, direct]] = run(pair, [prompt], ["direct"], tiny_pair["target"] / "none", 8, out=out)
    differ = [index for index, (a, b) in enumerate(zip(direct.tokens, oracle.tokens)) if a != b]
    assert _row(out.getvalue(), "direct")[3] == (f"token {differ[0]}" if differ else "same as oracle")

    # the target's own cache handed to itself is the oracle, token for token
    itself = Pair(str(tiny_pair["target"]), str(tiny_pair["target"]), "float32", "cpu")
    out = io.StringIO()
    [[oracle, direct]] = run(itself, [prompt], ["direct"], tiny_pair["target"] / "none", 8, out=out)
    assert direct.tokens == oracle.tokens
    assert _row(out.getvalue(), "direct")[3] == "same as oracle"


@pytest.fixture(scope="module")
def deeper_source(tmp_path_factory, tokenizer):
    """A source with one more layer than tiny_pair's target: direct is undefined between them."""
    folder = tmp_path_factory.mktemp("deeper") / "source"
    build_model(tiny_config(len(tokenizer), 32, layers=3), seed=3).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_main(capsys, monkeypatch, tmp_path, *argv) -> str:
    monkeypatch.chdir(tmp_path)  # no params.yaml, no models/: every setting from the flags
    transfer = argv[argv.index("--transfer") + 1] if "--transfer" in argv else ""
    seed = ["--shuffle-seed", "0"] if "shuffled" in transfer else []  # refused beside no shuffled mode
    main(["Question: How do I open a jar?\nAnswer:", "--max-new-tokens", "4", "--dtype", "float32",
          "--device", "cpu", "--threads", "0", *seed, *argv])
    return capsys.readouterr().out


def test_a_default_mode_the_contract_refuses_is_one_line_and_the_others_still_run_but_an_asked_one_stops(
        capsys, monkeypatch, tmp_path, tiny_pair, deeper_source):
    pair = ("--target", str(tiny_pair["target"]), "--source", str(deeper_source))
    with pytest.raises(IncompatiblePairError, match="direct injection needs equal KV geometry"):
        run_main(capsys, monkeypatch, tmp_path, *pair, "--transfer", "oracle,direct,source")
    out = run_main(capsys, monkeypatch, tmp_path, *pair)  # the default modes
    direct = [line for line in out.splitlines() if line.startswith("direct")]
    assert len(direct) == 1 and direct[0].startswith("direct: skipped") and "geometry" in direct[0]
    assert "mapped: skipped, no mapper given for this pair: give --mapper PATH" in out.splitlines()
    assert "Traceback" not in out
    assert _row(out, "oracle")[3] == "same as oracle" and _row(out, "source")


def test_the_cli_prints_each_modes_stream_and_row_for_any_pair(capsys, monkeypatch, tmp_path, tiny_pair):
    source, target = (Pair(str(tiny_pair[side])).target for side in ("source", "target"))
    mapper = tmp_path / "identity.safetensors"
    identity = identity_mapper(str(tiny_pair["source"]), str(tiny_pair["target"]), source.config, target.config)
    identity.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))
    save_mapper(identity, mapper)
    out = run_main(capsys, monkeypatch, tmp_path, "--target", str(tiny_pair["target"]), "--source",
                   str(tiny_pair["source"]), "--mapper", str(mapper),
                   "--transfer", "oracle,mapped,source,direct,zero,shuffled")
    for mode in ("oracle", "mapped", "source", "direct", "zero", "shuffled"):
        assert any(line.startswith(f"{mode:<8} | ") for line in out.splitlines()), mode  # its streamed text
        cells = _row(out, mode)
        assert float(cells[1]) > 0 and 1 <= int(cells[2]) <= 4
    # the identity map through strip, map and re-apply is the direct handoff
    assert _row(out, "mapped")[3] == _row(out, "direct")[3]


@pytest.mark.parametrize("argv, message", [
    (["--repair", "sink:2", "--transfer", "oracle,source"],
     "--repair: --transfer oracle,source names no mode it applies to (zero, direct, mapped, shuffled)"),
    (["--mapper", "map.safetensors", "--transfer", "oracle,direct"],
     "--mapper: --transfer oracle,direct names no mode it applies to (mapped, shuffled)"),
    (["--shuffle-seed", "3", "--transfer", "oracle,mapped"],
     "--shuffle-seed: --transfer oracle,mapped names no mode it applies to (shuffled)"),
])
def test_a_flag_no_asked_mode_reads_is_refused_in_one_line_naming_it(capsys, monkeypatch, tmp_path, tiny_pair, argv,
                                                                      message):
    with pytest.raises(ParamError) as refused:
        run_main(capsys, monkeypatch, tmp_path, "--target", str(tiny_pair["target"]), *argv)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_generate_refuses_a_map_fitted_on_other_models_and_runs_and_says_so_when_allowed(
        capsys, monkeypatch, tmp_path, tiny_pair):
    source, target = (Pair(str(tiny_pair[side])).target for side in ("source", "target"))
    mapper = tmp_path / "identity.safetensors"
    identity = identity_mapper("s", "t", source.config, target.config)
    identity.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))
    save_mapper(identity, mapper)
    swapped = ("--target", str(tiny_pair["source"]), "--source", str(tiny_pair["target"]), "--mapper", str(mapper),
               "--transfer", "oracle,mapped", "--max-new-tokens", "2")
    with pytest.raises(OtherModelsError, match="swapped"):
        run_main(capsys, monkeypatch, tmp_path, *swapped)
    out = run_main(capsys, monkeypatch, tmp_path, *swapped, "--allow-other-models")
    assert "other models allowed (--allow-other-models): " in out and _row(out, "mapped")


def test_generate_prints_each_modes_route_and_a_repairs_recomputed_tokens(capsys, monkeypatch, tmp_path, tiny_pair,
                                                                          tokenizer):
    source, target = (Pair(str(tiny_pair[side])).target for side in ("source", "target"))
    mapper = tmp_path / "identity.safetensors"
    identity = identity_mapper(str(tiny_pair["source"]), str(tiny_pair["target"]), source.config, target.config)
    identity.models = pair_fingerprints(str(tiny_pair["source"]), str(tiny_pair["target"]))
    save_mapper(identity, mapper)
    setting = Repair.parse("layers:1+sink:2+tokens:0.25:recency")
    prefix = len(tokenizer.encode("Question: How do I open a jar?\nAnswer:")) - 1  # run_main's prompt, handed off
    recomputed = setting.sink + setting.chosen(prefix)
    modes = ("--target", str(tiny_pair["target"]), "--source", str(tiny_pair["source"]), "--mapper", str(mapper),
             "--transfer", "oracle,mapped,direct,shuffled,zero,source", "--repair", str(setting))
    out = run_main(capsys, monkeypatch, tmp_path, *modes)
    for mode in ("mapped", "direct", "shuffled", "zero"):  # as kv-transfer: every cache the target did not make
        route = _row(out, mode)[-1]
        assert route.startswith(f"repaired {setting}: layer 0 exact, {recomputed} tokens recomputed in "), route
        assert float(route.split(" in ")[1].removesuffix(" ms")) > 0
    for mode in ("oracle", "source"):  # their model's own prefill: nothing to repair
        assert _row(out, mode)[-1] == mode
    # the identity map repaired by the target itself is still the oracle's cache, token for token
    assert _row(out, "mapped")[3] == "same as oracle"


def test_a_one_token_prompt_hands_nothing_off_and_its_route_says_so(capsys, monkeypatch, tmp_path, tiny_pair):
    monkeypatch.chdir(tmp_path)
    main(["Question", "--max-new-tokens", "2", "--dtype", "float32", "--device", "cpu", "--threads", "0",
          "--target", str(tiny_pair["target"]), "--source", str(tiny_pair["source"]), "--transfer", "oracle,direct",
          "--repair", "sink:2"])
    out = capsys.readouterr().out
    assert "(1 tokens)" in out and _row(out, "direct")[-1] == "nothing handed off (a one-token prompt)"


@pytest.mark.parametrize("setting", ["sink:x", "tokens:0.1", "tokens:2:recency", "bogus:1"])
def test_a_malformed_repair_is_the_repair_parsers_one_line_refusal(capsys, monkeypatch, tmp_path, tiny_pair,
                                                                    setting):
    with pytest.raises(RepairError) as parsed:
        Repair.parse(setting)
    with pytest.raises(SystemExit) as exit_:
        run_main(capsys, monkeypatch, tmp_path, "--target", str(tiny_pair["target"]), "--repair", setting)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exit_.value.code == 2 and len(errors) == 1 and errors[0].endswith(f"argument --repair: {parsed.value}")


def test_a_truncated_eval_part_is_one_line_naming_it_and_prepare_data(tmp_path, monkeypatch, tiny_pair):
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")  # where generate runs: the repository
    (tmp_path / "data").mkdir()
    pd.DataFrame({"prompt_ids": [[5, 6, 7]] * 4, "continuation_ids": [[8, 9]] * 4}).to_parquet(tmp_path / "data" /
                                                                                           "eval.parquet")
    eval_part = tmp_path / "data" / "eval.parquet"
    eval_part.write_bytes(eval_part.read_bytes()[:-40])  # before: pyarrow's traceback from read_prompts
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArtifactError, match=r"^data/eval\.parquet: not a readable parquet table \([^\n]+\); "
                                            r"regenerate it: dvc repro -f prepare_data$"):
        main(["--eval", "1", "--transfer", "oracle", "--target", str(tiny_pair["target"]), "--dtype", "float32",
              "--device", "cpu", "--threads", "0"])
