"""The lm-eval model `kv-transfer`: tasks scored by the target after a KV-cache handoff.

Importing this module registers the model. Tokenization and the context/continuation split come from
lm-eval's `TemplateLM`, exactly as for its stock `hf` model; only the scoring hook differs, and it runs the
last-token protocol of `pipeline.kv.handoff`. Model args (comma-separated `key=value`, as lm-eval passes them):

    target=<hub id or path>  source=<hub id or path>  transfer=oracle|direct|mapped|zero|shuffled
    mapper=<mapper file, for mapped>  dtype=float32|bfloat16|float16  device=cuda|cpu  batch_size=<int>
    target_revision=...  source_revision=...  shuffle_seed=<int>  max_length=<int>
    fallback=entropy|kl|disagree  threshold=<float>  disagree=<k=1 mapper file>:<k=max mapper file>
    repair=<kv.repair setting, e.g. sink:4+tokens:0.1:attention: the target recomputes part of the cache>
    allow_other_models=true|false  (default false: a map fitted on other models than target/source is refused)

With `fallback` (a `kv.gate` score) each context is scored from the handoff's first step (the map's cache, before
any repair) and falls back to the target's own prefill where its score exceeds `threshold`; `routes` keeps each
context's score and way.

Every request's route is recorded in `ledger` (`measure.routes`): lm-eval's results record the counts per task in
their `config` (`kv_transfer`: transfer, repair, gate score and threshold, `routes`), `run` prints them after
lm-eval's table, and with `--log_samples` each sample carries `route` (and `gate_score` under a gate), one per
request in the order of its `arguments`; requests lm-eval answers from its cache (`--use_cache`) are not counted.
Every arg is checked before any model is loaded (`checked_args`, by the rules of `store.inputs`).

lm-eval builds the model from them (`from_args`: a `kv.pair.Pair`, then its handoff); a stage that holds its
own Pair passes a handoff of it to `KVTransferLM(handoff, tokenizer, ...)` and scores many handoffs on models
loaded once.

lm-eval's `--apply_chat_template` and `--system_instruction` work as for `hf`: prompts are rendered by the
target tokenizer's chat template, then tokenized and handed off like any other prompt.

Under `torchrun --nproc_per_node N` (or `accelerate launch`) each process scores every N-th document and rank 0
gathers the results, through lm-eval's rank contract (rank, world_size, all_gather, gather_object, barrier);
the process group is joined when lm-eval builds the model (`from_args`) and left when its command line is done.

Run lm-eval's own command line with this model registered (`--device` defaults to the pipeline's choice:
cuda when there is one, else cpu; the README shows the hub and the local-task forms):

    python -m pipeline.lm_eval_model run --model kv-transfer \
        --model_args target=...,source=...,transfer=mapped,mapper=... --tasks hellaswag,piqa
"""
from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path

import jinja2
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm.auto import tqdm

from pipeline.kv.decode import greedy_generate
from pipeline.kv.gate import FITTED, SCORES, Gate, map_pair
from pipeline.kv.handoff import MAPPER_MODES, MODES, SOURCE_MODES, Handoff
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.scoring import score_continuations, truncate
from pipeline.measure.routes import EMPTY_PREFIX, FELL_BACK, REPAIRED, Ledger, Route, count_lines, recording_routes
from pipeline.store import inputs
from pipeline.store.cli import entry
from pipeline.store.devices import DTYPES
from pipeline.store.models import default_device
from pipeline.store.params import ParamError
from pipeline.store.ranks import ONE_PROCESS, Ranks, join, launched_ranks, leave

DEFAULT_MAX_GEN_TOKS = 256
AUTO_BATCH = 8  # batch_size=auto: lm-eval's search for the largest batch is not implemented; this is used instead

log = logging.getLogger(__name__)


@register_model("kv-transfer")
class KVTransferLM(TemplateLM):
    def __init__(self, handoff: Handoff, tokenizer, batch_size: int | str = 8, max_length: int | str | None = None,
                 ranks: Ranks = ONE_PROCESS, gate: Gate | None = None):
        """Score tasks through `handoff` (built by a stage's `kv.pair.Pair`, or by `from_args` from lm-eval's
        model args), tokenizing with the target's `tokenizer`; `ranks`: this process's place among several;
        `gate`: per context, the handoff or the target's own prefill (`kv.gate`)."""
        super().__init__()
        self.handoff, self.gate = handoff, gate
        self.routes: dict[tuple[int, ...], tuple[float, bool]] = {}  # gated context -> (score, fell back)
        self.ledger = Ledger()  # every Instance's route
        self.request_routes: dict[tuple[str, str], Route] = {}  # lm-eval's (context, continuation) -> its route
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else AUTO_BATCH
        self._max_length = int(max_length) if max_length else handoff.target.config.max_position_embeddings
        self._device = handoff.device
        self._ranks, self._rank, self._world_size = ranks, ranks.rank, ranks.size

    @classmethod
    def from_args(
        cls,
        target: str,
        source: str | None = None,
        transfer: str = "oracle",
        mapper: str | None = None,
        dtype: str = "float32",
        device: str | None = None,
        batch_size: int | str = 8,
        target_revision: str | None = None,
        source_revision: str | None = None,
        shuffle_seed: int | str = 0,
        max_length: int | str | None = None,
        fallback: str | None = None,
        threshold: float | str | None = None,
        disagree: str | None = None,
        repair: str | None = None,
        allow_other_models: bool | str = False,
        **unknown,
    ) -> "KVTransferLM":
        """The model lm-eval's model args name (the module docstring lists them): every arg checked
        (`checked_args`), then the pair, then its handoff."""
        if unknown:
            known = [arg for arg in inspect.signature(cls.from_args).parameters if arg != "unknown"]
            raise ParamError(f"kv-transfer: unknown model arg {sorted(unknown)[0]}= (known: {', '.join(known)})")
        checked = checked_args(transfer=transfer, mapper=mapper, dtype=dtype, device=device, batch_size=batch_size,
                               shuffle_seed=shuffle_seed, max_length=max_length, fallback=fallback,
                               threshold=threshold, disagree=disagree, allow_other_models=allow_other_models)
        setting = Repair.parse(repair) if repair is not None else None  # a malformed one before any loading
        ranks = join(device or default_device())  # under torchrun / accelerate launch: this rank's place
        device = ranks.device(device or default_device())
        # a given max_length is the run the contract judges a sliding window against; without one, as in the
        # stages, every handoff refuses a sequence longer than the window when it comes (Handoff.check_length)
        pair = Pair(target, source if transfer in SOURCE_MODES else None, dtype, device,
                    target_revision=target_revision, source_revision=source_revision,
                    max_tokens=checked["max_length"], allow_other_models=checked["allow_other_models"])
        if checked["max_length"] is not None:
            inputs.within(checked["max_length"], "kv-transfer max_length", pair.positions, "positions in the models")
        handoff = pair.handoff(transfer, mapper, shuffle_seed=checked["shuffle_seed"], repair=setting)
        gate = None if fallback is None else pair.gate(handoff, fallback, checked["threshold"],
                                                        map_pair(disagree) if disagree is not None else None)
        batch_size, max_length = checked["batch_size"], checked["max_length"]
        for difference in pair.other_models:  # the run's config records allow_other_models=true beside this
            log.warning("kv-transfer: allow_other_models=true: %s", difference)
        return cls(handoff, pair.target_tokenizer, batch_size, max_length, ranks, gate)

    # lm-eval's rank contract: under several processes it gives each rank every N-th document, pads the
    # ranks' request counts to equal (all_gather), and gathers samples and metrics on rank 0 (gather_object)
    def all_gather(self, tensor):
        return self._ranks.all_gather_tensor(tensor)

    def gather_object(self, obj, dst: int = 0):
        return self._ranks.gather(obj, dst)

    def barrier(self) -> None:
        self._ranks.barrier()

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "KVTransferLM":
        # lm-eval also passes its own --batch_size/--device; explicit model args win over them
        shared = {k: v for k, v in (additional_config or {}).items() if k in ("batch_size", "device") and v is not None}
        return cls.from_args(**{**shared, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "KVTransferLM":
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # as lm-eval's HFLM: BOS when the tokenizer has one, else EOS
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        # lm-eval puts this name in its request-cache file names, hence no slashes (as `hf`)
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """`chat_history` rendered as text by the target tokenizer's chat template, as lm-eval's `hf` renders it.
        `chat_template(...)`, the template lm-eval records, is TemplateLM's, read from the same tokenizer."""
        if self.tokenizer.chat_template is None:
            raise ValueError(f"kv-transfer: --apply_chat_template needs a chat template, and the tokenizer of "
                             f"{self.tokenizer.name_or_path} has none; leave the flag out or use a chat model")

        def render(messages: list[dict[str, str]]) -> str:
            # without a generation prompt the history ends in the task's assistant prefix, left open to continue
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            # as `hf`: a template that refuses a system turn gets the history without it
            log.warning("kv-transfer: the chat template of %s failed on this history; rendering it again without "
                        "the system message", self.tokenizer.name_or_path)
            return render([message for message in chat_history if message["role"] != "system"])

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos is not None and string.startswith(bos):
            options["add_special_tokens"] = False
        return self.tokenizer.encode(string, **options)

    def context_tokens(self, context: str, continuation: str) -> list[int]:
        """The context tokens lm-eval's `loglikelihood` gives `_loglikelihood_tokens` for this request."""
        if context:
            return self._encode_pair(context, continuation)[0]
        first = self.tok_encode(continuation, add_special_tokens=False)[:1]
        return [self.prefix_token_id] if [self.prefix_token_id] != first else first

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    @property
    def served_by(self) -> str:
        """The way of a request the handoff serves itself: its mode, or `repaired` under a repair setting."""
        return self.handoff.mode if self.handoff.repair.empty else REPAIRED

    def ways(self) -> list[str]:
        """Every way this model can send a request, in the order the counts list them."""
        return ([self.served_by] + ([EMPTY_PREFIX] if self.handoff.mode != "oracle" else [])
                + ([FELL_BACK] if self.gate is not None else []))

    def routed(self, contexts: list[list[int]]) -> list[Route]:
        """Each context's route (the gate's decisions recorded in `routes`)."""
        fell = self.route(contexts)
        scored = [self.routes[tuple(context)][0] if self.gate is not None else None for context in contexts]
        return [Route(FELL_BACK if fell_back else EMPTY_PREFIX if len(context) < 2 and self.handoff.mode != "oracle"
                      else self.served_by, score) for context, fell_back, score in zip(contexts, fell, scored)]

    def route_counts(self) -> dict[str, dict[str, int]]:
        """Per task: its requests and how many went each way (every way of `ways()`, zeros included)."""
        return self.ledger.counts(self.ways())

    def gather_routes(self) -> None:
        """Every rank's routes on rank 0 (a collective: every rank calls it once lm-eval has evaluated)."""
        self.ledger.gather(self._ranks)

    def get_model_info(self) -> dict:
        """What lm-eval records in its results' `config` beside the model args (lm-eval calls this on rank 0 after
        the evaluation): the transfer, the repair setting, the gate and each task's requests by route."""
        gate = None if self.gate is None else {"score": self.gate.score, "threshold": self.gate.threshold}
        return {"kv_transfer": {"transfer": self.handoff.mode, "repair": str(self.handoff.repair), "gate": gate,
                                "routes": self.route_counts()}}

    def route_lines(self) -> list[str]:
        """The counts as the `run` command prints them."""
        gate = "no gate" if self.gate is None else f"{FELL_BACK} where {self.gate.score} > {self.gate.threshold:g}"
        return count_lines(f"transfer={self.handoff.mode}, repair={self.handoff.repair}, {gate}", self.route_counts())

    def route(self, contexts: list[list[int]]) -> list[bool]:
        """Whether each context falls back to the target's own prefill (all False without a gate), recorded in
        `routes`."""
        if self.gate is None:
            return [False] * len(contexts)
        unseen = list(dict.fromkeys(tuple(context) for context in contexts if tuple(context) not in self.routes))
        if unseen:
            scores, fallback = self.gate.route(unseen, self.batch_size)
            self.routes.update(zip(unseen, zip(scores.tolist(), fallback.tolist())))
        return [self.routes[tuple(context)][1] for context in contexts]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = super().loglikelihood(requests, disable_tqdm)  # tokenized by TemplateLM, scored below
        for request in requests:
            self.ledger.record(request, self.request_routes[request.args])
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results, routes = self.scored(requests, disable_tqdm)
        for (request, _, _), result, route in zip(requests, results, routes):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, result)
                self.request_routes[request] = route
        return results

    def scored(self, requests, disable_tqdm: bool = False) -> tuple[list[tuple[float, bool]], list[Route]]:
        """lm-eval's tokenized requests (key, context, continuation) scored, each the way its route says."""
        pairs = [(context, continuation) for _, context, continuation in requests]
        routes = self.routed([truncate(context, continuation, self.max_length) for context, continuation in pairs])
        results: list = [None] * len(pairs)
        for handoff, fell_back in ((self.handoff, False), (self.gate and self.gate.fallback, True)):
            members = [index for index, route in enumerate(routes) if (route.way == FELL_BACK) == fell_back]
            if not members:
                continue
            scored = score_continuations(handoff, [pairs[index] for index in members], self.batch_size,
                                         max_length=self.max_length, progress=not disable_tqdm)
            for index, result in zip(members, scored):
                results[index] = result
        return results, routes

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for request in tqdm(requests, disable=disable_tqdm, desc="rolling loglikelihood"):
            (string,) = request.args
            windows = [
                (None, *make_disjoint_window(window))
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            results, routes = self.scored(windows, disable_tqdm=True)
            total = sum(ll for ll, _ in results)
            # every window has its own one-token context (context_len=1): one way, unless a gate splits them
            self.ledger.record(request, Route("+".join(dict.fromkeys(route.way for route in routes)),
                                       routes[0].score if len(routes) == 1 else None))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            totals.append(total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        outputs = []
        for request in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, gen_kwargs = request.args
            options = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_new = int(options.pop("max_gen_toks"))
            context_ids = self.tok_encode(context)[-(self.max_length - max_new) :]

            def should_stop(tokens: list[int]) -> bool:
                return tokens[-1] == self.eot_token_id or any(s in self.tok_decode(tokens) for s in until)

            route = self.routed([context_ids])[0]
            self.ledger.record(request, route)
            tokens = greedy_generate(self.gate.fallback if route.way == FELL_BACK else self.handoff, context_ids,
                                     max_new, should_stop)
            text = postprocess_generated_text(generation=self.tok_decode(tokens), stop=until, think_end_token=None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            outputs.append(text)
        return outputs


def checked_args(transfer, mapper, dtype, device, batch_size, shuffle_seed, max_length, fallback, threshold,
                 disagree, allow_other_models) -> dict:
    """The model args checked before any model work by `store.inputs`' rules, a failure one line naming the arg:
    {batch_size, shuffle_seed, max_length (None: the model's), threshold (None: no gate), allow_other_models}."""
    name = lambda arg: f"kv-transfer {arg}"  # noqa: E731
    inputs.choice(transfer, name("transfer"), MODES)
    if transfer == "mapped" and mapper is None:
        raise ParamError("kv-transfer transfer=mapped needs a mapper: give mapper=<mapper file>")
    files = {"mapper": [mapper] if transfer in MAPPER_MODES and mapper is not None else [],
             "disagree": list(map_pair(disagree) or []) if disagree is not None else []}
    missing = [(arg, file) for arg, names in files.items() for file in names if not Path(file).is_file()]
    if missing:
        raise ParamError(f"kv-transfer {missing[0][0]}: no mapper file at {missing[0][1]}; give one that fit, distill "
                         f"or select wrote (under models/)")
    inputs.choice(dtype, name("dtype"), DTYPES)
    if device is not None:
        inputs.device(str(device), name("device"))
    if fallback is None and (threshold is not None or disagree is not None):
        raise ParamError("kv-transfer threshold= and disagree= gate a handoff: give fallback=<score> too")
    if fallback is not None:
        inputs.choice(fallback, name("fallback"), [score for score in SCORES if score not in FITTED])
        if threshold is None:
            raise ParamError(f"kv-transfer fallback={fallback} needs threshold=<number> (falls back above it; -inf "
                             f"always, inf never)")
        if disagree is not None and map_pair(disagree) is None:
            raise ParamError(f"kv-transfer disagree={disagree!r}: name two mapper files as <k=1 file>:<k=max file>")
        if fallback == "disagree" and disagree is None:
            raise ParamError("kv-transfer fallback=disagree needs disagree=<k=1 file>:<k=max file>")
    allow = str(allow_other_models).lower()
    inputs.choice(allow, name("allow_other_models"), ("true", "false"))
    return {"batch_size": AUTO_BATCH if batch_size == "auto" else inputs.batch_size(batch_size, name("batch_size")),
            "shuffle_seed": inputs.at_least(shuffle_seed, name("shuffle_seed"), 0),
            "max_length": None if max_length is None else inputs.lengths([max_length], name("max_length"))[0],
            "threshold": None if threshold is None else inputs.threshold(threshold, name("threshold")),
            "allow_other_models": allow == "true"}


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line, with `kv-transfer` registered by the import above. Under torchrun the process
    group its model joined (`from_args`) is left here, when lm-eval is done with it. Run as a command (`entry`), a
    refusal of the project's (a bad model arg, a missing or corrupt map) is one `error:` line, exit 2."""
    args = list(argv if argv is not None else sys.argv[1:])
    if args[:1] == ["run"] and not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", default_device()]  # lm-eval's own default is cuda:0, even on a machine without one
    sys.argv = [sys.argv[0], *args]
    with recording_routes() as evaluated:
        cli_evaluate()
    for lm in evaluated:
        if lm.rank == 0:
            print("\n".join(lm.route_lines()))
    leave(launched_ranks())  # from_args's join: after lm-eval's last collective


if __name__ == "__main__":
    entry(main)  # the project's refusals (a bad model arg, a corrupt map, models it was not fitted on): one line
