"""The lm-eval model `kv-transfer`: tasks scored by the target after a KV-cache handoff, named by model args.

Importing this module registers it; `python -m pipeline.lm_eval_model run ...` is lm-eval's own command line with it
(docs/interfaces.md shows the hub and local-task forms; `--device` defaults to cuda where there is one, else cpu).
Model args are checked before any model loads: one the transfer does not read, one given twice in any of lm-eval's
forms, a path lm-eval read as a number or boolean (`target=2024`), a repair larger than the target: one line, exit 2.

    python -m pipeline.lm_eval_model run --model kv-transfer \
        --model_args target=...,source=...,transfer=mapped,mapper=... --tasks hellaswag,piqa

    target=, source=        hub id or path; target_revision=, source_revision=: a hub commit (not for a folder)
    transfer=               oracle (default)|zero|source|direct|mapped|shuffled|speculative:<share> (the last reads
                            params.yaml's `speculative` look-ahead settings)
    mapper=                 map file, for mapped and shuffled; shuffle_seed=<int> only for shuffled
    repair=                 a kv.repair setting (sink:4+tokens:0.1:attention): the target recomputes part of the cache
    dtype=float32|bfloat16|float16|auto  device=cuda|cpu  batch_size=<int>|auto  max_length=<int>
    allow_other_models=true  accept a map fitted on other models than target/source (default: refused)
    --use_cache PATH        answers kept per handoff, PATH_kv-<key>_rank<r>.db (`cache_key`), never lm-eval's own cache
    --apply_chat_template   as for `hf`, and --system_instruction
    torchrun, accelerate    each process scores every N-th document; rank 0 gathers the results
    routes                  each request's in the results' `config` (`kv_transfer`); counts printed after the table
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import logging
import sys
from pathlib import Path

from lm_eval._cli import HarnessCLI
from lm_eval._cli.utils import MergeDictAction, split_top_level, try_parse_json
from lm_eval.api.registry import register_model
from lm_eval.config.evaluate_config import EvaluatorConfig
from lm_eval.utils import setup_logging, simple_parse_args_string

from pipeline.kv.modes import MODES
from pipeline.kv.pair import Pair
from pipeline.kv.request import KV_TRANSFER, Transfer
from pipeline.kv.router import Router
from pipeline.measure.adapter import HandoffLM, refuse_without_chat_template
from pipeline.measure.ledger import RequestCache
from pipeline.store import inputs
from pipeline.store.cli import entry
from pipeline.store.devices import FACE_DTYPES, resolved
from pipeline.store.models import default_device, load_tokenizer, looks_like_path
from pipeline.store.params import ParamError
from pipeline.store.ranks import join, launched_ranks, leave
from pipeline.store.truncated import self_layers

AUTO_BATCH = 8  # batch_size=auto: lm-eval's search for the largest batch is not implemented; this is used instead
UNKEYED = ("batch_size",)  # model args that change no answer, left out of the request cache's key

log = logging.getLogger(__name__)


@register_model("kv-transfer")
class KVTransferLM(HandoffLM):
    """`measure.adapter.HandoffLM` built from lm-eval's model args (`from_args`): the model `kv-transfer`."""

    built: list["KVTransferLM"] | None = None  # while `main` runs lm-eval: the models it built, whose routes it prints
    cache_base: str | None = None  # while `main` runs lm-eval with --use_cache PATH: PATH, keyed per handoff here

    @classmethod
    def from_args(cls, target: str, source: str | None = None, transfer: str = "oracle", mapper: str | None = None,
                  dtype: str = "float32", device: str | None = None, batch_size: int | str = 8,
                  target_revision: str | None = None, source_revision: str | None = None,
                  shuffle_seed: int | str | None = None, max_length: int | str | None = None,
                  repair: str | None = None, allow_other_models: bool | str = False, **unknown) -> "KVTransferLM":
        if unknown:
            known = [arg for arg in inspect.signature(cls.from_args).parameters if arg != "unknown"]
            raise ParamError(f"kv-transfer: unknown model arg {sorted(unknown)[0]}= (known: {', '.join(known)})")
        texts(target=target, source=source, mapper=mapper, target_revision=target_revision,
              source_revision=source_revision)
        request = Transfer.of(KV_TRANSFER, mode=transfer, mapper=mapper, repair=repair, shuffle_seed=shuffle_seed,
                             allow_other_models=allow_other_models)
        request.require_source(source is not None, "source=<hub id or path>")
        unused(request, {"target": (target, target_revision), "source": (source, source_revision)})
        inputs.choice(dtype, "kv-transfer dtype", FACE_DTYPES)
        if device is not None:
            inputs.device(str(device), "kv-transfer device")
        batch = AUTO_BATCH if batch_size == "auto" else inputs.at_least(batch_size, "kv-transfer batch_size", 1)
        length = None if max_length is None else inputs.lengths([max_length], "kv-transfer max_length")[0]
        ranks = join(device or default_device())  # under torchrun / accelerate launch: this rank's place
        # a given max_length is the run the contract judges a sliding window against; without one, as in the
        # stages, every handoff refuses a sequence longer than the window when it comes (Handoff.check_length)
        pair = Pair(target, source, resolved(dtype), ranks.device(device or default_device()),
                    target_revision=target_revision, source_revision=source_revision, max_tokens=length,
                    allow_other_models=request.allow_other_models)
        request.check_geometry(pair)
        if length is not None:
            inputs.within(length, "kv-transfer max_length", pair.positions, "positions in the models")
        router = Router.of(pair, request, batch)
        for difference in pair.other_models:  # the run's config records allow_other_models=true beside this
            log.warning("kv-transfer: allow_other_models=true: %s", difference)
        lm = cls(router, pair.target_tokenizer, length, ranks)
        lm.pair = pair
        if cls.built is not None:
            cls.built.append(lm)
        return lm

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "KVTransferLM":
        # lm-eval also passes its own --batch_size/--device; explicit model args win over them
        shared = {k: v for k, v in (additional_config or {}).items() if k in ("batch_size", "device") and v is not None}
        args = {**shared, **arg_dict}
        lm = cls.from_args(**args)
        if cls.cache_base is not None:
            lm.cache = RequestCache(cls.cache_base, cache_key(args, lm.pair.fingerprints.parts), lm.rank)
        return lm

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "KVTransferLM":
        once([part.partition("=")[::2] for part in arg_string.split(",") if part.strip()])
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)


def texts(**values) -> None:
    """Refuse a path, hub id or revision that lm-eval's parsing turned into a number or a boolean (`target=2024`,
    `source=true`): it reads every model arg's value as Python would (`handle_cli_value_string`)."""
    for name, value in values.items():
        if value is not None and not isinstance(value, str):
            raise ParamError(f"kv-transfer {name}={value!r}: lm-eval reads this value as a {type(value).__name__}, not "
                             f"as a path or hub id; write it so it stays text (./{value} for a folder, or "
                             f"{name}='{value}' quoted)")


def unused(request: Transfer, sides: dict[str, tuple[str | None, str | None]]) -> None:
    """Refuse a model arg the handoff would not read: `source=` beside a mode that reads no source, a revision
    beside no model or beside a local folder or self source (a revision names a hub commit)."""
    if sides["source"][0] is not None and not request.needs_source():
        readers = [name for name, mode in MODES.items() if mode.reads.source]
        raise ParamError(f"kv-transfer transfer={request.mode} does not use source=: leave it out (source= is read "
                         f"by {', '.join(readers)})")
    for side, (name, revision) in sides.items():
        if revision is None:
            continue
        if name is None:
            raise ParamError(f"kv-transfer {side}_revision= names a revision of no {side}: leave it out")
        if looks_like_path(name) or Path(name).is_dir() or self_layers(name) is not None:
            raise ParamError(f"kv-transfer {side}_revision={revision}: {side}={name} is a local folder or self "
                             f"source, and a revision names a hub commit: leave it out")


def once(pairs: list[tuple[str, str]]) -> None:
    """Refuse a model arg given twice (lm-eval's parsing keeps the last one, with at most a warning)."""
    seen: dict[str, str] = {}
    for key, value in pairs:
        key = key.strip()
        if key in seen:
            raise ParamError(f"kv-transfer {key}= given twice ({seen[key]}, then {value.strip()}): give it once")
        seen[key] = value.strip()


def cache_key(args: dict, models: dict) -> str:
    """The handoff's key in the request cache: every model arg lm-eval built but UNKEYED, map files by their
    content, and `models`, both models' fingerprints (`store.fingerprints`: weights, config, tokenizer)."""
    keyed = {key: str(value) for key, value in args.items() if key not in UNKEYED}
    if "mapper" in keyed:  # a map file by its content hash (by its path where there is none: from_args refuses it)
        path = Path(keyed["mapper"])
        keyed["mapper"] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else keyed["mapper"]
    text = json.dumps({"args": keyed, "models": models}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RecordedArgs(MergeDictAction):
    """lm-eval's own action of `--model_args` / `-a` (its merge unchanged) that also keeps the values of each use in
    `given`, in command-line order, so that a key given twice in any form can be refused."""

    given: list[list[str]]

    def __call__(self, parser, namespace, values, option_string=None):
        self.given.append(list(values or []))
        super().__call__(parser, namespace, values, option_string)


def command_line() -> tuple[HarnessCLI, list[list[str]]]:
    """lm-eval's command line, and the list its `run --model_args` fills with each use's raw values."""
    cli = HarnessCLI()
    (action,) = [action for action in cli._subparsers.choices["run"]._actions if action.dest == "model_args"]
    action.__class__, action.given = RecordedArgs, []
    return cli, action.given


def given_args(given: list[list[str]]) -> list[tuple[str, str]]:
    """Every (key, value) the `--model_args` flags gave, in order, each form read as lm-eval's action reads it: a JSON
    object (its keys, repeated ones too) or `key=value` items split on top-level commas. Values after a JSON object
    (which lm-eval drops silently) are refused."""
    pairs = []
    for values in given:
        if values and isinstance(try_parse_json(values[0]), dict):
            if len(values) > 1:
                raise ParamError(f"kv-transfer --model_args {values[0]} {' '.join(values[1:])}: lm-eval reads the JSON "
                                 f"object and drops what follows it; give one JSON object or key=value pairs")
            pairs += [(key, json.dumps(value)) for key, value in json.loads(values[0], object_pairs_hook=list)]
            continue
        pairs += [item.partition("=")[::2] for value in values for item in split_top_level(value)]
    return pairs


def evaluator_config(namespace) -> EvaluatorConfig | None:
    """The run's configuration as lm-eval builds it from `namespace` (its YAML and flags merged), quietly; None
    where lm-eval refuses it, which it then does itself."""
    lm_eval_log = logging.getLogger("lm_eval")
    level, lm_eval_log.level = lm_eval_log.level, logging.ERROR
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return EvaluatorConfig.from_cli(namespace)
    except (ValueError, TypeError, FileNotFoundError):
        return None
    finally:
        lm_eval_log.setLevel(level)


def prepare(namespace, given: list[list[str]]) -> None:
    """A kv-transfer run checked and keyed before lm-eval builds anything: each model arg given once in any form, a chat
    template where --apply_chat_template asks for one, and `--use_cache PATH` taken over by the handoff's own cache
    (lm-eval's would key its file by the path alone)."""
    config = evaluator_config(namespace)
    if config is None or config.model != "kv-transfer":
        return
    once(given_args(given))
    target = config.model_args.get("target")
    if getattr(config, "apply_chat_template", False) and isinstance(target, str):
        refuse_without_chat_template(load_tokenizer(target, config.model_args.get("target_revision")))
    if config.use_cache:
        if not namespace.use_cache:
            raise ParamError(f"kv-transfer: the config file's use_cache: {config.use_cache} would key the cache by its "
                             f"path alone; give --use_cache {config.use_cache} on the command line instead")
        KVTransferLM.cache_base, namespace.use_cache = config.use_cache, None


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line with `kv-transfer` registered, then each model's route counts."""
    args = list(argv if argv is not None else sys.argv[1:])
    if args[:1] == ["run"] and not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", default_device()]  # lm-eval's own default is cuda:0, even on a machine without one
    sys.argv = [sys.argv[0], *args]
    setup_logging()
    cli, given = command_line()
    namespace = cli.parse_args()
    KVTransferLM.built = []
    try:
        if getattr(namespace, "command", None) == "run":
            prepare(namespace, given)
        cli.execute(namespace)
        built = KVTransferLM.built
    finally:
        KVTransferLM.built = KVTransferLM.cache_base = None
    for lm in built:
        if lm.rank == 0:
            print("\n".join(lm.route_lines()))
    leave(launched_ranks())  # from_args's join: after lm-eval's last collective


if __name__ == "__main__":
    entry(main)  # the project's refusals (a bad model arg, a corrupt map, models it was not fitted on): one line
