"""`python -m pipeline.generate PROMPT`: see the handoff on a prompt of your own, each mode beside the oracle.

Each mode of `--transfer` continues the prompt under the last-token protocol (PROTOCOL.md, "Handoff"): prompt[:-1]
becomes the mode's cache and the decoding model reads prompt[-1] with it. A table gives per mode its time to first
token (cache built, prompt[-1] read, first token picked; in ms, after one untimed token per mode), its new tokens,
the first new token (from 0) where it departs from the oracle's, and the route its cache came by.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from pipeline.kv.decode import eos_ids
from pipeline.kv.modes import MODES, split_mode
from pipeline.kv.pair import OtherModelsError, Pair
from pipeline.kv.repair import Repair, RepairError
from pipeline.kv.request import GENERATE, USES, Transfer
from pipeline.kv.router import Router
from pipeline.measure.compare import read_prompts
from pipeline.measure.generation import Generation, Stream, continued, departure, warm_up
from pipeline.store import inputs, paths
from pipeline.store.artifacts import ArtifactError
from pipeline.store.cli import Refusal, entry, parser
from pipeline.store.devices import FACE_DTYPES, resolved
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import ModelsParams
from pipeline.store.params import PARAMS_FILE, ParamError, load_section, read_key
from pipeline.studies.format import md_table

torch = lazy("torch")

DEFAULT_TRANSFER = "oracle,mapped,source,direct"  # a mode of these the pair does not allow is skipped, not refused


def mode_request(mode: str, options: dict) -> Transfer:
    """The request of `mode` from the run's `options` (the request fields its flags give): each field the mode reads; a
    mode reading a map without one is refused (FileNotFoundError, as for the pipeline's missing selected map)."""
    mapper, name = options.get("mapper"), split_mode(mode)[0]
    if name in USES["mapper"]:
        if mapper is None:  # the selected map was fitted for the pipeline's pair, not for one given by hand
            raise FileNotFoundError("no mapper given for this pair: give --mapper PATH")
        if not Path(mapper).is_file():
            raise FileNotFoundError(f"no mapper at {mapper}: run the pipeline's `select` stage, or give --mapper")
    used = {field: value for field, value in options.items()
            if value is not None and (field not in USES or name in USES[field])}
    return Transfer.of(GENERATE, mode=mode, **{field: str(value) if field == "mapper" else value
                                              for field, value in used.items()})


def build_routers(pair: Pair, modes: Sequence[str], options: dict, say: Callable[[str], None] = print,
                  asked: bool = False) -> dict[str, Router]:
    """Each mode's router (its handoff; weights loaded here, once per model). Every request is checked against
    the pair's configs before any weight loads: a refused mode of the default list is said in one line and left out; one
    the user `asked` for stops the run, as does an unusable map (corrupt, or fitted on other models). The oracle is
    always there, first: the others are compared with it."""
    requests = {}
    for mode in dict.fromkeys(["oracle", *modes]):
        try:
            request = mode_request(mode, options)
            request.check_geometry(pair)
            pair.contract.require(request.mode)
            requests[mode] = request
        except (Refusal, FileNotFoundError) as err:
            if mode == "oracle" or asked or isinstance(err, ParamError):
                raise
            say(f"{mode}: skipped, {err}")
    routers = {}
    for mode, request in requests.items():
        try:
            routers[mode] = Router.of(pair, request, batch_size=1)
        except (OtherModelsError, ArtifactError):
            raise
        except Refusal as err:
            if mode == "oracle" or asked:
                raise
            say(f"{mode}: skipped, {err}")
    return routers


def run(pair: Pair, prompts: list[list[int]], modes: Sequence[str], mapper: Path | None, max_new_tokens: int,
        temperature: float = 0.0, seed: int = 0, shuffle_seed: int = 0, out=None, asked: bool = False,
        repair: Repair | None = None) -> list[list[Generation]]:
    """Each prompt continued in every mode the pair allows, streamed to `out` (default stdout), then its summary table.
    `repair` repairs each mode whose cache the target did not prefill (`kv.request.USES`), within its time to first
    token."""
    out = out or sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    options = {"mapper": mapper, "shuffle_seed": shuffle_seed, "repair": repair,
               "allow_other_models": pair.allow_other_models}
    routers = build_routers(pair, modes, options, say, asked)
    for difference in pair.other_models:
        say(f"other models allowed (--allow-other-models): {difference}")
    tokenizer = pair.target_tokenizer
    stop = eos_ids(pair.target, tokenizer)
    width = max(len(mode) for mode in routers)
    warm_up(routers, prompts[0])
    results = []
    for number, prompt in enumerate(prompts):
        say(f"\nprompt {number + 1} ({len(prompt)} tokens): " + tokenizer.decode(prompt).replace("\n", "\\n"))
        results.append([continued(router, prompt, max_new_tokens, stop, temperature, seed, Stream(tokenizer, mode,
                                                                                                  width, out))
                        for mode, router in routers.items()])
        say("\n" + summary(results[-1]))
    return results


def summary(generations: list[Generation]) -> str:
    oracle = generations[0].tokens
    rows = []
    for generation in generations:
        index = departure(generation.tokens, oracle)
        rows.append([generation.mode, f"{generation.ttft_ms:.1f}", len(generation.tokens),
                     "same as oracle" if index is None else f"token {index}", generation.route])
    return md_table(["mode", "time to first token (ms)", "new tokens", "departs from the oracle at", "route"], rows)


def read_prompt_ids(args, tokenizer, positions: int) -> list[list[int]]:
    """The prompts asked for, as target token ids: the text, the file's text, or the eval part's first N (at most
    the part's prompts); each with its --max-new-tokens within the pair's `positions`."""
    if args.eval:
        if not paths.EVAL_PROMPTS.is_file():
            raise FileNotFoundError(f"no {paths.EVAL_PROMPTS} here: run the pipeline's `prepare_data` stage (dvc repro "
                                    f"prepare_data), or give a PROMPT")
        prompts = read_prompts(paths.EVAL_PROMPTS)
        inputs.within(args.eval, "--eval", len(prompts), f"prompts in {paths.EVAL_PROMPTS}")
        prompts, flag = [list(context) for context, _ in prompts[: args.eval]], "--eval"
    else:
        text = inputs.text_file(args.file, "--file") if args.file else args.prompt
        prompts, flag = [tokenizer.encode(text)], "--file" if args.file else "PROMPT"
        if not text.strip():
            raise ParamError(f"{flag}: only whitespace, which encodes to no word; give some text")
        if not prompts[0]:
            raise ParamError("the prompt encodes to no tokens: give some text")
    for prompt in prompts:
        inputs.positions(len(prompt), args.max_new_tokens, flag, positions)
    return prompts


def checked_flags(args, modes: Sequence[str]) -> None:
    """Refuse, before any model work, a flag no mode of --transfer reads (--repair, --mapper, --shuffle-seed)."""
    for field in ("repair", "mapper", "shuffle_seed"):
        if getattr(args, field) is not None and not {split_mode(mode)[0] for mode in modes} & set(USES[field]):
            raise ParamError(f"{GENERATE.given(field)}: --transfer {','.join(modes)} names no mode it applies to "
                             f"({', '.join(USES[field])}); add one or leave the flag out")


def command_line():
    cli = parser("pipeline.generate", __doc__)
    cli.add_argument("prompt", nargs="?", help="the prompt text")
    cli.add_argument("--file", help="read the prompt from this file")
    cli.add_argument("--eval", type=int, metavar="N", help="the first N prompts of data/eval.parquet")
    cli.add_argument("--transfer", default=DEFAULT_TRANSFER,
                     help=f"comma-separated modes among {', '.join(MODES)}, speculative with its share: "
                     f"speculative:0.1 (default: %(default)s)")
    cli.add_argument("--mapper", type=Path, help=f"the map of mapped and shuffled (default: the selected one, "
                     f"{paths.SELECTED_MAPPER}, for the pipeline's pair; none for a --target pair)")
    cli.add_argument("--max-new-tokens", type=int, default=32, help="default: %(default)s")
    cli.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); above, sampled")
    cli.add_argument("--seed", type=int, default=0, help="the sampling seed, the same for each mode")
    cli.add_argument("--shuffle-seed", type=int, help="the shuffled mode's seed (default: evaluate.shuffle_seed)")
    cli.add_argument("--repair", type=repair_setting, metavar="SETTING", help="the target recomputes this part of "
                     "the cache of each mode whose cache it did not prefill (zero, direct, mapped, shuffled; as "
                     "kv-transfer's repair=; kv.repair: e.g. layers:1, sink:4+tokens:0.1:attention)")
    cli.add_argument("--target", help="target model folder or hub id (default: the pipeline's models/target)")
    cli.add_argument("--source", help="source model folder or hub id (default: the pipeline's models/source "
                     "when no --target is given; none otherwise)")
    cli.add_argument("--dtype", choices=list(FACE_DTYPES), help="model dtype (default: models.dtype; auto: this "
                     "machine's faster)")
    cli.add_argument("--device", help="cpu, cuda, ... (default: machine.device)")
    cli.add_argument("--allow-other-models", action="store_true", help="use a map fitted on other models than "
                     "--target/--source (refused by default; the difference is printed before the prompts)")
    cli.add_argument("--threads", type=int, help="torch CPU threads; 0 keeps torch's default (default: "
                     "machine.threads, as the latency stage times)")
    return cli


def repair_setting(text: str) -> Repair:
    """`--repair`'s setting by kv.repair's one parser; a malformed one is argparse's one-line refusal."""
    try:
        return Repair.parse(text)
    except RepairError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def checked_modes(cli, args) -> list[str]:
    """The modes asked for, once every flag is checked: one line and exit 2 for the first bad one."""
    if sum(given is not None for given in (args.prompt, args.file, args.eval)) != 1:
        cli.error("give one of: a PROMPT, --file PATH or --eval N")
    if args.source and not args.target:
        cli.error("--source needs a --target")
    modes = [mode.strip() for mode in args.transfer.split(",") if mode.strip()]
    unknown = [mode for mode in modes if split_mode(mode)[0] not in MODES]
    if unknown:
        cli.error(f"--transfer: unknown mode {unknown[0]!r} (known: {', '.join(MODES)})")
    if not modes:
        raise ParamError(f"--transfer {args.transfer!r} names no mode (known: {', '.join(MODES)})")
    inputs.temperature(args.temperature, "--temperature")
    inputs.at_least(args.max_new_tokens, "--max-new-tokens", 1)
    for value, name in ((args.eval, "--eval"), (args.threads, "--threads"), (args.shuffle_seed, "--shuffle-seed")):
        if value is not None:
            inputs.at_least(value, name, 1 if name == "--eval" else 0)
    if args.prompt is not None:
        inputs.text(args.prompt, "PROMPT")
        if not args.prompt.strip():
            raise ParamError("PROMPT: only whitespace, which encodes to no word; give some text")
    if args.device:
        inputs.device(args.device, "--device")
    return modes


def built_pair(args, models: ModelsParams | None, machine: MachineParams | None) -> Pair:
    """The pair the flags name (`--target`/`--source`), else the pipeline's, in the flags' dtype and device."""
    dtype = resolved(args.dtype) if args.dtype else models.dtype
    device = args.device or inputs.device(machine.torch_device, "machine.device (params.yaml; or give --device)")
    device_map = None if args.device or models is None else models.device_map
    if args.target:
        return Pair(args.target, args.source, dtype, device, device_map, allow_other_models=args.allow_other_models)
    return Pair.load(models.model_copy(update={"dtype": dtype, "device_map": device_map}), device,
                     allow_other_models=args.allow_other_models)


def main(argv: list[str] | None = None) -> None:
    cli = command_line()
    args = cli.parse_args(argv)
    modes = checked_modes(cli, args)
    checked_flags(args, modes)
    models = load_section(ModelsParams, "models") if PARAMS_FILE.is_file() else None
    if models is None and not (args.target and args.dtype and args.device):
        cli.error(f"no {PARAMS_FILE} here: give --target, --dtype and --device")
    machine = load_section(MachineParams, "machine") if models else None
    threads = args.threads if args.threads is not None else machine.threads if machine else 0
    if threads > 0:  # threads contending for shared cores make a time to first token swing tenfold
        torch.set_num_threads(threads)
    pair = built_pair(args, models, machine)
    shuffle_seed = args.shuffle_seed
    if shuffle_seed is None:
        shuffle_seed = read_key("evaluate.shuffle_seed") if "shuffled" in modes else 0
    mapper = args.mapper or (None if args.target else paths.SELECTED_MAPPER)
    run(pair, read_prompt_ids(args, pair.target_tokenizer, pair.positions), modes, mapper, args.max_new_tokens,
        args.temperature, args.seed, shuffle_seed, asked=args.transfer != DEFAULT_TRANSFER,
        repair=args.repair)


if __name__ == "__main__":
    entry(main)
