"""Several processes for one stage, on torchrun's contract: RANK, WORLD_SIZE and LOCAL_RANK in the environment
(as `torchrun` and `accelerate launch` set them), gloo between CPU processes, NCCL between GPUs, rank r on
device `cuda:<LOCAL_RANK>`.

A stage whose `<stage>.processes` is N > 1 and that is not yet under a launcher starts itself again through
`torch.distributed.run --standalone --nproc_per_node N` (`relaunch`) and waits, so `dvc.yaml` keeps one command
per stage and `dvc repro` stays the only verb. `--standalone` picks a free rendezvous port, so concurrent
experiments (DVC's queue) do not collide. One process is the world of size 1: every helper is then a no-op.

Work is split by index (`World.share`: rank r takes items r, r+N, ...) and results come back to rank 0 as
Python objects (`gather`), which puts them in a fixed order, so a stage can write exactly what one process
writes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.store.cli import Refusal

LAUNCHED = "WORLD_SIZE"  # set by torchrun / accelerate launch in every process they start


class TooManyProcessesError(Refusal, RuntimeError):
    pass


@dataclass(frozen=True)
class World:
    """This process's place among the stage's processes."""

    rank: int
    size: int
    local_rank: int

    @property
    def main(self) -> bool:
        """Rank 0: the process that writes the stage's outputs."""
        return self.rank == 0

    def share(self, count: int) -> range:
        """Indices 0..count-1 this rank takes: r, r+N, r+2N, ..."""
        return range(self.rank, count, self.size)

    def gather(self, value, dst: int = 0) -> list | None:
        """Every rank's `value`, in rank order, on rank `dst` (None elsewhere)."""
        if self.size == 1:
            return [value]
        out = [None] * self.size if self.rank == dst else None
        dist.gather_object(value, out, dst=dst)
        return out

    def all_gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor (equal shapes), concatenated in rank order along dim 0; a scalar gives one entry
        per rank. On the rank's device (gloo: CPU, NCCL: its GPU)."""
        if self.size == 1:
            return tensor
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        parts = [torch.empty_like(flat) for _ in range(self.size)]
        dist.all_gather(parts, flat)
        return torch.cat(parts)

    def all_gather(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        if self.size == 1:
            return [value]
        out = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def device(self, device: str) -> str:
        """The device this rank runs on: `cuda` becomes `cuda:<LOCAL_RANK>` under several processes."""
        if self.size > 1 and device == "cuda":
            return f"cuda:{self.local_rank}"
        return device


SINGLE = World(0, 1, 0)


def launched() -> bool:
    return LAUNCHED in os.environ


def relaunch(processes: int, module: str, argv: list[str]) -> bool:
    """With `processes` > 1 and no launcher yet: run `python -m module argv` as `processes` torchrun processes,
    wait for them and return True (the caller is done; a failed rank raises SystemExit with its status).
    Otherwise return False: the caller does the work itself."""
    if processes == 1 or launched():
        return False
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", module, *argv]
    status = subprocess.run(command).returncode
    if status != 0:
        raise SystemExit(status)
    return True


def join(device: str) -> World:
    """This process's `World`: from the launcher's environment, with the process group started (NCCL for a CUDA
    device, else gloo); the single process when not launched."""
    if not launched():
        return SINGLE
    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if world.size > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            if world.local_rank >= torch.cuda.device_count():
                raise TooManyProcessesError(
                    f"process {world.local_rank} of this machine has no GPU of its own ({torch.cuda.device_count()} "
                    f"visible); lower <stage>.processes to at most the number of GPUs")
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group(backend)
    return world


def leave(world: World) -> None:
    """End the process group (after the last collective)."""
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
