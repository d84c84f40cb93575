"""kv-handoff: cross-model KV-cache handoff between Qwen3 models, as a DVC pipeline.

Stages (one module each, `python -m pipeline.<stage>`, one `dvc.yaml` entry each: its Params, main(), the recipe):
    prepare_data    the sequence splits and task items under data/ (the tiny world, or hub/local datasets)
    prepare_models  the source/target pair under models/ (trained, pinned hub ids, or random real shapes)
    score_models    each model alone on the dev items (metrics/models.json)
    extract         one model's RoPE-stripped KV caches over the fit and select splits (caches/)
    fit             every candidate map, per target layer, from the caches (models/mappers/)
    select          the candidate that best reproduces the oracle on the select split (models/mapper.safetensors)
    controls        V0's six controls on the actual pair and mapper, before anything is evaluated
    evaluate        one variant of the handoff against the oracle and on the tasks (eval/, metrics/eval/)
    report          retention, paired statistics, gates and report.md
    latency         time to first token of the handoff against target prefill
The lm-eval face: `lm_eval_model` registers the lm-eval model `kv-transfer`.
The pair checker: `check_pair SOURCE TARGET` prints a pair's architecture contract from configs alone.

Wings (the method and its mechanics; a wing never imports a stage or the face). `WINGS` below is the one
import order: a module imports only modules before it, i.e. earlier wings and earlier modules of its own wing.
    store/    files and settings: checksummed artifacts, params, dtypes/devices, several processes (torchrun),
              split names, real shapes, model loading, sharded caches
    kv/       the method: RoPE, cache <-> tensors, the architecture contract (which pairs and modes are defined),
              the FLOP model, mappers, the handoff (last-token protocol)
    fitting/  ridge from streamed moments, the MLP trainer, layer probes, every candidate family per layer
    measure/  paired statistics, lm-eval tasks on local files, retention, agreement with the oracle, timing
              and latency
    tiny/     the embedded world: its tokenizer, its generator, and the training of the tiny pair
"""

WINGS = {
    "store": ("cli", "artifacts", "params", "devices", "ranks", "splits", "shapes", "models", "cachefiles"),
    "kv": ("rope", "kvcache", "contract", "flops", "mapper", "handoff"),
    "fitting": ("ridge", "mlpfit", "probes", "families"),
    "measure": ("stats", "tasks", "retention", "taskeval", "compare", "timing", "latency"),
    "tiny": ("tokenizer", "world", "train"),
}
