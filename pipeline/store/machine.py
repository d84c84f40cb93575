"""The `machine` section of params.yaml: where every stage runs, one device and one thread count for the whole
profile (a stage's own section says what it computes, not where)."""
from __future__ import annotations

from typing import Literal

from pipeline.store.devices import default_device
from pipeline.store.params import Params, Threads


class MachineParams(Params):
    device: Literal["cpu", "cuda", "auto"]  # the models' device, and the latency study's; auto: cuda when there is one
    threads: Threads  # torch's CPU threads in each stage process (each torchrun process of a stage takes as many)

    @property
    def torch_device(self) -> str:
        return default_device() if self.device == "auto" else self.device
