"""The tiny world's tokenizer (`tiny.tokenizer`): rendered items round-trip and split at the word boundary, no
special tokens are added, and it has its BOS and EOS."""
import pytest
from transformers import AutoTokenizer

from pipeline.tiny.items import render_hellaswag, render_piqa
from pipeline.tiny.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(world):
    return train_tokenizer(world["corpus"].text)


def test_tokenizer_round_trips_rendered_items_and_splits_at_the_word_boundary(world, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for task, render in (("hellaswag", render_hellaswag), ("piqa", render_piqa)):
        for _, item in world[f"{task}_eval"].iterrows():
            query, choices, _ = render(item)
            context = tokenizer.encode(query)
            for choice in choices:
                whole = tokenizer.encode(f"{query} {choice}")
                assert whole[: len(context)] == context
                assert tokenizer.unk_token_id not in whole
                assert tokenizer.decode(whole) == f"{query} {choice}"
                assert reloaded.encode(f"{query} {choice}") == whole


def test_tokenizer_adds_no_special_tokens_and_has_bos_eos(tokenizer):
    assert tokenizer.encode("story: ann") == tokenizer.encode("story: ann", add_special_tokens=False)
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"
    assert len(tokenizer) < 128
