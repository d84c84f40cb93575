"""Peak host memory of extract and fit at the exact Qwen3-0.6B / 1.7B shapes (random weights), in subprocesses.

Slow (minutes): `pytest -m slow tests/test_real_shapes_memory.py -s` prints the figures. Extraction runs the
exact configs (28 layers, vocab 151936) over 50 short sequences. The fit runs the exact per-layer geometry
(8 KV heads x 128, k=8: 8192-wide moments, the largest thing a layer holds) on 8 source and 2 target layers,
because 28 x 28 probes and 56 k=8 solves in float64 take far longer than a test on two shared cores; the
one layer-count-dependent allocation of the fit, the assembled k=8 mapper of all 28 target layers, is
measured separately by writing one.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMIT_MIB = 16 * 1024
SETUP = """
import sys, torch, pandas as pd
from pathlib import Path
from pipeline.shapes import random_model, shape_config
root, layers, config = Path(sys.argv[1]), int(sys.argv[2]), eval(sys.argv[3])
for name, shape in (('source', 'qwen3-0.6b'), ('target', 'qwen3-1.7b')):
    cfg = shape_config(shape)
    cfg.num_hidden_layers = layers
    random_model(cfg, 'bfloat16', 'cpu', seed=0).save_pretrained(root / 'models' / name)
for split, count in (('fit', 50), ('select', 25)):
    g = torch.Generator().manual_seed(len(split))
    rows = [dict(doc_id=f'{split}-{i}', text='', token_ids=torch.randint(0, 151936, (config['length'],), generator=g).tolist(),
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
MAPPER = """
import resource, torch
from pipeline.mapper import Mapper, save_mapper
geo = dict(layers=28, kv_heads=8, head_dim=128)
layer = lambda: (torch.randn(8, 8 * 1024, 128), torch.randn(8, 128))
m = Mapper('linear', 's', 't', geo, geo, {}, {}, k=8, source_layers=[list(range(8))] * 28,
           keys=[layer() for _ in range(28)], values=[layer() for _ in range(28)])
save_mapper(m, 'k8.safetensors')
print('PEAK_MIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
PARAMS = """extract: {dtype: bfloat16, shard_sequences: 8, threads: 2}
fit:
  ks: [1, 8]
  lambdas: [1.0]
  families: [linear, head_matched]
  accumulator_gib: 2.0
  threads: 2
  timing_repeats: 1
  mlp: {ks: [1], hidden: 64, max_epochs: 2}
"""


def _peak(command: list[str], cwd: Path) -> float:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={"PYTHONPATH": str(REPO),
                          "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.split("PEAK_MIB")[-1])


def _world(root: Path, layers: int, length: int) -> None:
    config = repr({"length": length})
    subprocess.run([sys.executable, "-c", SETUP, str(root), str(layers), config], check=True,
                   env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    (root / "params.yaml").write_text(PARAMS)


@pytest.mark.slow
def test_extract_and_fit_stay_under_16_gib_at_qwen3_shapes(tmp_path):
    figures = {}
    full = tmp_path / "full"
    full.mkdir()
    _world(full, layers=28, length=16)
    for name in ("source", "target"):
        figures[f"extract_{name}_peak_mib"] = _peak([sys.executable, "-c", MEASURE, "pipeline.extract", name], full)
        figures[f"extract_{name}"] = json.loads((full / "metrics" / f"extract_{name}.json").read_text())
    few = tmp_path / "few"
    few.mkdir()
    _world(few, layers=8, length=32)
    (few / "models" / "target" / "config.json").write_text(
        (few / "models" / "target" / "config.json").read_text().replace('"num_hidden_layers": 8', '"num_hidden_layers": 2'))
    for name in ("source", "target"):
        _peak([sys.executable, "-c", MEASURE, "pipeline.extract", name], few)
    figures["fit_peak_mib_8x2_layers_k8"] = _peak([sys.executable, "-c", MEASURE, "pipeline.fit"], few)
    figures["fit_metrics"] = {k: v for k, v in json.loads((few / "metrics" / "fit.json").read_text()).items() if "/" not in k}
    figures["write_k8_mapper_28_layers_peak_mib"] = _peak([sys.executable, "-c", MAPPER], tmp_path)
    print(json.dumps(figures, indent=1))
    assert max(v for k, v in figures.items() if k.endswith("_mib")) < LIMIT_MIB
