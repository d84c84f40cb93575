"""`source_attention`: the repair recomputes the mapped cache's tokens the source's look-ahead attends to most, from
the scores of the forward that prefilled the source's cache; its cost is those scores' multiply-adds. A source built
to attend to one token (a constant query, a key read from one embedding feature that only that token carries, no
attention output or MLP to stir the residual stream) has that token recomputed, wherever it stands, and speculative
prefill keeps it; the first step names the positions it chose, which the selection recall reads."""
import pytest
import torch
from helpers import committed
from helpers.architectures import SUPPORTED, random_of

from pipeline.kv import flops
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import padded_prefixes
from pipeline.kv.repair import Repair
from pipeline.kv.speculative import SpeculativeParams
from pipeline.measure.retrieval import needle_selected
from pipeline.store.params import parse
from pipeline.store.shapes import pair_configs

LOOKAHEAD = parse(SpeculativeParams, committed("speculative", last=2, sinks=0), "speculative")
MARKED, FEATURE, WIDTH = 5, 0, 14  # the token the source attends to, the embedding feature only it carries


def attending_source():
    """A Qwen2 (q/k biases) whose every layer's every query attends to token MARKED: query = its bias, along the
    last head dim (RoPE's slowest pair: nearly unrotated over a few positions), key = the normed FEATURE."""
    model = random_of(SUPPORTED["qwen2"]())
    dim = model.config.head_dim if getattr(model.config, "head_dim", None) else 16
    with torch.no_grad():
        embedding = model.model.embed_tokens.weight  # (V, hidden)
        embedding[:, FEATURE] = 0.0
        embedding[MARKED, FEATURE] = 1.0
        for layer in model.model.layers:
            attention = layer.self_attn
            for projection in (attention.q_proj, attention.k_proj):
                projection.weight.zero_()
                projection.bias.zero_()
            attention.q_proj.bias.view(-1, dim)[:, -1] = 30.0  # (Hq, D): every head
            attention.k_proj.weight.view(-1, dim, model.config.hidden_size)[:, -1, FEATURE] = 30.0
            attention.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


@pytest.fixture(scope="module")
def models():
    target = random_of(SUPPORTED["qwen2"]())
    return target, attending_source()


def _prefix(at: int) -> torch.Tensor:
    ids = torch.arange(20, 20 + WIDTH)[None]  # (1, P): no token is MARKED
    ids[0, at] = MARKED
    return ids


@pytest.mark.parametrize("at", [3, 8])
def test_the_token_the_source_attends_to_scores_highest_and_is_the_one_recomputed(models, at):
    target, source = models
    prefix = _prefix(at)
    handoff = Handoff(target, source, "direct", repair=Repair.parse("tokens:0.07:source_attention"),
                      speculative=LOOKAHEAD)
    _, scores = handoff.scored_source_prefill(prefix, None)  # (1, P)
    assert int(scores[0, : WIDTH - LOOKAHEAD.last].argmax()) == at
    unrepaired = Handoff(target, source, "direct").prefix_layers(prefix)
    repaired = handoff.prefix_layers(prefix)
    oracle = Handoff(target).prefix_layers(prefix)
    keys, before = repaired[0][0][0], unrepaired[0][0][0]  # (H, P, D): layer 0
    changed = [slot for slot in range(WIDTH) if not torch.equal(keys[:, slot], before[:, slot])]
    assert changed == [at] and handoff.repaired.recomputed == 1  # round(0.07 x 14) = 1 token
    assert torch.allclose(repaired[0][0][0, :, at], oracle[0][0][0, :, at], atol=1e-5)  # layer 0: the token's own


def test_a_source_without_the_marked_token_chooses_elsewhere(models):
    target, source = models
    _, scores = Handoff(target, source, "direct", speculative=LOOKAHEAD).scored_source_prefill(
        torch.arange(20, 20 + WIDTH)[None], None)
    assert float(scores.max()) < 0.5  # no one token draws the look-ahead: the selection follows the source


def test_the_policy_is_refused_where_no_source_cache_is_handed_over_or_its_settings_are_missing(models):
    target, source = models
    with pytest.raises(ValueError, match="reads the source's scores, which the zero handoff does not make"):
        Handoff(target, mode="zero", repair=Repair.parse("tokens:0.1:source_attention"), speculative=LOOKAHEAD)
    with pytest.raises(ValueError, match="need the declared `speculative` settings"):
        Handoff(target, source, "direct", repair=Repair.parse("tokens:0.1:source_attention"))


def test_its_selection_costs_the_sources_look_ahead_scores():
    source, target = pair_configs("qwen3-v0")
    setting, scores = Repair.parse("tokens:0.1:source_attention"), flops.lookahead_macs(source, LOOKAHEAD, 1024)
    assert flops.repair_macs(target, setting, 1024, scores)["selection"] == scores > 0
    assert flops.repair_budget(target, setting, 1024, scores) > flops.repair_budget(
        target, Repair.parse("tokens:0.1:recency"), 1024)
    with pytest.raises(ValueError, match="its selection costs the source's look-ahead scores"):
        flops.repair_macs(target, setting, 1024)


@pytest.mark.parametrize("at", [3, 8])
def test_the_first_step_names_the_positions_it_chose_so_the_marked_token_is_selected_wherever_it_stands(models, at):
    target, source = models
    context = _prefix(at)[0].tolist() + [7]  # the prefix, then the last token the target steps on
    handoffs = {"source_attention": Handoff(target, source, "direct", speculative=LOOKAHEAD,
                                            repair=Repair.parse("tokens:0.07:source_attention")),
                "speculative": Handoff(target, source, "speculative", share=0.1, speculative=LOOKAHEAD),
                "recency": Handoff(target, source, "direct", repair=Repair.parse("sink:1+tokens:0.07:recency"))}
    chosen = {name: handoff.first_step(padded_prefixes([context])).selected[0].tolist()
              for name, handoff in handoffs.items()}
    assert chosen == {"source_attention": [at], "speculative": [at, WIDTH - 2, WIDTH - 1],  # p: 1 of 12, the last 2
                      "recency": [0, WIDTH - 1]}  # the sink, then the prefix's end
    assert needle_selected(chosen["source_attention"], context, [MARKED])
    assert needle_selected(chosen["speculative"], context, [MARKED])
    assert not needle_selected(chosen["recency"], context, [MARKED])
    assert Handoff(target, source, "direct").first_step(padded_prefixes([context])).selected is None  # none chosen
    assert Handoff(target).first_step(padded_prefixes([context])).selected is None
