"""Cache <-> tensors (`kv.kvcache`): padded prefixes hold each prefix its real length, the one mask and the last
token."""
import torch

from pipeline.kv.kvcache import Prefixes, padded_prefixes


def test_padded_prefixes_hold_each_prefix_its_real_length_the_one_mask_and_the_last_token():
    prefixes = padded_prefixes([[5, 6, 7, 8], [9, 10], [11]])
    assert prefixes.ids.tolist() == [[5, 6, 7], [9, 0, 0], [0, 0, 0]] and prefixes.lengths.tolist() == [3, 1, 0]
    assert prefixes.mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]] and prefixes.last.tolist() == [[8], [10], [11]]
    assert prefixes.padded and prefixes.padded_lengths is prefixes.lengths
    whole = Prefixes.of(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert not whole.padded and whole.padded_lengths is None and whole.attention_mask is None
    assert whole.mask.tolist() == [[1, 1], [1, 1]] and whole.last.tolist() == [[3], [6]]
