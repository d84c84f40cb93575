"""kv-handoff: cross-model KV-cache handoff between Qwen3 models, as a DVC pipeline.

One module per DVC stage (prepare_data, prepare_models, score_models, extract, fit, select, controls,
evaluate, report, latency) and the shared mechanics they use: `rope` (strip/apply rotary encoding),
`kvcache` (cache <-> tensors), `artifacts` (checksummed safetensors, atomic writes), `mapper` (source ->
target KV maps), `models` (loading), `handoff` (the last-token protocol and its modes), `lm_eval_model`
(the `kv-transfer` lm-eval model). See README.md.
"""
