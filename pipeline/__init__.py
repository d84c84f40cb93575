"""kv-handoff: cross-model KV-cache handoff between Qwen3 models, as a DVC pipeline.

Shared mechanics: `rope` (strip/apply rotary encoding), `kvcache` (cache <-> tensors), `artifacts`
(checksummed safetensors, atomic writes), `mapper` (source -> target KV maps), `models` (loading),
`handoff` (the last-token protocol and its modes), `lm_eval_model` (the `kv-transfer` lm-eval model).
"""
