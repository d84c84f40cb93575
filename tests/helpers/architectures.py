"""Tiny random models of every family the architecture contract accepts (their configs by name, `SUPPORTED`),
requests to score on them against a plain full forward, and a linear map of a model's cache to itself."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.kv.geometry import kv_geometry
from pipeline.kv.mapper import Mapper
from pipeline.kv.rope import RotarySpec

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}


def config_of(model_type: str, **extra):
    fields = {**SMALL, "num_key_value_heads": 2, **extra}
    if model_type == "gpt_neox":
        fields.pop("num_key_value_heads")
    config = AutoConfig.for_model(model_type, **fields)
    config._name_or_path = f"tiny-{model_type}"
    return config


def random_of(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


SUPPORTED = {
    "qwen3": lambda: config_of("qwen3", head_dim=16),
    "qwen2": lambda: config_of("qwen2"),
    "llama": lambda: config_of("llama", head_dim=16),
    "llama-3-scaling": lambda: config_of("llama", head_dim=16, rope_parameters=dict(LLAMA3)),
    "llama-yarn": lambda: config_of("llama", head_dim=16, rope_parameters=dict(YARN)),
    "llama-linear": lambda: config_of("llama", head_dim=16, rope_parameters={"rope_type": "linear",
                                                                             "rope_theta": 10000.0, "factor": 2.0}),
    "mistral-no-window": lambda: config_of("mistral", head_dim=16, sliding_window=None),
    "olmo2": lambda: config_of("olmo2"),
    # mixture of experts: the MLP is routed per token, the attention and the cache are the dense siblings'
    "qwen3-moe": lambda: config_of("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32),
    "qwen2-moe": lambda: config_of("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=64),
    "mixtral": lambda: config_of("mixtral", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=None),
}


def _requests(n_contexts=4, endings=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(n_contexts):
        context = torch.randint(0, VOCAB, (int(torch.randint(2, 40, (1,), generator=generator)),), generator=generator)
        for _ in range(endings):
            ending = torch.randint(0, VOCAB, (int(torch.randint(1, 6, (1,), generator=generator)),),
                                   generator=generator)
            requests.append((context.tolist(), ending.tolist()))
    return requests


def _full_forward_scores(model, requests):
    scores = []
    for context, continuation in requests:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([context + continuation])).logits.float(), -1)[0]
        rows = logprobs[len(context) - 1 : len(context) + len(continuation) - 1]  # position j-1 scores token j
        scores.append(rows.gather(-1, torch.tensor(continuation)[:, None]).sum().item())
    return scores


def linear_copy_mapper(model, noise: float, ridge_lambda: float, seed: int = 0) -> Mapper:
    """k=1 linear map from a model's cache to itself: target head h copies source head h, plus noise."""
    geometry = kv_geometry(model.config)
    heads, dim = geometry["kv_heads"], geometry["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(geometry["layers"]):
        weight = torch.zeros(heads, heads * dim, dim)
        for h in range(heads):
            weight[h, h * dim : (h + 1) * dim] = torch.eye(dim)
        weight += noise * torch.randn(weight.shape, generator=generator)
        pairs.append((weight, torch.zeros(heads, dim)))
    rotary = RotarySpec.from_config(model.config).to_dict()
    return Mapper("linear", "m", "m", geometry, geometry, rotary, rotary, k=1, ridge_lambda=ridge_lambda,
                  source_layers=[[layer] for layer in range(geometry["layers"])], keys=pairs,
                  values=[(w.clone(), b.clone()) for w, b in pairs])
