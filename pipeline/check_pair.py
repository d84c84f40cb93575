"""`python -m pipeline.check_pair SOURCE TARGET`: the architecture contract of a pair, before any GPU hour.

SOURCE and TARGET are hub ids, local folders or `shape:<name>` (a stored real config, pipeline/store/configs); SOURCE
may be `self:<n>`, the target's first n decoder layers. Only configs and tokenizers are read, so it answers in seconds.
It prints both geometries, which handoff modes and mapper families are defined (and why not), the mapper sizes and the
FLOP bound on the handoff's TTFT speedup; it exits non-zero when the mapped handoff is refused.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.kv.contract import Contract, ModelCard, pair_contract, run_length, which_pairs_work
from pipeline.kv.families import FAMILIES, FITTED_FAMILIES
from pipeline.kv.flops import (
    handoff_macs,
    mapper_macs_per_token,
    mapper_parameter_count,
    matched_self_layers,
    repair_budget,
    source_scores_macs,
    speedup_bound,
)
from pipeline.kv.mapper import check_map_geometry, load_mapper
from pipeline.kv.pair import check_models
from pipeline.kv.repair import Repair
from pipeline.kv.rope import model_name
from pipeline.kv.speculative import SpeculativeParams
from pipeline.store import inputs
from pipeline.store.cli import entry, parser
from pipeline.store.fingerprints import PairFingerprints
from pipeline.store.models import ModelNotAvailableError, NoTokenizerError, load_config, load_tokenizer
from pipeline.store.params import PARAMS_FILE, ParamError, load_section, read_key
from pipeline.store.shapes import shape_config
from pipeline.store.truncated import self_layers, self_name, truncated_config
from pipeline.studies.format import md_table

SHAPE = "shape:"
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # qwen2/3_moe, mixtral, deepseek


def read(name: str):
    """(config, tokenizer or None) of a hub id, a local folder or a stored shape; never the weights."""
    if name.startswith(SHAPE):
        try:
            config = shape_config(name[len(SHAPE):])
        except ValueError as err:  # an unknown shape name: a typo to fix, one line
            raise ModelNotAvailableError(str(err)) from err
        config._name_or_path = name
        return config, None
    config = load_config(name)
    try:
        return config, load_tokenizer(name)
    except NoTokenizerError:  # a folder with a config alone: the contract says `unchecked`, never guesses
        return config, None


def read_source(name: str, target: tuple):
    """(config, tokenizer or None) of SOURCE: `self:<n>` is the target's (config, tokenizer) cut to n layers."""
    layers = self_layers(name)
    if layers is None:
        return read(name)
    return truncated_config(target[0], layers), target[1]


def matched_self_lines(source_config, target_config, lengths: list[int]) -> list[str]:
    """The `self:<n>` source whose prefill costs what the real source's does, per prompt length (kv.flops)."""
    by_layers: dict[int, list[int]] = {}
    for length in lengths:
        by_layers.setdefault(matched_self_layers(source_config, target_config, length), []).append(length)
    total = target_config.num_hidden_layers
    return [f"{self_name(layers)} matches the source's prefill cost at {', '.join(map(str, at))} tokens (the "
            f"target's first {layers} of {total} layers): the no-second-model baseline at equal cost"
            for layers, at in by_layers.items()]


def rotary_cell(card: ModelCard) -> str:
    if card.rotary is None:
        return "—"
    spec = card.rotary
    scaling = ", ".join(f"{key} {value:g}" for key, value in spec.scaling)
    return f"{spec.rope_type}, theta {spec.theta:g}" + (f" ({scaling})" if scaling else "")


def geometry_cell(card) -> str:
    if card.geometry is None:
        return "—"
    return f"{card.geometry['layers']} / {card.geometry['kv_heads']} / {card.geometry['head_dim']}"


def model_rows(contract: Contract) -> list[list[object]]:
    source, target = contract.source, contract.target
    return [["model", source.name, target.name], ["family", source.model_type, target.model_type],
            ["layers / KV heads / head_dim", geometry_cell(source), geometry_cell(target)],
            ["rotary", rotary_cell(source), rotary_cell(target)],
            ["verdict", source.refusal or "understood", target.refusal or "understood"]]


def size_rows(contract: Contract, source_config, target_config, ks: list[int],
              widths: dict[str, list[int]]) -> list:
    """Parameters and float32 size of every fitted family's map the pair defines, per k (and per inner size, for a
    family with one: `widths`; such a family without a width given is left out)."""
    rows = []
    for family in filter(contract.family_defined, FITTED_FAMILIES):
        spec = FAMILIES[family]
        for width in (widths.get(family, []) if spec.width_name else [None]):
            label = family if width is None else f"{family} ({spec.width_name} {width})"
            for k in ks:
                count = mapper_parameter_count(source_config, target_config, k, family, width)
                rows.append([label, k, f"{count:,}", f"{4 * count / 2**20:,.1f} MiB"])
    return rows


def flop_rows(source_config, target_config, lengths: list[int]) -> list:
    per_token = mapper_macs_per_token(source_config, target_config, 1, "linear")
    rows = []
    for length in lengths:
        parts = handoff_macs(source_config, target_config, per_token, length)
        rows.append([length, f"{parts['source']:.3g}", f"{parts['map']:.3g}", f"{parts['step']:.3g}",
                     f"{speedup_bound(source_config, target_config, per_token, length):.2f}x"])
    return rows


def repair_rows(source_config, target_config, lengths: list[int], repairs: list[str],
                lookahead: SpeculativeParams | None) -> list:
    """Per repair setting (`kv.repair`): its budget and the linear k=1 handoff's bound with it, at each length (a policy
    ranking by the source counts its look-ahead scores, `lookahead`: params' `speculative` settings)."""
    per_token = mapper_macs_per_token(source_config, target_config, 1, "linear")
    rows = []
    for text in repairs:
        repair = Repair.parse(text)
        cells = []
        for length in lengths:
            scores = source_scores_macs(source_config, repair, lookahead, length)
            bound = speedup_bound(source_config, target_config, per_token, length, repair, scores)
            cells.append(f"{repair_budget(target_config, repair, length, scores):.1%} / {bound:.2f}x")
        rows.append([str(repair), *cells])
    return rows


def report(contract: Contract, source_config, target_config, ks: list[int], lengths: list[int],
           widths: dict[str, list[int]], repairs: list[str], lookahead: SpeculativeParams | None) -> str:
    note = f" ({contract.tokenizer_note})" if contract.tokenizer_note else ""
    lines = [f"# {contract.source.name} -> {contract.target.name}", "",
             md_table(["", "source", "target"], model_rows(contract)), "",
             f"tokenizers: {contract.tokenizers}{note}", "",
             md_table(["mode", "defined"], [[mode, reason or "yes"] for mode, reason in contract.modes.items()]), "",
             md_table(["mapper family", "defined"],
                      [[family, reason or "yes"] for family, reason in contract.families.items()])]
    sizes = size_rows(contract, source_config, target_config, ks, widths)
    if sizes:
        lines += ["", md_table(["family", "k", "parameters", "float32 size"], sizes)]
    routed = [config for config in (source_config, target_config) if any(getattr(config, key, None)
                                                                         for key in EXPERT_KEYS)]
    if contract.defined("mapped") and routed:  # kv.flops counts one dense MLP of intermediate_size per layer
        lines += ["", f"No FLOP bound: the FLOP model (kv.flops) counts a dense MLP, and "
                  f"{' and '.join(repr(model_name(config)) for config in routed)} route each token to a few of "
                  f"their experts."]
    elif contract.defined("mapped"):
        lines += ["", "Multiply-adds of the handoff (linear map, k=1) and the FLOP bound on its TTFT speedup over "
                  "the target's prefill:", "",
                  md_table(["prompt tokens", "source prefill", "map", "target step", "speedup bound"],
                           flop_rows(source_config, target_config, lengths))]
        if self_layers(contract.source.name) is None:
            lines += ["", *matched_self_lines(source_config, target_config, lengths)]
        if repairs:
            lines += ["", "With a repair (kv.repair): its budget (of the target's prefill) / the speedup bound:", "",
                      md_table(["repair", *(f"{length} tokens" for length in lengths)],
                               repair_rows(source_config, target_config, lengths, repairs, lookahead))]
    return "\n".join(lines)


def mapper_lines(path: Path, source: str, target: str, source_config, target_config, allow: bool) -> list[str]:
    """The map at `path` checked as `kv.pair.Pair.handoff` does (its models' fingerprints, its KV geometry): a
    mismatch is refused in one line; else what was checked (with `allow`, how the models differ)."""
    if any(name.startswith(SHAPE) for name in (source, target)):
        raise ParamError(f"--mapper: a {SHAPE}<name> model has no weights or tokenizer to check a map against; give "
                         f"model folders or hub ids")
    mapper = load_mapper(path)
    check_map_geometry(mapper, source_config, target_config, f"source {source!r} and target {target!r}")
    difference = check_models(str(path), mapper.models, PairFingerprints(source, target), allow)
    lines = [f"map {path}: {mapper.family} k={mapper.k}, KV geometry {mapper.source_geometry} -> "
             f"{mapper.target_geometry}: the pair's"]
    if difference:
        return lines + [f"other models allowed (--allow-other-models): {difference}"]
    return lines + [f"map {path}: fitted on these models (weights, config, generation config and tokenizer of both)"]


def as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def default_ks(given: list[int] | None, source_layers: int, source: str) -> tuple[list[int], list[int]]:
    """(ks, left out): --ks as given, each within the source's layers; else params' fit.ks, less those beyond a
    shallower source (a `self:<n>` this tool suggests), which are left out rather than refused."""
    if given:
        return inputs.ks(given, "--ks", source_layers, source), []
    name = "fit.ks (params.yaml; or give --ks)"
    ks = [inputs.at_least(k, name, 1) for k in read_key("fit.ks")]
    within = [k for k in ks if k <= source_layers]
    return inputs.ks(within or [1], name, source_layers, source), [k for k in ks if k > source_layers]


def declared_repairs(given: list[str] | None) -> tuple[list[str], SpeculativeParams | None]:
    """The repair settings counted (`--repairs`, else params' repair.grid) and params' `speculative` settings, which
    a policy ranking by the source reads (None without a params.yaml)."""
    if not PARAMS_FILE.is_file():
        return given or [], None
    return given or read_key("repair.grid"), load_section(SpeculativeParams, "speculative")


def main(argv: list[str] | None = None) -> None:
    cli = parser("pipeline.check_pair", __doc__)
    cli.add_argument("source", nargs="?", help="source model: hub id, local folder or shape:<name>")
    cli.add_argument("target", nargs="?", help="target model: hub id, local folder or shape:<name>")
    cli.add_argument("--which-pairs", action="store_true", help="print 'Which pairs work' (docs/) and exit")
    cli.add_argument("--ks", type=int, nargs="+", help="source layers per target layer (default: fit.ks)")
    cli.add_argument("--lengths", type=int, nargs="+", help="prompt lengths (default: latency.lengths)")
    for family, spec in FAMILIES.items():
        if spec.width_name:
            cli.add_argument(f"--{family.replace('_', '-')}-{spec.width_name}", type=int, nargs="+",
                             dest=f"width_{family}", help=f"the {family} family's {spec.width_name} "
                             f"(default: {spec.width_param})")
    cli.add_argument("--repairs", nargs="+", help="repair settings to bound, e.g. sink:4+tokens:0.1:attention "
                     "(default: repair.grid of params.yaml, when there is one)")
    cli.add_argument("--max-tokens", type=int, help="the run's longest sequence, against which a sliding window "
                     "is checked (default: kv.contract.run_length of params.yaml; without one, the position range)")
    cli.add_argument("--mapper", type=Path, help="check this map against the pair: the models it was fitted on "
                     "(fingerprints) and its KV geometry")
    cli.add_argument("--allow-other-models", action="store_true", help="with --mapper: report a map fitted on "
                     "other models instead of refusing it")
    args = cli.parse_args(argv)
    if args.which_pairs:
        print(which_pairs_work())
        return
    if not args.target:
        cli.error("give a SOURCE and a TARGET model (or --which-pairs)")
    if self_layers(args.target) is not None:
        raise ParamError(f"TARGET {args.target}: self:<n> names a source cut from the target, so it goes first: "
                         f"check_pair {args.target} {args.source}")
    if args.allow_other_models and not args.mapper:
        cli.error("--allow-other-models goes with --mapper FILE (the map to check)")
    lengths = inputs.lengths(args.lengths or read_key("latency.lengths"),
                             "--lengths" if args.lengths else "latency.lengths (params.yaml; or give --lengths)")
    if args.max_tokens is not None:
        inputs.lengths([args.max_tokens], "--max-tokens")
    # without a params.yaml a family's inner size comes from its flag alone (none: its rows are left out)
    widths = {family: [inputs.at_least(width, f"--{family.replace('_', '-')}-{spec.width_name}", 1)
                       for width in as_list(getattr(args, f"width_{family}")
                                            or (read_key(spec.width_param) if PARAMS_FILE.is_file() else None))]
              for family, spec in FAMILIES.items() if spec.width_name}
    target_config, target_tokenizer = read(args.target)
    source_config, source_tokenizer = read_source(args.source, (target_config, target_tokenizer))
    if args.max_tokens is not None:
        inputs.within(args.max_tokens, "--max-tokens", min(config.max_position_embeddings for config in
                                                            (source_config, target_config)), "positions in the models")
    ks, left_out = default_ks(args.ks, source_config.num_hidden_layers, model_name(source_config))
    checked = (mapper_lines(args.mapper, args.source, args.target, source_config, target_config,
                            args.allow_other_models) if args.mapper else [])
    max_tokens = args.max_tokens or (run_length() if PARAMS_FILE.is_file() else max(
        config.max_position_embeddings for config in (source_config, target_config)))
    contract = pair_contract(target_config, source_config, target_tokenizer, source_tokenizer, max_tokens)
    repairs, lookahead = declared_repairs(args.repairs)
    print(report(contract, source_config, target_config, ks, lengths, widths, repairs, lookahead))
    if left_out:
        print(f"\nfit.ks {left_out} left out: beyond the source's {source_config.num_hidden_layers} layers "
              f"({model_name(source_config)}); --ks chooses")
    if checked:
        print("\n" + "\n".join(checked))
    contract.require("mapped")


if __name__ == "__main__":
    entry(main)
