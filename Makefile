# Two commands a user needs: `make repro` (run the pipeline) and `make test` (run the tests).
# Both create .venv on first use; `make setup` alone is idempotent. `make test-fast` skips the end-to-end runs;
# `make lint` runs ruff (config in pyproject.toml); `make deps` rewrites each dvc.yaml stage's code deps (its modules
# as files, each wing it imports as one folder) from the imports of its module, last in the stage after cmd, params
# and outs (tools/stagedeps.py); `make gpu-check` is the prepared check for a machine with a GPU;
# `make bench-eval` times lm-eval's `hf` against the `kv-transfer` oracle on HellaSwag (tools/bench_eval.py);
# `make timings` times `make repro`, `make test` and `make test-fast` in a fresh clone of HEAD, on this .venv (install
# not counted), and writes timings.md, the README's figures (tools/timings.py; `--only`, `--out` there).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# dvc runs each stage's `python -m ...` through PATH: it must find this environment's python
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup repro test test-fast lint deps test-realshape gpu-check bench-eval timings clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

repro: setup
	DVC_NO_ANALYTICS=1 $(BIN)/dvc repro

# two pytest-xdist workers, each test file whole on one (its module fixtures built once), in conftest's order (the
# files with the most end-to-end runs first): tests/project/test_pipeline.py, whose stages use one thread each, on
# one core from the start while the rest of the suite takes the other
test: setup
	DVC_NO_ANALYTICS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-fast: setup
	DVC_NO_ANALYTICS=1 $(BIN)/python -m pytest -q -m 'not slow and not realshape'

lint: setup
	$(BIN)/ruff check pipeline tests tools

deps: setup
	$(BIN)/python tools/stagedeps.py

test-realshape: setup
	DVC_NO_ANALYTICS=1 $(BIN)/python -m pytest -q -s -m realshape

# on a machine with one GPU: qwen3-shapes through report in bf16, then TTFT at 512/2048/8192 tokens (tools/gpu_check.py)
gpu-check: setup
	DVC_NO_ANALYTICS=1 $(BIN)/python tools/gpu_check.py

# hf vs the kv-transfer oracle on 40 HellaSwag items at batch 1 and 16, a random 107M Llama, two threads (~3 min)
bench-eval: setup
	$(BIN)/python tools/bench_eval.py --items 40 --batch-sizes 1 16 --threads 2

# refused while tracked files have uncommitted changes: a clone of HEAD would not measure them
timings: setup
	$(BIN)/python tools/timings.py

clean-venv:
	rm -rf $(VENV)
