"""The architecture contract: for a source/target pair, which handoff modes and mapper families are defined.

Read from configs (and tokenizers when given) before any weight is loaded or any forward runs:

    oracle, zero   the target's cache layout is understood
    source         the source alone (its own cache and predictions): the source is understood, same tokenizer
    direct         both understood, same tokenizer, equal KV geometry (layers, KV heads, head_dim); rotary
                   settings may differ, the keys are re-encoded
    mapped,        both understood, same tokenizer (a shuffled cache without a mapper also needs equal geometry,
    shuffled       which the handoff checks when it knows whether a mapper is given)

A model is understood when it is a full-attention decoder of a tested family whose cache is per layer
(batch, kv_heads, tokens, head_dim), with RoPE whose frequencies do not depend on the sequence length. Every
other model is refused with one sentence naming it, the feature and what would be needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.kv.kvcache import kv_geometry
from pipeline.kv.rope import STATIC_ROPE_TYPES, RotarySpec, model_name, rope_refusal
from pipeline.store.cli import Refusal
from pipeline.store.models import IncompatiblePairError, tokenizer_fingerprint

# families whose cache layout and rotary embedding the tests check end to end (tests/test_contract.py)
TESTED_FAMILIES = ("llama", "mistral", "olmo2", "qwen2", "qwen3")
MODES = ("oracle", "zero", "source", "direct", "mapped", "shuffled")
MAPPER_FAMILIES = ("identity", "linear", "head_matched", "mlp")
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")


class UnsupportedModelError(Refusal, ValueError):
    pass


def active_window(config, max_tokens: int | None) -> int | None:
    """The sliding window that masks attention at `max_tokens` (default: the model's position range), if any."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window) if int(window) < (max_tokens or config.max_position_embeddings) else None


def _no_kv_heads(config, max_tokens):
    if getattr(config, "num_key_value_heads", None) is None:
        return "has no num_key_value_heads"
    return None


def _latent_attention(config, max_tokens):
    mla = [key for key in MLA_KEYS if getattr(config, key, None)]
    return f"uses multi-head latent attention ({mla[0]}={getattr(config, mla[0])})" if mla else None


def _mixed_layers(config, max_tokens):
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and len(set(layer_types)) > 1:
        return f"mixes attention types per layer ({', '.join(sorted(set(layer_types)))})"
    return None


def _active_window(config, max_tokens):
    window = active_window(config, max_tokens)
    if window is None:
        return None
    return (f"has a sliding window of {window} tokens, active at {max_tokens or 'its'} "
            f"{'tokens' if max_tokens else 'position range'}; run at most {window} tokens or use a full-attention "
            f"model")


def _rope(config, max_tokens):
    return rope_refusal(config)


def _untested_family(config, max_tokens):
    if getattr(config, "model_type", "?") not in TESTED_FAMILIES:
        return (f"is not a family whose cache layout the handoff is tested on ({', '.join(TESTED_FAMILIES)}); add it "
                f"to kv.contract.TESTED_FAMILIES with a test first")
    return None


# (feature, why it is refused, check): checked in this order; the first that applies is the model's refusal
RULES = (
    ("no `num_key_value_heads` (GPT-NeoX, GPT-2)",
     "the cache is not the per-layer (batch, kv_heads, tokens, head_dim) layout the handoff reads", _no_kv_heads),
    ("multi-head latent attention (DeepSeek-V2/V3)",
     "the cache holds a compressed latent, not per-head keys and values", _latent_attention),
    ("per-layer attention types (Gemma 2/3, Qwen3 with `use_sliding_window`)",
     "the handoff needs one full-attention layout for every layer", _mixed_layers),
    ("a sliding window shorter than the run (Mistral v0.1 past 4096 tokens)",
     "positions past the window are masked by the model but not by a rebuilt cache", _active_window),
    ("RoPE it cannot strip exactly: partial rotary (Phi, StableLM, GPT-NeoX), length-dependent scaling (dynamic "
     "NTK, LongRoPE), per-layer-type RoPE, unknown types",
     "stripping and re-applying such a rotation would silently corrupt the cache", _rope),
    ("a family not in the tested list", "its cache layout and rotary embedding are unverified", _untested_family),
)


def model_refusal(config, max_tokens: int | None = None) -> str | None:
    """Why this model's cache cannot be handed off (one sentence, naming the model); None when it can."""
    for feature, why, check in RULES:
        detail = check(config, max_tokens)
        if detail:
            prefix = f"model {model_name(config)!r} ({getattr(config, 'model_type', '?')})"
            return f"{prefix} {detail}" + ("" if "; " in detail else f": {why}")
    return None


def which_pairs_work() -> str:
    """README's "Which pairs work" section, generated from the rules above."""
    lines = ["## Which pairs work", "",
             "Generated from the architecture contract (`pipeline/kv/contract.py`; `python -m pipeline.check_pair "
             "--which-pairs`). A pair is handled exactly when both models are full-attention decoders of a tested "
             f"family ({', '.join(f'`{family}`' for family in TESTED_FAMILIES)}: Qwen2/2.5, Qwen3, Llama 1-3, "
             "Mistral without an active window, OLMo2) with RoPE of a static type "
             f"({', '.join(f'`{kind}`' for kind in STATIC_ROPE_TYPES)}: frequencies and attention factor are read "
             "from the model and checked against its own rotary buffer, in float32) and share one tokenizer. "
             "`mapped` then works at any geometry; `direct` and the `identity` map need equal KV geometry, "
             "`head_matched` equal KV head counts. Everything else is refused before any weight is loaded, with "
             "one sentence naming the model and the feature:", "",
             "| refused | why |", "|---|---|", *(f"| {feature} | {why} |" for feature, why, _ in RULES)]
    return "\n".join(lines)


@dataclass(frozen=True)
class ModelCard:
    """One side of a pair as the contract reads it from the config."""

    name: str
    model_type: str
    refusal: str | None
    geometry: dict | None = None
    rotary: RotarySpec | None = None

    @classmethod
    def read(cls, config, max_tokens: int | None = None) -> "ModelCard":
        refusal = model_refusal(config, max_tokens)
        if refusal:
            return cls(model_name(config), getattr(config, "model_type", "?"), refusal)
        return cls(model_name(config), config.model_type, None, kv_geometry(config), RotarySpec.from_config(config))


@dataclass(frozen=True)
class Contract:
    """What is defined for a pair: each mode and mapper family maps to None (defined) or the reason it is not."""

    target: ModelCard
    source: ModelCard | None
    tokenizers: str  # identical | different | unchecked
    modes: dict[str, str | None] = field(default_factory=dict)
    families: dict[str, str | None] = field(default_factory=dict)

    def defined(self, mode: str) -> bool:
        return self.modes.get(mode, f"unknown mode {mode!r}") is None

    def reason(self, mode: str) -> str | None:
        if mode not in self.modes:
            return f"unknown transfer mode {mode!r} (known: {', '.join(MODES)})"
        return self.modes[mode]

    def require(self, mode: str) -> None:
        """Refuse `mode` up front, in one sentence, unless the contract defines it."""
        reason = self.reason(mode)
        if reason is None:
            return
        model_refused = any(card is not None and card.refusal for card in (self.target, self.source))
        raise (UnsupportedModelError if model_refused else IncompatiblePairError)(
            f"transfer mode {mode!r} is not defined: {reason}")

    def family_defined(self, family: str) -> bool:
        return self.families.get(family, f"unknown family {family!r}") is None


def tokenizer_verdict(source_config, target_config, source_tokenizer, target_tokenizer) -> tuple[str, str | None]:
    """('identical' | 'different' | 'unchecked', the reason a pair is refused for its tokens or None)."""
    names = f"source {model_name(source_config)!r} and target {model_name(target_config)!r}"
    if source_tokenizer is not None and target_tokenizer is not None:
        if tokenizer_fingerprint(source_tokenizer) == tokenizer_fingerprint(target_tokenizer):
            return "identical", None
        return "different", (
            f"{names} have different tokenizers (vocabulary {len(source_tokenizer.get_vocab())} vs "
            f"{len(target_tokenizer.get_vocab())}, or special tokens differ); a cache handoff needs one tokenizer")
    if source_config.vocab_size != target_config.vocab_size:
        return "different", (f"{names} have different vocabulary sizes ({source_config.vocab_size} vs "
                             f"{target_config.vocab_size})")
    return "unchecked", None


def pair_contract(target_config, source_config=None, target_tokenizer=None, source_tokenizer=None,
                  max_tokens: int | None = None) -> Contract:
    """The contract of a pair (or of a target alone), from configs and, when given, tokenizers."""
    target = ModelCard.read(target_config, max_tokens)
    modes: dict[str, str | None] = {mode: "no source model given" for mode in MODES}
    modes["oracle"] = modes["zero"] = target.refusal
    if source_config is None:
        return Contract(target, None, "unchecked", modes, {family: "no source model given" for family in
                                                          MAPPER_FAMILIES})
    source = ModelCard.read(source_config, max_tokens)
    tokenizers, token_refusal = tokenizer_verdict(source_config, target_config, source_tokenizer, target_tokenizer)
    both = target.refusal or source.refusal or token_refusal
    modes["source"] = source.refusal or token_refusal
    modes["mapped"] = modes["shuffled"] = both
    modes["direct"] = both or (None if source.geometry == target.geometry else (
        f"direct injection needs equal KV geometry, but source {source.name!r} has {source.geometry} and target "
        f"{target.name!r} has {target.geometry}; use a fitted mapper (transfer=mapped)"))
    families = {"linear": both, "mlp": both, "identity": modes["direct"]}
    families["head_matched"] = both or (
        None if source.geometry["kv_heads"] == target.geometry["kv_heads"] else
        f"head_matched needs equal KV head counts, but source {source.name!r} has {source.geometry['kv_heads']} "
        f"and target {target.name!r} has {target.geometry['kv_heads']}")
    return Contract(target, source, tokenizers, modes, families)
