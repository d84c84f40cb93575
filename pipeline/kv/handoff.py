"""The handoff under the last-token protocol (PROTOCOL.md, "Handoff"), in every mode the study compares (`kv.modes`).
For context tokens c[0..n-1] and a continuation e:

    source body:  c[0] ... c[n-2]                 -> cache (no logits computed)
                  strip source RoPE -> map -> [shuffle] -> apply target RoPE -> cast to target dtype
    target:       cache + c[n-1] e[0] ... e[m-2]  -> logits scoring e[0] ... e[m-1]

A sparse cache (`speculative`) holds K slots whose positions are not 0..K-1, so every read after it is told the
positions. `keep` in (0, 1] reads only each context's last round(keep x n) tokens: the truncated-prompt baseline.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.kv.contract import LongerThanWindowError, sliding_window
from pipeline.kv.kvcache import Layers, Prefixes, layer_devices, layers_to_cache, real_slots
from pipeline.kv.mapper import Mapper
from pipeline.kv.modes import MODES, Built, ClockHook, Inputs, Prompt, tell
from pipeline.kv.repair import Repair
from pipeline.kv.rope import RotarySpec, model_name
from pipeline.kv.speculative import SpeculativeParams
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")
F = lazy("torch.nn.functional")
transformers = lazy("transformers")


@dataclass
class FirstStep:
    """A handoff's first step on a batch of contexts: what every later read continues from."""

    prefixes: Prefixes
    logits: torch.Tensor  # (B, V) the target's, in its dtype, at each context's last token c[n-1]
    cache: object  # the target's DynamicCache after the step: the prefix's P slots, then c[n-1]'s
    selected: torch.Tensor | None = None  # (B, K) the positions the target computed by a choice (`Built.selected`)

    @property
    def logprobs(self) -> torch.Tensor:
        """(B, V) float32 log-probabilities of the first token after each context."""
        return F.log_softmax(self.logits.float(), dim=-1)


class Handoff:
    """Builds the decoding model's prefix cache in one of MODES and reads tokens after it, right-padded or sparse."""

    def __init__(self, decoder, source=None, mode: str = "oracle", mapper: Mapper | None = None, shuffle_seed: int = 0,
                 repair: Repair = Repair(), keep: float | None = None, share: float | None = None,
                 speculative: SpeculativeParams | None = None):
        """Trusts what a request checked and the pair's contract allowed; `modes.Inputs` says what each means."""
        self.decoder, self.source, self.mode, self.mapper = decoder, source, mode, mapper
        self.kind = MODES[mode]
        handed = source if self.kind.reads.source and self.kind.reads.target else None  # the source works too
        windows = [sliding_window(model.config) for model in (decoder, handed) if model is not None]
        self.window = min((w for w in windows if w is not None), default=None)  # the longest sequence it may see
        self.decoder_spec = RotarySpec.from_model(decoder)
        self.decoder_devices = layer_devices(decoder)  # a decoder spread over devices: each layer's cache goes there
        self.repair, self.keep, self.share, self.speculative = repair, keep, share, speculative
        source_spec = RotarySpec.from_model(source) if self.kind.hands_over else None
        self.inputs = Inputs(decoder, source, mapper, repair, speculative, share, shuffle_seed, self.decoder_devices,
                             self.decoder_spec, source_spec)
        self.repaired = self.inputs.repaired  # what the repair made the target compute (kv.recompute)

    def check_length(self, tokens: int) -> None:
        """Refuse a sequence longer than a sliding window of the pair: the model masks attention past the window, a
        cache rebuilt from another model's does not."""
        if self.window is not None and tokens > self.window:
            raise LongerThanWindowError(
                f"a sequence of {tokens} tokens is longer than the sliding window ({self.window} tokens) of "
                f"{model_name(self.decoder.config)!r} or its source: shorten the profile's lengths or drop the item")

    @property
    def device(self):
        return self.decoder.device

    def slots(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) the cache slots that hold each prefix of real length `lengths` (B,)."""
        if not self.kind.sparse:
            return lengths
        return torch.tensor([self.speculative.kept(self.share, int(n)) for n in lengths.tolist()], dtype=lengths.dtype)

    def lengths_read(self, lengths: torch.Tensor, padded: bool) -> torch.Tensor | None:
        """The prefix lengths a read after the cache is told: where rows are padded or slots are not positions; None
        where neither (so the oracle's read is the plain one)."""
        return lengths if padded or bool((self.slots(lengths) != lengths).any()) else None

    def decoder_cache(self, layers: Layers | None, batch: int = 1):
        """A fresh cache of the decoding model holding `layers`; a batch-1 prefix is shared by `batch` rows."""
        if layers is None:
            return None
        if layers[0][0].shape[0] != batch:
            layers = [(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous())
                      for k, v in layers]
        return layers_to_cache(layers, self.decoder.config, self.decoder.dtype, self.decoder_devices or self.device)

    @no_grad
    def step_logprobs(self, layers: Layers | None, tokens: torch.Tensor,
                      prefix_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Log-probabilities (B, L, V), float32, of tokens (B, L) read after the prefix cache; with `prefix_lengths`
        (B,) its rows are right-padded and row b's tokens sit at positions prefix_lengths[b], ..."""
        return F.log_softmax(self.step_logits(layers, tokens, prefix_lengths).float(), dim=-1)

    def step_logits(self, layers: Layers | None, tokens: torch.Tensor,
                    prefix_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """`step_logprobs`' logits in the target's dtype, autograd as the caller set it (distillation)."""
        return self.forward(layers, tokens, prefix_lengths)[0]

    def forward(self, layers: Layers | None, tokens: torch.Tensor, prefix_lengths: torch.Tensor | None = None,
                logits_to_keep: int = 0, keep_cache: bool = False) -> tuple[torch.Tensor, object]:
        """The logits (B, L, V) and the cache, now holding the tokens too (`keep_cache`: a fresh one for no prefix)."""
        width = 0 if layers is None else layers[0][0].shape[2]
        self.check_length((width if prefix_lengths is None else int(prefix_lengths.max())) + tokens.shape[1])
        cache = self.decoder_cache(layers, tokens.shape[0])
        if cache is None and keep_cache:
            cache = transformers.DynamicCache(config=self.decoder.config)
        options = {}
        if prefix_lengths is not None and layers is not None:  # right-padded prefixes, each held in its slots
            steps = torch.ones(len(prefix_lengths), tokens.shape[1], dtype=torch.bool)  # (B, L)
            mask = torch.cat([real_slots(self.slots(prefix_lengths), width), steps], dim=1)  # (B, P + L)
            options = {"attention_mask": mask.long().to(self.device),
                       "position_ids": (prefix_lengths[:, None] + torch.arange(tokens.shape[1])[None]).to(self.device)}
        if logits_to_keep:
            options["logits_to_keep"] = logits_to_keep
        logits = self.decoder(input_ids=tokens.to(self.device), cache=cache, use_cache=cache is not None,
                             **options).logits
        return logits, cache

    def context(self, tokens) -> list[int]:
        """The part of a context c[0..n-1] this handoff reads: all of it, or its last round(keep x n) tokens (>= 1)."""
        tokens = list(tokens)
        return tokens if self.keep is None else tokens[-max(1, round(self.keep * len(tokens))):]

    @no_grad
    def prefix_layers(self, prefix_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> Layers | None:
        """Target-space cache for prefix_ids (B, P), right-padded to real `lengths` (B,); None for an empty prefix.
        Causal attention never lets a real token see the padding after it; the padded slots are masked by reads."""
        mask = None if lengths is None else real_slots(lengths, prefix_ids.shape[1]).long()  # (B, P)
        return self.built(prefix_ids, lengths, mask).layers

    def built(self, prefix_ids: torch.Tensor, lengths: torch.Tensor | None, mask: torch.Tensor | None,
              clock: ClockHook | None = None) -> Built:
        """The prefix cache of prefix_ids (B, P) in this handoff's mode; the rest as `modes.Prompt` says."""
        prefix_ids = prefix_ids.to(self.device)
        self.check_length(prefix_ids.shape[1])
        if prefix_ids.shape[1] == 0:
            return Built(None)
        return self.kind.build(self.inputs, Prompt(prefix_ids, lengths, mask, clock))

    @no_grad
    def first_step(self, prefixes: Prefixes, clock: ClockHook | None = None) -> FirstStep:
        """The prefix cache built and repaired, then the step on each context's last token c[n-1]. `clock(part)` is
        told as each part ends: `prefill`, `scores` (where read), `map`, `repair`, `sparse`, `step`."""
        layers, selected = self.built(prefixes.ids, prefixes.padded_lengths, prefixes.attention_mask, clock)
        logits, cache = self.forward(layers, prefixes.last, self.lengths_read(prefixes.lengths, prefixes.padded),
                                     logits_to_keep=1, keep_cache=True)
        logits = logits[:, -1]  # (B, V)
        logits.argmax(-1).tolist()  # the first tokens, on the host as a server would need them
        tell(clock, "step")
        return FirstStep(prefixes, logits, cache, selected)
