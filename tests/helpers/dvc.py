"""dvc.yaml's stages as the modules they run."""
from __future__ import annotations

from pathlib import Path

import yaml
from importgraph import stage_module


def dvc_stages(root: Path) -> set[str]:
    """Stage modules: the `python -m pipeline.<module>` of each dvc.yaml stage."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    return {stage_module(stage) for stage in stages.values()}
