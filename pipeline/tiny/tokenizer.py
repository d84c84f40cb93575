"""A word-level tokenizer for the tiny world, in Hugging Face format. Byte-level pre-tokenization (GPT-2's split: a
word keeps its leading space, `" ann"`) with one vocabulary entry per whole pre-token, so text round-trips exactly and
`context + " " + ending` splits at the word boundary: the context's tokens are a prefix of the whole's, which is how
lm-eval separates context from continuation. No special token is added on encoding (like Qwen3's): documents are
trained without BOS and end with EOS, and lm-eval scores them so."""
from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.store.lazy import lazy

transformers = lazy("transformers")

SPECIAL = {"unk_token": "<unk>", "pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def train_tokenizer(texts: Iterable[str]) -> transformers.PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=list(SPECIAL.values())))
    # clean_up_tokenization_spaces would turn " ." into "." on decode and break the round trip
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False, **SPECIAL)
