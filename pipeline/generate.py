"""`python -m pipeline.generate PROMPT`: see the handoff on a prompt of your own, each mode beside the oracle.

The prompt is the positional text, a file's text (`--file PATH`) or the first N prompts of the eval part
(`--eval N`, data/eval.parquet's prompt ids, shown decoded with the target's tokenizer). Each mode of
`--transfer` continues it under the last-token protocol (PROTOCOL.md, "Handoff"): prompt[:-1] becomes the
mode's cache, the decoding model reads prompt[-1] with it, then decodes token by token from the same cache
until `--max-new-tokens` or EOS. Modes: `oracle` (the target's own prefill; always run first, it is what the
others are compared with), `mapped` and `shuffled` (through `--mapper`, by default the selected map
models/mapper.safetensors for the pipeline's pair), `direct`, `zero`, and `source` (the source model alone, its
own cache and its own predictions). Tokens are greedy, or sampled at `--temperature` from a generator seeded by
`--seed` afresh for each mode, so modes that agree draw the same tokens.

Each mode's tokens are printed as they come; then a table gives per mode its time to first token (the cache
built, prompt[-1] read and the first token picked, in ms by time.perf_counter, after one untimed token of
each mode), its new tokens, and the first new token (counted from 0) where it departs from the oracle's.
A mode the pair's contract refuses, or whose mapper is missing, is one line and skipped.

With a gate (`--fallback entropy|kl|disagree --threshold T`, and `--disagree K1:KMAX`, the two mapper files of
that score) each mode that hands off the source's cache (direct, mapped, shuffled) scores the prompt from its
handoff's first step (`kv.gate`, as lm-eval's `fallback=` model args do) and, where the score exceeds T,
continues from the target's own prefill instead: its row gives the score, the time the scoring took (its own
source prefill, map and first step, on top of the time to first token of the way it went) and whether it went
its own way or fell back. `--threshold=-inf` (the `=` keeps argparse from reading an option) sends every gated
mode to the oracle, `inf` none.

With `--repair SETTING` (`kv.repair`'s form, as kv-transfer's `repair=`: `sink:4+tokens:0.1:attention`, ...) the
target recomputes that part of the cache of every mode that hands off the source's cache (direct, mapped,
shuffled; a gated one when it keeps its way) before its first step; the repair's time is part of the time to first
token. A gate scores the map's cache before the repair.

Each row's route says how the mode's cache came: `oracle`, `source`, the mode's own handoff (`mapped`, `direct`,
...), `repaired <setting>: [layers 0-n exact,] N tokens recomputed in T ms` (the repair's own time, from the
handoff's `repaired.log`), `fell back to the target's prefill: <score> S > threshold T`, or `nothing handed off`
(a one-token prompt has no prefix). Every flag is checked before model work by `store.inputs`' rules (a threshold
never nan, a temperature >= 0, `--eval N` within the eval prompts, a UTF-8 `--file`, prompt and new tokens within
the models' positions, a device this machine has): one line and exit 2 for the first bad one.

The pair is the pipeline's (models/target, models/source of params.yaml's `models` section) or any other
(`--target DIR [--source DIR]`); dtype and device come from the `models` section unless given, CPU threads
from `latency.threads`.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from pipeline.kv.contract import MODES
from pipeline.kv.decode import eos_ids, generate
from pipeline.kv.gate import FITTED, SCORES, Gate, map_pair
from pipeline.kv.handoff import SOURCE_MODES, Handoff
from pipeline.kv.pair import OtherModelsError, Pair
from pipeline.kv.repair import Repair, RepairError
from pipeline.measure.compare import read_prompts
from pipeline.store import inputs, paths
from pipeline.store.artifacts import ArtifactError
from pipeline.store.cli import Refusal, entry, parser
from pipeline.store.devices import DTYPES
from pipeline.store.lazy import lazy
from pipeline.store.models import ModelsParams
from pipeline.store.params import PARAMS_FILE, ParamError, load_section, read_key
from pipeline.studies.format import md_table

torch = lazy("torch")

TRANSFERS = tuple(MODES)
DEFAULT_TRANSFER = "oracle,mapped,source,direct"  # a mode of these the pair does not allow is skipped, not refused
FELL_BACK = "fell back to the target's prefill"
EVAL_PROMPTS, SELECTED_MAPPER = paths.EVAL_PROMPTS, paths.SELECTED_MAPPER


@dataclass
class Generation:
    """One mode's continuation of one prompt."""

    mode: str
    tokens: list[int]
    ttft_ms: float  # cache built, prompt[-1] read, first token picked
    score: float | None = None  # a gated mode's score of the prompt
    fell_back: bool = False  # a gated mode continued from the target's own prefill
    score_ms: float = 0.0  # a gated mode's scoring (its own source prefill, map and first step)
    route: str = ""  # how its cache came (`route_text`)


@dataclass
class GateRequest:
    """`--fallback SCORE --threshold T [--disagree K1:KMAX]`: the gate of each mode that hands off the source's
    cache."""

    score: str
    threshold: float
    disagree: tuple[str, str] | None = None  # the disagree score's two mapper files


def departure(tokens: Sequence[int], oracle: Sequence[int]) -> int | None:
    """The first new-token index where `tokens` leaves `oracle`'s (one stopping earlier departs where it
    stops); None when they are the same."""
    for index, (token, reference) in enumerate(zip(tokens, oracle)):
        if token != reference:
            return index
    return None if len(tokens) == len(oracle) else min(len(tokens), len(oracle))


def build_handoff(pair: Pair, mode: str, mapper: Path | None, shuffle_seed: int, repair: Repair | None = None
                  ) -> Handoff:
    """The handoff of `mode` between the pair's models, `repair` applied where it hands off the source's cache; a
    refusal (contract, missing mapper) raises."""
    pair.contract.require(mode)
    repair = repair if mode in SOURCE_MODES else None
    if mode in ("mapped", "shuffled"):
        if mapper is None:  # the selected map was fitted for the pipeline's pair, not for one given by hand
            raise FileNotFoundError("no mapper given for this pair: give --mapper PATH")
        if not mapper.is_file():
            raise FileNotFoundError(f"no mapper at {mapper}: run the pipeline's `select` stage, or give --mapper")
        return pair.handoff(mode, mapper, shuffle_seed=shuffle_seed, repair=repair)
    return pair.handoff(mode, repair=repair)


def build_handoffs(pair: Pair, modes: Sequence[str], mapper: Path | None, shuffle_seed: int,
                   say: Callable[[str], None] = print, asked: bool = False, repair: Repair | None = None
                   ) -> dict[str, Handoff]:
    """Each mode's handoff (weights loaded here, once per model); a refused mode of the default list is said in
    one line and left out, one the user `asked` for stops the run, and so does a map that cannot be used (corrupt,
    or fitted on other models). The oracle is first, and always there: it is what the others are compared with."""
    handoffs = {}
    for mode in dict.fromkeys(["oracle", *modes]):
        try:
            handoffs[mode] = build_handoff(pair, mode, mapper, shuffle_seed, repair)
        except (OtherModelsError, ArtifactError):
            raise
        except (Refusal, FileNotFoundError) as err:
            if mode == "oracle" or asked:
                raise
            say(f"{mode}: skipped, {err}")
    return handoffs


def build_gates(pair: Pair, handoffs: dict[str, Handoff], request: GateRequest | None) -> dict[str, Gate]:
    """The gate of each mode that hands off the source's cache (the others have no first step to score)."""
    if request is None:
        return {}
    return {mode: pair.gate(handoff, request.score, request.threshold, request.disagree)
            for mode, handoff in handoffs.items() if handoff.source is not None}


def route(gate: Gate, prompt: Sequence[int]) -> tuple[float, bool, float]:
    """The gate's score of the prompt, whether it falls back, and the scoring's time in ms."""
    start = time.perf_counter()
    scores, fallback = gate.route([list(prompt)], batch_size=1)
    return float(scores[0]), bool(fallback[0]), 1000 * (time.perf_counter() - start)


def route_text(mode: str, prompt: Sequence[int], gate: Gate | None, score: float | None, fell_back: bool,
          repaired: list[tuple[int, float]], setting: Repair) -> str:
    """How a mode's cache of `prompt` came, in words; `repaired`: the repair log's entries (tokens, seconds) of this
    continuation."""
    if fell_back:
        return f"{FELL_BACK}: {gate.score} {score:.4g} > threshold {gate.threshold:g}"
    if mode in ("oracle", "source"):
        return mode
    if len(prompt) < 2:
        return "nothing handed off (a one-token prompt)"
    if repaired:
        tokens, seconds = (sum(column) for column in zip(*repaired))
        layers = setting.exact_layers
        exact = "" if not layers else "layer 0 exact, " if layers == 1 else f"layers 0-{layers - 1} exact, "
        return f"repaired {setting}: {exact}{tokens} tokens recomputed in {1000 * seconds:.1f} ms"
    return mode


def warm_up(handoffs: dict[str, Handoff], gates: dict[str, Gate], prompt: Sequence[int]) -> None:
    """One untimed token of each mode and one scoring of each gate, so the first prompt's times do not include
    lazy initialisation (the first cached step, the first map)."""
    for handoff in handoffs.values():
        generate(handoff, prompt, 1)
    for gate in gates.values():
        route(gate, prompt)


class Stream:
    """Prints a mode's text as its tokens come: the decoded text grows, only its new end is written (a token
    whose bytes are not a whole character yet waits for the next)."""

    def __init__(self, tokenizer, mode: str, width: int, out):
        self.tokenizer, self.out, self.shown = tokenizer, out, ""
        out.write(f"{mode:<{width}} | ")
        out.flush()

    def __call__(self, tokens: list[int]) -> None:
        text = self.tokenizer.decode(tokens)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[len(self.shown):].replace("\n", "\\n"))
        self.out.flush()
        self.shown = text

    def close(self) -> None:
        self.out.write("\n")
        self.out.flush()


def run(pair: Pair, prompts: list[list[int]], modes: Sequence[str], mapper: Path | None, max_new_tokens: int,
        temperature: float = 0.0, seed: int = 0, shuffle_seed: int = 0, out=None, gate: GateRequest | None = None,
        asked: bool = False, repair: Repair | None = None) -> list[list[Generation]]:
    """Each prompt continued in every mode the pair allows (a gated mode the way its gate sends it; `repair` applied
    to each mode that hands off the source's cache), streamed to `out` (by default stdout), then its summary
    table."""
    out = out or sys.stdout
    say = lambda line: print(line, file=out, flush=True)  # noqa: E731
    handoffs = build_handoffs(pair, modes, mapper, shuffle_seed, say, asked, repair)
    for difference in pair.other_models:
        say(f"other models allowed (--allow-other-models): {difference}")
    tokenizer = pair.target_tokenizer
    stop = eos_ids(pair.target, tokenizer)
    width = max(len(mode) for mode in handoffs)
    gates = build_gates(pair, handoffs, gate)
    warm_up(handoffs, gates, prompts[0])
    results = []
    for number, prompt in enumerate(prompts):
        say(f"\nprompt {number + 1} ({len(prompt)} tokens): " + tokenizer.decode(prompt).replace("\n", "\\n"))
        generations = []
        for mode, handoff in handoffs.items():
            score, fell_back, score_ms = route(gates[mode], prompt) if mode in gates else (None, False, 0.0)
            stream = Stream(tokenizer, mode, width, out)
            logged = len(handoff.repaired.log)
            tokens, ttft_ms = generate(gates[mode].fallback if fell_back else handoff, prompt, max_new_tokens, stop,
                                       temperature, seed, stream)
            stream.close()
            way = route_text(mode, prompt, gates.get(mode), score, fell_back, handoff.repaired.log[logged:],
                        handoff.repair)
            generations.append(Generation(mode, tokens, ttft_ms, score, fell_back, score_ms, way))
        say("")
        say("\n".join(summary(generations)))
        results.append(generations)
    return results


def summary(generations: list[Generation]) -> list[str]:
    """The table of one prompt: per mode its time to first token, new tokens, departure from the oracle and route;
    with a gate, each gated mode's score (and the scoring's time)."""
    oracle = generations[0].tokens
    gated = any(generation.score is not None for generation in generations)
    rows = []
    for generation in generations:
        index = departure(generation.tokens, oracle)
        rows.append([generation.mode, f"{generation.ttft_ms:.1f}", len(generation.tokens),
                     "same as oracle" if index is None else f"token {index}"])
        if gated:
            rows[-1].append("—" if generation.score is None
                            else f"{generation.score:.4g} ({generation.score_ms:.1f} ms)")
        rows[-1].append(generation.route)
    header = ["mode", "time to first token (ms)", "new tokens", "departs from the oracle at"]
    return md_table(header + (["score (scoring time)"] if gated else []) + ["route"], rows)


def read_prompt_ids(args, tokenizer, positions: int) -> list[list[int]]:
    """The prompts asked for, as target token ids: the text, the file's text, or the eval part's first N (at most
    the part's prompts); each with its --max-new-tokens within the pair's `positions`."""
    if args.eval:
        if not EVAL_PROMPTS.is_file():
            raise FileNotFoundError(f"no {EVAL_PROMPTS} here: run the pipeline's `prepare_data` stage (dvc repro "
                                    f"prepare_data), or give a PROMPT")
        prompts = read_prompts(EVAL_PROMPTS)
        inputs.within(args.eval, "--eval", len(prompts), f"prompts in {EVAL_PROMPTS}")
        prompts, flag = [list(context) for context, _ in prompts[: args.eval]], "--eval"
    else:
        text = inputs.text_file(args.file, "--file") if args.file else args.prompt
        prompts, flag = [tokenizer.encode(text)], "--file" if args.file else "PROMPT"
        if not prompts[0]:
            raise ParamError("the prompt encodes to no tokens: give some text")
    for prompt in prompts:
        inputs.positions(len(prompt), args.max_new_tokens, flag, positions)
    return prompts


def gate_request(cli, args, modes: Sequence[str]) -> GateRequest | None:
    """The gate the options ask for, or None; a gate without its threshold, maps or a mode to gate is refused."""
    if args.fallback is None:
        if args.threshold is not None or args.disagree:
            cli.error("--threshold and --disagree gate the handoff: give --fallback SCORE too")
        return None
    if args.threshold is None:
        cli.error(f"--fallback {args.fallback} needs --threshold T (falls back above it; -inf as --threshold=-inf)")
    files = map_pair(args.disagree) if args.disagree else None
    if args.disagree and files is None:
        cli.error(f"--disagree {args.disagree}: name two mapper files as K1:KMAX (k=1 and k=max)")
    if args.fallback == "disagree" and files is None:
        cli.error("--fallback disagree needs --disagree K1:KMAX (the two mapper files whose first steps it compares)")
    if not set(modes) & set(SOURCE_MODES):
        cli.error(f"--fallback gates the modes that hand off the source's cache ({', '.join(SOURCE_MODES)}): "
                  f"--transfer names none")
    return GateRequest(args.fallback, args.threshold, files)


def command_line():
    """generate's command line: the prompt, the modes, decoding, the gate and the pair."""
    cli = parser("pipeline.generate", __doc__)
    cli.add_argument("prompt", nargs="?", help="the prompt text")
    cli.add_argument("--file", help="read the prompt from this file")
    cli.add_argument("--eval", type=int, metavar="N", help="the first N prompts of data/eval.parquet")
    cli.add_argument("--transfer", default=DEFAULT_TRANSFER,
                     help=f"comma-separated modes among {', '.join(TRANSFERS)} (default: %(default)s)")
    cli.add_argument("--mapper", type=Path, help=f"the map of mapped and shuffled (default: the selected one, "
                     f"{SELECTED_MAPPER}, for the pipeline's pair; none for a --target pair)")
    cli.add_argument("--max-new-tokens", type=int, default=32, help="default: %(default)s")
    cli.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); above, sampled")
    cli.add_argument("--seed", type=int, default=0, help="the sampling seed, the same for each mode")
    cli.add_argument("--shuffle-seed", type=int, help="the shuffled mode's seed (default: evaluate.shuffle_seed)")
    cli.add_argument("--fallback", choices=[score for score in SCORES if score not in FITTED],
                     help="gate each mode that hands off the source's cache by this kv.gate score: above "
                     "--threshold the prompt continues from the target's own prefill")
    cli.add_argument("--threshold", type=float, help="the gate's threshold (-inf: every gated mode falls back, "
                     "inf: none; a value starting with '-' as --threshold=-inf)")
    cli.add_argument("--disagree", metavar="K1:KMAX", help="the disagree score's two mapper files (k=1 and k=max)")
    cli.add_argument("--repair", type=repair_setting, metavar="SETTING", help="the target recomputes this part of "
                     "the cache of each mode that hands off the source's cache (kv.repair: e.g. layers:1, "
                     "sink:4+tokens:0.1:attention)")
    cli.add_argument("--target", help="target model folder or hub id (default: the pipeline's models/target)")
    cli.add_argument("--source", help="source model folder or hub id (default: the pipeline's models/source "
                     "when no --target is given; none otherwise)")
    cli.add_argument("--dtype", choices=list(DTYPES), help="model dtype (default: models.dtype)")
    cli.add_argument("--device", help="cpu, cuda, ... (default: models.device)")
    cli.add_argument("--allow-other-models", action="store_true", help="use a map fitted on other models than "
                     "--target/--source (refused by default; the difference is printed before the prompts)")
    cli.add_argument("--threads", type=int, help="torch CPU threads; 0 keeps torch's default (default: "
                     "latency.threads, as the latency stage times)")
    return cli


def repair_setting(text: str) -> Repair:
    """`--repair`'s setting by kv.repair's one parser; a malformed one is argparse's one-line refusal."""
    try:
        return Repair.parse(text)
    except RepairError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def checked_modes(cli, args) -> list[str]:
    """The modes asked for, once every flag is checked: one line and exit 2 for the first bad one."""
    if sum(bool(given) for given in (args.prompt, args.file, args.eval)) != 1:
        cli.error("give one of: a PROMPT, --file PATH or --eval N")
    if args.source and not args.target:
        cli.error("--source needs a --target")
    modes = [mode.strip() for mode in args.transfer.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in TRANSFERS]
    if unknown:
        cli.error(f"--transfer: unknown mode {unknown[0]!r} (known: {', '.join(TRANSFERS)})")
    if not modes:
        raise ParamError(f"--transfer {args.transfer!r} names no mode (known: {', '.join(TRANSFERS)})")
    if args.threshold is not None:
        inputs.threshold(args.threshold, "--threshold")
    inputs.temperature(args.temperature, "--temperature")
    inputs.at_least(args.max_new_tokens, "--max-new-tokens", 1)
    if args.eval is not None:
        inputs.at_least(args.eval, "--eval", 1)
    if args.prompt:
        inputs.text(args.prompt, "PROMPT")
    if args.device:
        inputs.device(args.device, "--device")
    return modes


def built_pair(args, models: ModelsParams | None) -> Pair:
    """The pair the flags name (`--target`/`--source`), else the pipeline's, in the flags' dtype and device."""
    dtype = args.dtype or models.dtype
    device = args.device or inputs.device(models.torch_device, "models.device (params.yaml; or give --device)")
    device_map = None if args.device or models is None else models.device_map
    if args.target:
        return Pair(args.target, args.source, dtype, device, device_map, allow_other_models=args.allow_other_models)
    return Pair.load(models.model_copy(update={"dtype": dtype, "device_map": device_map}), device,
                     allow_other_models=args.allow_other_models)


def main(argv: list[str] | None = None) -> None:
    cli = command_line()
    args = cli.parse_args(argv)
    modes = checked_modes(cli, args)
    gate = gate_request(cli, args, modes)
    models = load_section(ModelsParams, "models") if PARAMS_FILE.is_file() else None
    if models is None and not (args.target and args.dtype and args.device):
        cli.error(f"no {PARAMS_FILE} here: give --target, --dtype and --device")
    threads = args.threads if args.threads is not None else read_key("latency.threads") if models else 0
    if threads > 0:  # threads contending for shared cores make a time to first token swing tenfold
        torch.set_num_threads(threads)
    pair = built_pair(args, models)
    shuffle_seed = args.shuffle_seed
    if shuffle_seed is None:
        shuffle_seed = read_key("evaluate.shuffle_seed") if "shuffled" in modes else 0
    mapper = args.mapper or (None if args.target else SELECTED_MAPPER)
    run(pair, read_prompt_ids(args, pair.target_tokenizer, pair.positions), modes, mapper, args.max_new_tokens,
        args.temperature, args.seed, shuffle_seed, gate=gate, asked=args.transfer != DEFAULT_TRANSFER,
        repair=args.repair)


if __name__ == "__main__":
    entry(main)
