"""lm-eval's model over a `kv.router.Router`: tasks scored by the target after a KV-cache handoff, on the tokens
lm-eval's stock `hf` would score (its `TemplateLM` split). Every request's route is recorded, so a result says what
served each."""
from __future__ import annotations

import logging

import jinja2
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from pipeline.kv.decode import decode
from pipeline.kv.handoff import Handoff
from pipeline.kv.modes import OWN_MODES
from pipeline.kv.router import Router
from pipeline.kv.routes import CACHED, served_by
from pipeline.measure.ledger import Ledger, RequestCache, count_lines
from pipeline.store.params import ParamError
from pipeline.store.ranks import ONE_PROCESS, Ranks

DEFAULT_MAX_GEN_TOKS = 256

log = logging.getLogger(__name__)

def refuse_without_chat_template(tokenizer) -> None:
    if tokenizer.chat_template is None:
        raise ParamError(f"kv-transfer: --apply_chat_template needs a chat template, and the tokenizer of "
                         f"{tokenizer.name_or_path} has none; leave the flag out or use a chat model")


def greedy_options(gen_kwargs: dict, eos: str, max_length: int) -> tuple[list[str], int]:
    """(stop sequences, max_gen_toks) of a generate_until request, refused where `hf` refuses it or it samples."""
    options = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
    until = handle_stop_sequences(options.pop("until", None), eos=eos)
    max_new = int(options.pop("max_gen_toks"))
    if max_new >= max_length:
        raise ParamError(f"kv-transfer: generate_until asks max_gen_toks={max_new}, which leaves no position for the "
                         f"prompt in the {max_length} positions (max_length); give --gen_kwargs max_gen_toks=N with "
                         f"N < {max_length}")
    if options.get("do_sample") or float(options.get("temperature") or 0) > 0:
        raise ParamError(f"kv-transfer decodes greedily, and this generate_until asks for sampling "
                         f"({ {key: options.get(key) for key in ('do_sample', 'temperature')} }); give --gen_kwargs "
                         f"do_sample=false,temperature=0")
    return until, max_new


class TargetTokensLM(TemplateLM):
    """lm-eval's model's text side as its stock `hf` has it (tokenizer, special tokens, chat template, split)."""

    def __init__(self, tokenizer, max_length: int):
        super().__init__()
        self.tokenizer, self._max_length = tokenizer, max_length

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
    def tokenizer_name(self) -> str:
        # lm-eval puts this name in its request-cache file names, hence no slashes (as `hf`)
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """As lm-eval's `hf` renders it (`chat_template(...)`, which lm-eval records, is TemplateLM's)."""
        refuse_without_chat_template(self.tokenizer)

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


class HandoffLM(TargetTokensLM):
    """lm-eval's model whose every request goes through `router` (answered from `cache` where it holds the answer)."""

    def __init__(self, router: Router, tokenizer, max_length: int | None = None, ranks: Ranks = ONE_PROCESS,
                 cache: RequestCache | None = None):
        """`max_length`: the window contexts are truncated to (default: the target's positions)."""
        if not isinstance(router, Router):  # a handoff alone: Router(handoff, batch_size) routes it
            raise TypeError(f"HandoffLM reads a kv.router.Router, not {type(router).__name__}")
        self.router = router
        super().__init__(tokenizer, max_length or self.handoff.decoder.config.max_position_embeddings)
        self.batch_size = router.batch_size
        self.ledger, self.cache = Ledger(), cache
        self._ranks, self._rank, self._world_size = ranks, ranks.rank, ranks.size
        self._served, self._tokens = {}, {}  # while `loglikelihood` runs, per request: its route, its scored ids
        self._gathered = False  # the routes gathered since the last requests (by the first `gather_object`)

    @property
    def handoff(self) -> Handoff:
        return self.router.handoff

    def set_cache_hook(self, cache_hook) -> None:
        # lm-eval's CachingLM (simple_evaluate's use_cache) keys its file by path alone: another handoff's answers
        if getattr(cache_hook, "dbdict", None) is not None:
            raise ParamError("kv-transfer: lm-eval's use_cache keys its file by its path alone, so it would serve one "
                             "handoff's answers to another; give --use_cache PATH to python -m pipeline.lm_eval_model "
                             "run (keyed by the handoff), or build the model with a RequestCache")
        super().set_cache_hook(cache_hook)

    # lm-eval's rank contract: each rank gets every N-th document, request counts padded to equal (all_gather); once
    # all are served, samples and metrics gather on rank 0 (gather_object), the routes with them, before model info
    def all_gather(self, tensor):
        return self._ranks.all_gather_tensor(tensor)

    def gather_object(self, obj, dst: int = 0):
        if not self._gathered:
            self.ledger.gather(self._ranks)
            self._gathered = True
        return self._ranks.gather(obj, dst)

    def barrier(self) -> None:
        self._ranks.barrier()

    @property
    def device(self):
        return self.handoff.device

    def route_counts(self) -> dict[str, dict[str, int]]:
        """Per task: its requests and how many went each way (CACHED too under a cache; zeros included)."""
        return self.ledger.counts(self.router.ways() + ([CACHED] if self.cache is not None else []))

    def route_record(self) -> dict:
        """The router's record, the counts per task, and each document's routes where any is not the handoff's own."""
        own = served_by(self.handoff.mode, self.router.repaired)
        cached = {} if self.cache is None else {"cached": self.ledger.cached(), "cache": self.cache.path}
        return {**self.router.record(), "routes": self.route_counts(), **cached,
                "requests": self.ledger.by_document(keep=lambda routes: any(route.way != own for route in routes))}

    def get_model_info(self) -> dict:
        return {"kv_transfer": self.route_record()}

    def route_lines(self) -> list[str]:
        return count_lines(f"transfer={self.handoff.mode}, repair={self.handoff.repair}", self.route_counts(),
                           self.ledger.cached())

    def served(self, kind: str, requests: list, answer) -> list:
        self._gathered = False
        return answer(requests) if self.cache is None else self.cache.serve(kind, requests, answer, self.ledger)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        def answer(fresh: list) -> list:
            self._served, self._tokens = {}, {}
            results = super(HandoffLM, self).loglikelihood(fresh, disable_tqdm)  # tokenized by TemplateLM
            for request in fresh:
                self.ledger.record(request, self._served[request.args], self._tokens[request.args])
            return results
        return self.served("loglikelihood", requests, answer)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        for request, _, continuation in requests:
            if len(continuation) > self.max_length:
                raise ParamError(f"kv-transfer max_length={self.max_length}: a continuation of {len(continuation)} "
                                 f"tokens ({request!r:.80}) does not fit; give max_length >= {len(continuation)} or "
                                 f"leave it out (the models' positions)")
        results, routes = self.router.score([(context, continuation) for _, context, continuation in requests],
                                            self.max_length, progress=not disable_tqdm)
        for (request, context, continuation), route in zip(requests, routes):
            if request is not None:
                self._served[request], self._tokens[request] = route, (list(context), list(continuation))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        mode = self.handoff.mode
        if mode not in OWN_MODES:
            raise ParamError(f"kv-transfer transfer={mode}: loglikelihood_rolling (a perplexity task such as wikitext) "
                             f"scores a document's first window from a one-token context, so nothing would be handed "
                             f"off; run it with transfer=oracle or transfer=source, and the handoff's perplexity with "
                             f"the pipeline's evaluate stage")
        return self.served("loglikelihood_rolling", requests, lambda fresh: [
            self.rolling_total(request, disable_tqdm) for request in tqdm(fresh, disable=disable_tqdm,
                                                                          desc="rolling loglikelihood")])

    def rolling_total(self, request, disable_tqdm: bool) -> float:
        """One document's log-likelihood summed over lm-eval's rolling windows, served by the model's own prefill."""
        (string,) = request.args
        windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
            token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
            context_len=1)]
        results, routes = self.router.score(windows, self.max_length, progress=False)
        self.ledger.record(request, routes[0])  # a model reading its own prefill: one way for every window
        return sum(ll for ll, _ in results)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return self.served("generate_until", requests, lambda fresh: [
            self.generated(request) for request in tqdm(fresh, disable=disable_tqdm, desc="generate_until")])

    def generated(self, request) -> str:
        """Greedy text after the context's handoff; the context left-truncated to what max_gen_toks leaves, as `hf`."""
        context, gen_kwargs = request.args
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        until, max_new = greedy_options(gen_kwargs, eos, self.max_length)
        context_ids, room = self.tok_encode(context), self.max_length - max_new
        if len(context_ids) > room:
            log.warning("kv-transfer: generate_until left-truncates a prompt of %d tokens to its last %d (max_length "
                        "%d less max_gen_toks %d): the rest of the prompt is not read; lower max_gen_toks to keep it",
                        len(context_ids), room, self.max_length, max_new)
            context_ids = context_ids[-room:]

        def should_stop(tokens: list[int]) -> bool:
            return tokens[-1] == self.eot_token_id or any(s in self.tok_decode(tokens) for s in until)

        self.ledger.record(request, self.router.route(context_ids))
        tokens = decode(self.handoff, context_ids, max_new, on_token=should_stop)
        return postprocess_generated_text(generation=self.tok_decode(tokens), stop=until, think_end_token=None)
