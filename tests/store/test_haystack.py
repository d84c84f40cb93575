"""Pass-key items in a real-text haystack (`store.haystack`): exactly the length, the key stated once, seeded."""
import pytest
from helpers import WIKITEXT

from pipeline.prepare_data import corpus_documents
from pipeline.store.haystack import RetrievalForm, occurrences, retrieval_items

FORM = RetrievalForm("\nThe pass key is {key}. Remember it.\n", "\nWhat is the pass key? The pass key is ", 5,
                     (0.1, 0.5, 0.9))


@pytest.fixture(scope="module")
def documents(tokenizer):
    texts = corpus_documents([{"text": WIKITEXT.read_text()}])
    return [(f"doc-{i}", tokenizer.encode(text)) for i, text in enumerate(texts) if len(tokenizer.encode(text)) > 300]


def test_items_are_exactly_their_length_and_state_the_key_once_at_their_depth(documents, tokenizer):
    items = retrieval_items(documents, 256, 6, FORM, tokenizer, seed=3)
    question = tokenizer.encode(FORM.question, add_special_tokens=False)
    for item in items.itertuples():
        prompt, answer = list(item.prompt_ids), list(item.continuation_ids)
        assert len(prompt) == 256 and answer == tokenizer.encode(item.key, add_special_tokens=False)
        assert occurrences(prompt, answer) == 1 and len(item.key) == 5 and item.key.isdigit()
        assert prompt[-len(question):] == question
        before, after = (tokenizer.encode(t, add_special_tokens=False) for t in FORM.needle.split("{key}"))
        needle = before + answer + after
        assert prompt[item.needle_at : item.needle_at + len(needle)] == needle
        haystack = 256 - len(needle) - len(question)
        assert item.needle_at == round(item.depth * haystack)
    assert list(items.depth) == [0.1, 0.5, 0.9, 0.1, 0.5, 0.9]
    assert items.doc_id.is_unique and items.content_hash.is_unique


def test_items_are_deterministic_from_the_seed(documents, tokenizer):
    first, again = (retrieval_items(documents, 200, 4, FORM, tokenizer, seed=1) for _ in range(2))
    assert first.to_dict("records") == again.to_dict("records")
    other = retrieval_items(documents, 200, 4, FORM, tokenizer, seed=2)
    assert list(other.key) != list(first.key)


def test_a_key_the_haystack_already_holds_is_drawn_again(documents, tokenizer):
    digits = RetrievalForm("\nThe pass key is {key}.\n", "\nThe pass key is ", 1, (0.5,))
    every_key = [token for digit in "0123456789" for token in tokenizer.encode(digit, add_special_tokens=False)]
    # every one-digit key is in this haystack: no draw states it only once
    with pytest.raises(ValueError, match="no key of 1 digits occurs only once"):
        retrieval_items([("doc-digits", every_key * 30)], 200, 1, digits, tokenizer, seed=0)
    # the same haystack without the digit "7": only the key 7 can be stated once, and it is the key drawn
    without = [token for token in every_key if token not in tokenizer.encode("7", add_special_tokens=False)]
    item = retrieval_items([("doc-digits", without * 30)], 200, 1, digits, tokenizer, seed=0).iloc[0]
    assert item.key == "7" and occurrences(list(item.prompt_ids), list(item.continuation_ids)) == 1


def test_a_document_shorter_than_the_haystack_is_refused_naming_it(documents, tokenizer):
    with pytest.raises(ValueError, match=r"document 'doc-short' \(40 tokens\) cannot hold a 256-token item"):
        retrieval_items([("doc-short", documents[0][1][:40])], 256, 1, FORM, tokenizer, seed=0)
