"""Peak host memory of extract and fit at the exact Qwen3-0.6B / 1.7B shapes (random weights), in subprocesses.

Real-shape and long (about 25 minutes on two cores), so not part of the default run:
`make test-realshape` prints the figures. Extraction and fit run the exact configs (28 layers, 8 KV heads x
head_dim 128, vocab 151936) over 50 fit and 25 select sequences (16 tokens each: time, not memory, grows
with length, since shards bound what is held), with k up to 8 (8192-wide float64 moments per layer).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT as REPO
from helpers import merge

LIMIT_MIB = 16 * 1024
SETUP = """
import sys, torch, pandas as pd
from pathlib import Path
from pipeline.store.shapes import random_model, shape_config
root, layers, config = Path(sys.argv[1]), int(sys.argv[2]), eval(sys.argv[3])
for name, shape in (('source', 'qwen3-0.6b'), ('target', 'qwen3-1.7b')):
    cfg = shape_config(shape)
    cfg.num_hidden_layers = layers
    random_model(cfg, 'bfloat16', 'cpu', seed=0).save_pretrained(root / 'models' / name)
for split, count in (('fit', 50), ('select', 25)):
    g = torch.Generator().manual_seed(len(split))
    rows = [dict(doc_id=f'{split}-{i}', text='',
                 token_ids=torch.randint(0, 151936, (config['length'],), generator=g).tolist(),
                 content_hash=str(i)) for i in range(count)]
    (root / 'data').mkdir(exist_ok=True)
    pd.DataFrame(rows).to_parquet(root / 'data' / f'{split}.parquet')
"""
MEASURE = """
import importlib, resource, sys
sys.argv = sys.argv[1:]
try:
    importlib.import_module(sys.argv[0]).main()
finally:
    print('PEAK_MIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
PARAMS = {  # the committed params with the real shapes and the memory-bound settings of this test
    "models": {"kind": "random", "source": "qwen3-0.6b", "target": "qwen3-1.7b", "dtype": "bfloat16"},
    "machine": {"device": "cpu", "threads": 2},
    "extract": {"dtype": "bfloat16", "shard_sequences": 8, "repeats": 1},
    "fit": {"ks": [1, 8], "lambdas": [1.0], "families": ["linear", "head_matched"], "accumulator_gib": 2.0,
            "timing_repeats": 1, "mlp": {"ks": []}},
}


def _peak(command: list[str], cwd: Path) -> float:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={"PYTHONPATH": str(REPO),
                          "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.split("PEAK_MIB")[-1])


def _world(root: Path, layers: int, length: int) -> None:
    config = repr({"length": length})
    subprocess.run([sys.executable, "-c", SETUP, str(root), str(layers), config], check=True,
                   env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    committed = yaml.safe_load((REPO / "params.yaml").read_text())
    (root / "params.yaml").write_text(yaml.safe_dump(merge(committed, PARAMS)))


@pytest.mark.realshape
def test_extract_and_fit_stay_under_16_gib_at_qwen3_shapes(tmp_path):
    figures = {}
    _world(tmp_path, layers=28, length=16)
    for name in ("source", "target"):
        figures[f"extract_{name}_peak_mib"] = _peak([sys.executable, "-c", MEASURE, "pipeline.extract", name], tmp_path)
        figures[f"extract_{name}"] = json.loads((tmp_path / "metrics" / f"extract_{name}.json").read_text())
    figures["fit_peak_mib"] = _peak([sys.executable, "-c", MEASURE, "pipeline.fit"], tmp_path)
    figures["fit"] = {k: v for k, v in json.loads((tmp_path / "metrics" / "fit.json").read_text()).items()
                      if not isinstance(v, dict)}
    print(json.dumps(figures, indent=1))
    assert max(v for k, v in figures.items() if k.endswith("_mib")) < LIMIT_MIB
