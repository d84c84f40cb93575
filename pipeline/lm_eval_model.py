"""The lm-eval model `kv-transfer`: tasks scored by the target after a KV-cache handoff, named by model args.

Importing this module registers the model. It is `measure.adapter.HandoffLM` (lm-eval's `TemplateLM` over a
`kv.router.Router`) built from lm-eval's model args, comma-separated `key=value`:

    target=<hub id or path>  source=<hub id or path>  transfer=oracle|zero|source|direct|mapped|shuffled
    mapper=<mapper file, for mapped and shuffled>  dtype=float32|bfloat16|float16  device=cuda|cpu
    batch_size=<int>  target_revision=...  source_revision=...  shuffle_seed=<int, for shuffled>  max_length=<int>
    fallback=entropy|kl|disagree  threshold=<float>  disagree=<k=1 mapper file>:<k=max mapper file>
    repair=<kv.repair setting, e.g. sink:4+tokens:0.1:attention: the target recomputes part of the cache>
    allow_other_models=true|false  (default false: a map fitted on other models than target/source is refused)

The handoff's part of them is a `kv.request.Request`, checked before any model is loaded by the rules generate's
flags obey too: an arg the transfer does not read (`transfer=oracle,mapper=...`, `repair=` on oracle or source, a
gate on a mode without a source cache, `shuffle_seed=` beside anything but shuffled), an arg given twice, a mode
that reads a source without `source=`, a repair larger than the target, `device=meta`: each one line, exit 2.

With `fallback` (a `kv.gate` score) each context is scored from the handoff's first step (the map's cache, before
any repair) and falls back to the target's own prefill where its score exceeds `threshold`. lm-eval's results
record the route of every request in their `config` (`kv_transfer`: transfer, repair, gate, the counts per task and
the routes per document that differ from the handoff's own way; `measure.adapter`), and `run` prints the counts
after lm-eval's table. With `--use_cache PATH` the cache file is keyed by the handoff (`cache_key`: every model
arg but the batch size, with each map file's content hash), so a run never reads another handoff's answers.

lm-eval's `--apply_chat_template` and `--system_instruction` work as for `hf`. Under `torchrun --nproc_per_node N`
(or `accelerate launch`) each process scores every N-th document and rank 0 gathers the results, through lm-eval's
rank contract; the process group is joined when lm-eval builds the model (`from_args`) and left when its command
line is done.

Run lm-eval's own command line with this model registered (`--device` defaults to the pipeline's choice: cuda
when there is one, else cpu; the README shows the hub and the local-task forms):

    python -m pipeline.lm_eval_model run --model kv-transfer \
        --model_args target=...,source=...,transfer=mapped,mapper=... --tasks hellaswag,piqa
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import sys
from pathlib import Path

from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from pipeline.kv.pair import Pair
from pipeline.kv.request import KV_TRANSFER, Request
from pipeline.kv.router import Router
from pipeline.measure.adapter import HandoffLM
from pipeline.store import inputs
from pipeline.store.cli import entry
from pipeline.store.devices import DTYPES
from pipeline.store.models import default_device
from pipeline.store.params import ParamError
from pipeline.store.ranks import join, launched_ranks, leave

AUTO_BATCH = 8  # batch_size=auto: lm-eval's search for the largest batch is not implemented; this is used instead
UNKEYED = ("batch_size",)  # model args that change no answer, left out of the request cache's key

log = logging.getLogger(__name__)


@register_model("kv-transfer")
class KVTransferLM(HandoffLM):
    """`measure.adapter.HandoffLM` built from lm-eval's model args (`from_args`): the model `kv-transfer`."""

    built: list["KVTransferLM"] | None = None  # while `main` runs lm-eval: the models it built, whose routes it prints

    @classmethod
    def from_args(cls, target: str, source: str | None = None, transfer: str = "oracle", mapper: str | None = None,
                  dtype: str = "float32", device: str | None = None, batch_size: int | str = 8,
                  target_revision: str | None = None, source_revision: str | None = None,
                  shuffle_seed: int | str | None = None, max_length: int | str | None = None,
                  fallback: str | None = None, threshold: float | str | None = None, disagree: str | None = None,
                  repair: str | None = None, allow_other_models: bool | str = False, **unknown) -> "KVTransferLM":
        """The model lm-eval's model args name (the module docstring lists them): every arg checked, then the pair,
        then its router."""
        if unknown:
            known = [arg for arg in inspect.signature(cls.from_args).parameters if arg != "unknown"]
            raise ParamError(f"kv-transfer: unknown model arg {sorted(unknown)[0]}= (known: {', '.join(known)})")
        request = Request.of(KV_TRANSFER, mode=transfer, mapper=mapper, repair=repair, fallback=fallback,
                             threshold=threshold, disagree=disagree, shuffle_seed=shuffle_seed,
                             allow_other_models=allow_other_models)
        request.require_source(source is not None, "source=<hub id or path>")
        inputs.choice(dtype, "kv-transfer dtype", DTYPES)
        if device is not None:
            inputs.device(str(device), "kv-transfer device")
        batch = AUTO_BATCH if batch_size == "auto" else inputs.batch_size(batch_size, "kv-transfer batch_size")
        length = None if max_length is None else inputs.lengths([max_length], "kv-transfer max_length")[0]
        ranks = join(device or default_device())  # under torchrun / accelerate launch: this rank's place
        # a given max_length is the run the contract judges a sliding window against; without one, as in the
        # stages, every handoff refuses a sequence longer than the window when it comes (Handoff.check_length)
        pair = Pair(target, source if request.needs_source() else None, dtype, ranks.device(device or default_device()),
                    target_revision=target_revision, source_revision=source_revision, max_tokens=length,
                    allow_other_models=request.allow_other_models)
        request.check_geometry(pair)
        if length is not None:
            inputs.within(length, "kv-transfer max_length", pair.positions, "positions in the models")
        router = Router.of(pair, request, batch)
        for difference in pair.other_models:  # the run's config records allow_other_models=true beside this
            log.warning("kv-transfer: allow_other_models=true: %s", difference)
        lm = cls(router, pair.target_tokenizer, batch, length, ranks)
        if cls.built is not None:
            cls.built.append(lm)
        return lm

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "KVTransferLM":
        # lm-eval also passes its own --batch_size/--device; explicit model args win over them
        shared = {k: v for k, v in (additional_config or {}).items() if k in ("batch_size", "device") and v is not None}
        return cls.from_args(**{**shared, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "KVTransferLM":
        once(arg_string)
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)


def once(arg_string: str) -> None:
    """Refuse a model arg given twice (lm-eval's parsing keeps the last silently)."""
    seen: dict[str, str] = {}
    for part in (part for part in arg_string.split(",") if part.strip()):
        key, _, value = part.partition("=")
        key = key.strip()
        if key in seen:
            raise ParamError(f"kv-transfer {key}= given twice ({seen[key]}, then {value.strip()}): give it once")
        seen[key] = value.strip()


def file_hash(path: str) -> str:
    """A map file's content hash (its path where there is no file: from_args refuses it later)."""
    file = Path(path)
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else path


def cache_key(arg_string: str) -> str:
    """The handoff's key in lm-eval's request cache: every model arg but UNKEYED, map files by their content."""
    args = {key: str(value) for key, value in simple_parse_args_string(arg_string).items() if key not in UNKEYED}
    for key in ("mapper", "disagree"):
        if key in args:
            args[key] = ":".join(file_hash(path) for path in args[key].split(":"))
    return hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]


def flag(args: list[str], name: str) -> int | None:
    """The index of `name`'s value in `args` (`--name value` or `--name=value`), None when absent."""
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            return index + 1
        if arg.startswith(name + "="):
            return index
    return None


def keyed_cache(args: list[str]) -> list[str]:
    """`args` of a kv-transfer run with `--use_cache PATH` keyed by the handoff its `--model_args` name
    (PATH_kv-<key>), and the model args checked for repeats."""
    model, at, model_at = flag(args, "--model"), flag(args, "--use_cache"), flag(args, "--model_args")
    if model is None or args[model].removeprefix("--model=") != "kv-transfer":
        return args
    model_args = "" if model_at is None else args[model_at].removeprefix("--model_args=")
    once(model_args)
    if at is None:
        return args
    return [*args[:at], f"{args[at]}_kv-{cache_key(model_args)}", *args[at + 1 :]]


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line, with `kv-transfer` registered by the import above, its request cache keyed by
    the handoff; then each model's route counts. Under torchrun the process group its model joined (`from_args`)
    is left here, when lm-eval is done with it. Run as a command (`entry`), a refusal of the project's (a bad model
    arg, a missing or corrupt map) is one `error:` line, exit 2."""
    args = list(argv if argv is not None else sys.argv[1:])
    if args[:1] == ["run"] and not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", default_device()]  # lm-eval's own default is cuda:0, even on a machine without one
    sys.argv = [sys.argv[0], *keyed_cache(args)]
    KVTransferLM.built = []
    try:
        cli_evaluate()
        built = KVTransferLM.built
    finally:
        KVTransferLM.built = None
    for lm in built:
        if lm.rank == 0:
            print("\n".join(lm.route_lines()))
    leave(launched_ranks())  # from_args's join: after lm-eval's last collective


if __name__ == "__main__":
    entry(main)  # the project's refusals (a bad model arg, a corrupt map, models it was not fitted on): one line
