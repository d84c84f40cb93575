"""Stages start fast: importing a stage (for its `--help`, or to refuse its arguments or params) or a schema module
(check_params reads them all) loads none of the heavy libraries; each module names them with `store.lazy.lazy`
(tests/store/test_lazy.py), imported at the first attribute read. Checked in a fresh interpreter per module, which
names the line that loaded a heavy library."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

from pipeline import STAGES

# not safetensors and huggingface_hub: each imports in about a millisecond (safetensors.torch and the hub client load
# at first use), so they are imported plainly
HEAVY = ("torch", "transformers", "lm_eval", "pandas", "numpy", "scipy", "matplotlib", "datasets")
TOOLS = ("check_pair", "generate")  # the user tools, whose --help should be as quick as a stage's

# run in a fresh interpreter: import the module, report {heavy library: "file:line" of the pipeline code whose
# import statement or lazy reference loaded it}
WATCH = """
import importlib, json, sys, traceback
heavy, module = json.loads(sys.argv[1]), sys.argv[2]
found = {name: "before the import" for name in heavy if name in sys.modules}

class Watch:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in heavy and top not in found:
            frames = [f for f in traceback.extract_stack() if "/pipeline/" in f.filename]
            found[top] = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "outside pipeline/"
        return None

sys.meta_path.insert(0, Watch())
importlib.import_module(module)
print(json.dumps(found))
"""


def heavy_imports(module: str) -> dict[str, str]:
    """{heavy library: where it was loaded} for a fresh `import module` in the repository root."""
    done = subprocess.run([sys.executable, "-c", WATCH, json.dumps(HEAVY), module], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return {name: where.replace(f"{ROOT}/", "") for name, where in json.loads(done.stdout).items()}


@pytest.mark.parametrize("module", [*STAGES, *TOOLS])
def test_importing_a_stage_loads_no_heavy_library(module):
    loaded = heavy_imports(f"pipeline.{module}")
    assert not loaded, (f"importing pipeline.{module} loads " + ", ".join(f"{name} ({where})" for name, where in
                        loaded.items()) + ": name it with store.lazy (`torch = lazy(\"torch\")`) in that module")


def test_the_watch_names_the_line_that_loads_a_heavy_library():
    loaded = heavy_imports("pipeline.lm_eval_model")  # the lm-eval face subclasses lm-eval's model: heavy by design
    assert loaded["lm_eval"].startswith("pipeline/lm_eval_model.py:")


def test_a_stages_library_is_imported_at_its_first_use_and_is_the_real_one():
    script = ("import sys; import pipeline.fit as fit; before = 'torch' in sys.modules; "
              "ones = fit.torch.ones(2); import torch; "
              "print(before, type(ones) is torch.Tensor, fit.torch.float64 is torch.float64)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True", "True"]
