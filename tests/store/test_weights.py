"""store.weights on a Llama-architecture checkpoint (no q/k norm; tied and untied heads): the tensors its
architecture has that the safetensors headers do not name, read before any weight loads."""
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.store.weights import missing_tensors, weight_files, weights_refusal


def llama_folder(root, tied: bool, drop: str | None = None):
    """A random tiny Llama saved as a checkpoint folder, with the tensor `drop` removed from its weights file."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(root)
    if drop is not None:
        weights = root / "model.safetensors"
        tensors = load_file(weights)
        del tensors[drop]
        save_file(tensors, weights, metadata={"format": "pt"})
    return root


@pytest.mark.parametrize("tied", [True, False])
def test_a_complete_llama_checkpoint_misses_nothing_with_its_head_tied_or_not(tmp_path, tied):
    folder = llama_folder(tmp_path, tied)
    assert missing_tensors(folder, weight_files(folder)) == [] and weights_refusal(folder) is None


def test_a_llama_checkpoint_missing_one_tensor_is_refused_naming_it(tmp_path):
    folder = llama_folder(tmp_path, False, drop="model.layers.1.self_attn.k_proj.weight")
    assert missing_tensors(folder, weight_files(folder)) == ["model.layers.1.self_attn.k_proj.weight"]
    assert weights_refusal(folder).startswith("lacks 1 tensor(s) of the architecture "
                                              "(model.layers.1.self_attn.k_proj.weight)")


def test_an_untied_head_left_out_is_missing_unless_the_architecture_lets_a_checkpoint_leave_it_out(tmp_path,
                                                                                                     monkeypatch):
    folder = llama_folder(tmp_path, False, drop="lm_head.weight")
    assert missing_tensors(folder, weight_files(folder)) == ["lm_head.weight"]
    monkeypatch.setattr(LlamaForCausalLM, "_keys_to_ignore_on_load_missing", [r"^lm_head\."])
    assert missing_tensors(folder, weight_files(folder)) == []
