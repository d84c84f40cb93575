"""The architecture contract: which handoff modes and mapper families a source/target pair defines, read from configs
(and tokenizers when given) before any weight loads. Config vocabulary sizes never decide tokenizers: Qwen2.5-7B pads
its embedding to 152,064 rows where the smaller sizes have 151,936, with one tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.kv.families import FAMILIES, Family
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.modes import MODES
from pipeline.kv.rope import STATIC_ROPE_TYPES, RotarySpec, model_name, rope_refusal
from pipeline.store.cli import Refusal
from pipeline.store.models import IncompatiblePairError, tokenizer_fingerprint
from pipeline.store.params import read_params

# families whose cache layout and rotary embedding the tests check end to end; the mixture-of-experts ones keep
# their dense siblings' attention and cache
TESTED_FAMILIES = ("llama", "mistral", "mixtral", "olmo2", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")


class UnsupportedModelError(Refusal, ValueError):
    pass


class LongerThanWindowError(Refusal, ValueError):
    pass


def sliding_window(config) -> int | None:
    """The sliding window that masks this model's attention, if any (one shorter than its position range)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window) if int(window) < config.max_position_embeddings else None


def _latent_attention(config, max_tokens):
    mla = [key for key in MLA_KEYS if getattr(config, key, None)]
    return f"uses multi-head latent attention ({mla[0]}={getattr(config, mla[0])})" if mla else None


def _mixed_layers(config, max_tokens):
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and len(set(layer_types)) > 1:
        return f"mixes attention types per layer ({', '.join(sorted(set(layer_types)))})"
    return None


def _active_window(config, max_tokens):
    # no run length: the handoff refuses each sequence longer than the window as it comes, naming it
    window = sliding_window(config)
    if window is None or max_tokens is None or window >= max_tokens:
        return None
    return (f"has a sliding window of {window} tokens, active at {max_tokens} tokens; run at most {window} tokens "
            f"(the profile's lengths, kv.contract.run_length; check_pair --max-tokens) or use a full-attention model")


def _untested_family(config, max_tokens):
    if getattr(config, "model_type", "?") not in TESTED_FAMILIES:
        return (f"is not a family whose cache layout the handoff is tested on ({', '.join(TESTED_FAMILIES)}); add it "
                f"to kv.contract.TESTED_FAMILIES with a test first")
    return None


# (feature, why it is refused, check), in this order; the sliding window, which a shorter run avoids, comes last
CONTRACT_RULES = (
    ("no `num_key_value_heads` (GPT-NeoX, GPT-2)",
     "the cache is not the per-layer (batch, kv_heads, tokens, head_dim) layout the handoff reads",
     lambda config, _: None if getattr(config, "num_key_value_heads", None) is not None
     else "has no num_key_value_heads"),
    ("multi-head latent attention (DeepSeek-V2/V3)",
     "the cache holds a compressed latent, not per-head keys and values", _latent_attention),
    ("per-layer attention types (Gemma 2/3, Qwen3 with `use_sliding_window`)",
     "the handoff needs one full-attention layout for every layer", _mixed_layers),
    ("RoPE it cannot strip exactly: partial rotary (Phi, StableLM, GPT-NeoX), length-dependent scaling (dynamic "
     "NTK, LongRoPE), per-layer-type RoPE, unknown types",
     "stripping and re-applying such a rotation would silently corrupt the cache",
     lambda config, _: rope_refusal(config)),
    ("a family not in the tested list", "its cache layout and rotary embedding are unverified", _untested_family),
    ("a sliding window shorter than the run (Mistral v0.1 past 4096 tokens)",
     "positions past the window are masked by the model but not by a rebuilt cache", _active_window),
)


def run_length(params: dict | None = None) -> int:
    """The longest sequence any stage of this profile feeds the models, from params (default: params.yaml); a null
    key counts for nothing. It judges a whole profile before any stage runs; the stages check a window where they
    feed sequences instead, so no stage reruns when a length it does not use changes."""
    params = read_params() if params is None else params

    def values(key: str) -> list[float]:
        section, name = key.split(".")
        found = (params.get(section) or {}).get(name)
        return [] if found is None else list(found) if isinstance(found, list) else [found]

    def longest(*keys: str) -> int:
        return int(max([0, *(value for key in keys for value in values(key))]))

    def after(prompt: int, *keys: str) -> int:
        return prompt + longest(*keys) if prompt else 0

    long = (params.get("data") or {}).get("long") or {}
    operating = max([0, *map(int, long.get("lengths") or {}), *values("select.prompt_lengths")])
    after_operating = operating + max([0, long.get("continuation") or 0, *values("select.continuation"),
                                       *values("operating.horizon"), *values("select.horizon")]) if operating else 0
    sequence = longest("data.sequence_length")
    select_context = max(2, int(sequence * max(values("select.prompt_fraction") or [0]))) if sequence else 0
    return max(sequence, after(select_context, "select.horizon"),
               after(longest("data.prompt_length"), "data.continuation_length", "evaluate.horizon", "controls.horizon"),
               after(longest("length.prompt_lengths"), "length.continuation", "length.horizon"),
               after_operating, longest("latency.lengths"), longest("candidates.length"))


def which_pairs_work() -> str:
    """The "Which pairs work" section of docs/real-weights.md, generated from the rules above."""
    lines = ["## Which pairs work", "",
             "Generated from the architecture contract (`pipeline/kv/contract.py`; `python -m pipeline.check_pair "
             "--which-pairs`). A pair is handled exactly when both models are full-attention decoders of a tested "
             f"family ({', '.join(f'`{family}`' for family in TESTED_FAMILIES)}: Qwen2/2.5, Qwen3, Llama 1-3, "
             "Mistral without an active window, OLMo2, and the mixture-of-experts Mixtral, Qwen2-MoE and "
             "Qwen3-MoE, whose attention and cache are those of their dense siblings) with RoPE of a static type "
             f"({', '.join(f'`{kind}`' for kind in STATIC_ROPE_TYPES)}: frequencies and attention factor are read "
             "from the model and checked against its own rotary buffer, in float32) and share one tokenizer "
             "(compared when both models' tokenizer files are there; otherwise `unchecked`, never decided from the "
             "configs' vocabulary sizes). `mapped` then works at any geometry; `direct` and the `identity` map need "
             "equal KV geometry, `head_matched` equal KV head counts. A sliding window counts when it is shorter "
             "than the run: the longest sequence the profile's params feed the models (`kv.contract.run_length`; "
             "`check_pair --max-tokens`). Everything else is refused before any weight is loaded, with one sentence "
             "naming the model and every feature that refuses it:", "",
             "| refused | why |", "|---|---|", *(f"| {feature} | {why} |" for feature, why, _ in CONTRACT_RULES)]
    return "\n".join(lines)


@dataclass(frozen=True)
class ModelCard:
    name: str
    model_type: str
    refusal: str | None
    geometry: dict | None = None
    rotary: RotarySpec | None = None

    @classmethod
    def read(cls, config, max_tokens: int | None = None) -> "ModelCard":
        """The refusal names every rule that refuses the model (so the advice of one is never given alone where
        another refuses too)."""
        details = [detail + ("" if "; " in detail else f": {why}")
                   for _, why, check in CONTRACT_RULES if (detail := check(config, max_tokens))]
        name, model_type = model_name(config), getattr(config, "model_type", "?")
        if details:
            return cls(name, model_type, f"model {name!r} ({model_type}) {details[0]}"
                       + "".join(f"; it also {detail}" for detail in details[1:]))
        return cls(name, model_type, None, kv_geometry(config), RotarySpec.from_config(config))


@dataclass(frozen=True)
class Contract:
    """Each mode and mapper family of a pair -> None (defined) or the reason it is not."""

    target: ModelCard
    source: ModelCard | None
    tokenizers: str  # identical | different | unchecked
    tokenizer_note: str = ""  # for `unchecked`: which tokenizer is missing and what the configs say
    modes: dict[str, str | None] = field(default_factory=dict)
    families: dict[str, str | None] = field(default_factory=dict)

    def defined(self, mode: str) -> bool:
        return self.modes[mode] is None

    def require(self, mode: str) -> None:
        reason = self.modes[mode]
        if reason is None:
            return
        model_refused = any(card is not None and card.refusal for card in (self.target, self.source))
        raise (UnsupportedModelError if model_refused else IncompatiblePairError)(
            f"transfer mode {mode!r} is not defined: {reason}")

    def family_defined(self, family: str) -> bool:
        return self.families[family] is None


def config_token_facts(source_config, target_config) -> str:
    """Which of vocabulary size and special token ids the configs differ in, as a clause. Only a hint: an embedding
    may be padded past the vocabulary; base and instruct models of one tokenizer name different EOS ids."""
    differ = [f"{key.removesuffix('_id').replace('_', ' ')} ids {left} vs {right}"
              for key in ("bos_token_id", "eos_token_id", "pad_token_id")
              if (left := getattr(source_config, key, None)) != (right := getattr(target_config, key, None))]
    if source_config.vocab_size != target_config.vocab_size:
        differ.insert(0, f"vocabulary sizes {source_config.vocab_size} vs {target_config.vocab_size}")
    if not differ:
        return "the configs agree on vocabulary size and special token ids"
    return f"the configs differ in {', '.join(differ)}"


def tokenizer_verdict(source_config, target_config, source_tokenizer, target_tokenizer) -> tuple[str, str | None, str]:
    """('identical' | 'different' | 'unchecked', the reason a pair is refused or None, a note): tokenizers decide."""
    names = f"source {model_name(source_config)!r} and target {model_name(target_config)!r}"
    if source_tokenizer is None or target_tokenizer is None:
        missing = " and ".join(f"{side} {model_name(config)!r}" for side, config, tokenizer in (
            ("source", source_config, source_tokenizer), ("target", target_config, target_tokenizer))
            if tokenizer is None)
        return "unchecked", None, f"no tokenizer for {missing}; {config_token_facts(source_config, target_config)}"
    if tokenizer_fingerprint(source_tokenizer) != tokenizer_fingerprint(target_tokenizer):
        return "different", (
            f"{names} have different tokenizers (vocabulary {len(source_tokenizer.get_vocab())} vs "
            f"{len(target_tokenizer.get_vocab())}, or special tokens differ); a cache handoff needs one tokenizer"), ""
    return "identical", None, ""


def _geometry_refusal(spec: Family, source: ModelCard, target: ModelCard) -> str | None:
    reason = spec.requirement(source.geometry, target.geometry)
    return reason and f"{reason} (source {source.name!r}, target {target.name!r})"


def _mode_refusal(mode, target: ModelCard, source: ModelCard | None, token_refusal: str | None) -> str | None:
    """Why `mode` cannot run on the target and source (None: none given)."""
    if not mode.reads.source:
        return target.refusal
    if source is None:
        return "no source model given"
    if not mode.reads.target:  # the source decodes alone
        return source.refusal or token_refusal
    return target.refusal or source.refusal or token_refusal or mode.requirement(source, target)


def pair_contract(target_config, source_config=None, target_tokenizer=None, source_tokenizer=None,
                  max_tokens: int | None = None) -> Contract:
    target = ModelCard.read(target_config, max_tokens)
    if source_config is None:
        modes = {name: _mode_refusal(mode, target, None, None) for name, mode in MODES.items()}
        return Contract(target, None, "unchecked", "no source model given", modes,
                        {family: "no source model given" for family in FAMILIES})
    source = ModelCard.read(source_config, max_tokens)
    tokenizers, token_refusal, note = tokenizer_verdict(source_config, target_config, source_tokenizer,
                                                        target_tokenizer)
    both = target.refusal or source.refusal or token_refusal
    modes = {name: _mode_refusal(mode, target, source, token_refusal) for name, mode in MODES.items()}
    families = {name: both or _geometry_refusal(spec, source, target) for name, spec in FAMILIES.items()}
    return Contract(target, source, tokenizers, note, modes, families)
