"""What each part of the target does on a calibration batch, the figures a sibling is cut by (`fitting.prune`).

One forward pass over the batch, with hooks on every decoder layer, measures at every real (unpadded) token:

    block influence   per layer, 1 - cosine(input hidden state, output hidden state) (ShortGPT, arXiv 2403.03853):
                      a layer that turns the residual stream least is the cheapest to drop
    MLP channels      per layer and channel i, the mean squared norm of what the channel adds to the residual
                      stream, a_i^2 ||W_down[:, i]||^2 (a_i = act(gate_i) up_i, the input of down_proj)
    query heads       per layer and head h, the mean squared norm of what the head adds, ||W_o[:, h] o_h||^2
                      (o_h: the head's attention output, the input of o_proj)

The last two are activation importance (Minitron, arXiv 2407.14679) measured where the unit's output meets the
residual stream, so a channel with large activations but a small down-projection column ranks low.
"""
from __future__ import annotations

from typing import NamedTuple

from pipeline.kv.geometry import kv_geometry
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")


class Importance(NamedTuple):
    influence: list[float]  # per decoder layer
    channels: torch.Tensor  # (L, intermediate) float64: each MLP channel's mean squared contribution
    heads: torch.Tensor  # (L, query heads) float64: each query head's mean squared contribution


def decoder_layers(model):
    return getattr(model, model.base_model_prefix).layers


def _first_input(args: tuple, kwargs: dict, name: str):
    return args[0] if args else kwargs[name]


class _Sums:
    """Per-layer sums over the real tokens of every batch seen, and the token count they divide by."""

    def __init__(self, layers: int, channels: int, heads: int):
        self.cosine = [0.0] * layers
        self.channels = torch.zeros(layers, channels, dtype=torch.float64)  # (L, I)
        self.heads = torch.zeros(layers, heads, dtype=torch.float64)  # (L, H)
        self.tokens, self.mask = 0, None

    def masked_sum(self, values):
        """`values` (B, T, ...) summed over the real tokens of the current batch: (...)."""
        mask = self.mask.to(values.dtype).reshape(*self.mask.shape, *[1] * (values.dim() - 2))  # (B, T, 1...)
        return (values * mask).sum(dim=(0, 1))


def _hooks(model, sums: _Sums) -> list:
    heads, head_dim = model.config.num_attention_heads, kv_geometry(model.config)["head_dim"]
    handles = []
    for index, layer in enumerate(decoder_layers(model)):
        def turn(module, args, kwargs, output, index=index):
            before = _first_input(args, kwargs, "hidden_states")  # (B, T, hidden)
            after = output[0] if isinstance(output, tuple) else output  # (B, T, hidden)
            cosine = torch.nn.functional.cosine_similarity(before.float(), after.float(), dim=-1)  # (B, T)
            sums.cosine[index] += float(sums.masked_sum(cosine))

        def channel(module, args, index=index):
            active = args[0].double()  # (B, T, I): the input of down_proj
            column_norms = module.weight.double().square().sum(0)  # (I,) ||W_down[:, i]||^2
            sums.channels[index] += sums.masked_sum(active.square()) * column_norms

        def head(module, args, index=index):
            batch, tokens, _ = args[0].shape
            per_head = args[0].double().view(batch, tokens, heads, head_dim)  # (B, T, H, D)
            weight = module.weight.double().view(-1, heads, head_dim)  # (hidden, H, D): W_o's columns by head
            gram = torch.einsum("ohd,ohe->hde", weight, weight)  # (H, D, D): ||W_h o||^2 = o^T gram_h o
            added = torch.einsum("bthd,hde,bthe->bth", per_head, gram, per_head)  # (B, T, H)
            sums.heads[index] += sums.masked_sum(added)

        handles.append(layer.register_forward_hook(turn, with_kwargs=True))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(channel))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(head))
    return handles


@no_grad
def importance(model, batches) -> Importance:
    """Block influence, MLP channel and query head importance of `model` over every real token of `batches`
    ((input_ids, attention_mask) pairs, (B, T) each)."""
    config = model.config
    sums = _Sums(config.num_hidden_layers, config.intermediate_size, config.num_attention_heads)
    handles = _hooks(model, sums)
    try:
        for input_ids, attention_mask in batches:
            sums.mask = attention_mask
            sums.tokens += int(attention_mask.sum())
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return Importance([1.0 - total / sums.tokens for total in sums.cosine], sums.channels / sums.tokens,
                      sums.heads / sums.tokens)
