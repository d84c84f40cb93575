"""Several processes for one stage on torchrun's contract (gloo between CPU processes, NCCL between GPUs): a stage
with `<stage>.processes` N > 1 starts itself again under torchrun's agent, so dvc.yaml keeps one command per stage.
Work is split by index and gathered on rank 0 in a fixed order, so a stage writes exactly what one process writes.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from pipeline.store.artifacts import nested, write_json_atomic
from pipeline.store.cli import PARENT_SAYS_ENV, STOPPED_BY, Refusal, interrupted_by
from pipeline.store.devices import StageUsage, usage_of_ranks
from pipeline.store.lazy import lazy

torch = lazy("torch")
dist = lazy("torch.distributed")
torchrun = lazy("torch.distributed.run")
elastic = lazy("torch.distributed.elastic.multiprocessing")
elastic_errors = lazy("torch.distributed.elastic.multiprocessing.errors")

LAUNCHED = "WORLD_SIZE"  # set by torchrun / accelerate launch in every process they start


class Relaunched(SystemExit):
    """The launching process's way out of a stage its torchrun processes ran: status 0, past the rest of main()."""


@dataclass(frozen=True)
class Ranks:
    """The stage's processes as this one sees them: its rank, how many there are, its GPU on this machine."""

    rank: int
    size: int
    local_rank: int

    @property
    def main(self) -> bool:  # the process that writes the stage's outputs
        return self.rank == 0

    def share(self, count: int) -> range:  # r, r+N, r+2N, ...
        return range(self.rank, count, self.size)

    def gather(self, value, dst: int = 0) -> list | None:
        """Every rank's `value`, in rank order, on rank `dst` (None elsewhere)."""
        if self.size == 1:
            return [value]
        out = [None] * self.size if self.rank == dst else None
        dist.gather_object(value, out, dst=dst)
        return out

    def all_gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor (equal shapes; a scalar as one entry), concatenated in rank order along dim 0."""
        if self.size == 1:
            return tensor
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        parts = [torch.empty_like(flat) for _ in range(self.size)]
        dist.all_gather(parts, flat)
        return torch.cat(parts)

    def all_gather(self, value) -> list:
        if self.size == 1:
            return [value]
        out = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def device(self, device: str) -> str:
        if self.size > 1 and device == "cuda":
            return f"cuda:{self.local_rank}"
        return device


ONE_PROCESS = Ranks(0, 1, 0)


class Stage:
    def __init__(self, ranks: Ranks, device: str):
        self.ranks = ranks
        self.device = ranks.device(device)
        self.usage = StageUsage(self.device)

    def restart_usage(self) -> None:
        """For a stage writing one metrics file per part of its work (a CPU's peak stays the process's)."""
        self.usage = StageUsage(self.device)

    def write_metrics(self, path: str | os.PathLike, metrics: dict,
                      usage_to: str | os.PathLike | None = None) -> dict | None:
        """Every rank calls it; rank 0 writes `metrics` nested with every rank's usage figures (its own keys win), or
        those in `usage_to` instead, so `path` changes only with the stage's own figures. Returns what rank 0 wrote."""
        figures = self.ranks.gather(self.usage.figures())
        if not self.ranks.main:
            return None
        usage = usage_of_ranks(figures)
        if usage_to is not None:
            write_json_atomic(Path(usage_to), nested(usage))
            shown, metrics = usage, nested(metrics)
        else:
            metrics = nested({**metrics, **{key: value for key, value in usage.items() if key not in metrics}})
            shown = metrics
        write_json_atomic(Path(path), metrics)
        print(json.dumps({key: value for key, value in shown.items() if not isinstance(value, dict)}, indent=2))
        return metrics


def relaunch(processes: int, module: str, argv: Sequence[str]) -> bool:
    """With `processes` > 1 and no launcher yet: run `python -m module argv` as torchrun processes, wait and return
    True; otherwise False. A failed rank raises SystemExit(1); Ctrl-C or SIGTERM, KeyboardInterrupt once every rank
    has cleaned up. `--standalone` picks a free rendezvous port, so concurrent experiments do not collide."""
    if processes == 1 or LAUNCHED in os.environ:
        return False
    args = torchrun.parse_args(["--standalone", f"--nproc_per_node={processes}", "-m", module, *argv])
    with _launching():
        try:
            torchrun.run(args)
        except elastic.SignalException as stopped:  # the agent has passed the signal on and its ranks have ended
            if stopped.sigval in STOPPED_BY.values():
                raise interrupted_by(stopped.sigval) from None
            print(f"error: {module} on {processes} processes stopped by {stopped.sigval.name}", file=sys.stderr)
            raise SystemExit(128 + stopped.sigval) from None
        except elastic_errors.ChildFailedError as failed:
            status = failed.get_first_failure()[1].exitcode
            if status in STOPPED_BY:
                raise interrupted_by(STOPPED_BY[status]) from None
            print(failed, file=sys.stderr)
            print(f"error: {module} failed on one of its {processes} processes and torchrun ended the others; its "
                  f"report above names the rank that failed first", file=sys.stderr)
            raise SystemExit(1) from None
    return True


TORCHRUN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # those its agent takes over


@contextmanager
def _launching() -> Iterator[None]:
    """What torchrun's agent changes in its process (environment, signal handlers) put back after; its warnings off."""
    environment, handlers = dict(os.environ), {sig: signal.getsignal(sig) for sig in TORCHRUN_SIGNALS}
    silenced = logging.root.manager.disable
    os.environ[PARENT_SAYS_ENV] = "1"
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(silenced)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(environment)


def launched_ranks() -> Ranks:
    if LAUNCHED not in os.environ:
        return ONE_PROCESS
    return Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def join(device: str) -> Ranks:
    """This process's `Ranks`, its process group started under several (NCCL for a CUDA device, else gloo)."""
    ranks = launched_ranks()
    if ranks.size > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            if ranks.local_rank >= torch.cuda.device_count():
                raise Refusal(f"process {ranks.local_rank} of this machine has no GPU of its own "
                              f"({torch.cuda.device_count()} visible); lower <stage>.processes to at most the number "
                              f"of GPUs")
            torch.cuda.set_device(ranks.local_rank)
        dist.init_process_group(backend)
    return ranks


def leave(ranks: Ranks) -> None:
    if ranks.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def stage_ranks(device: str, processes: int = 1, module: str | None = None, argv: Sequence[str] = (),
                threads: int | None = None) -> Iterator[Stage]:
    """Around a stage's work: relaunch under torchrun (this process then ends with `Relaunched`), else join the
    process group, take `threads` torch CPU threads, and give the block its `Stage`. Without `module`: one process."""
    if module is None:
        ranks = ONE_PROCESS
    elif relaunch(processes, module, argv):
        raise Relaunched(0)
    else:
        ranks = join(device)
    if threads is not None:
        torch.set_num_threads(threads)
    # a block that fails skips the teardown on purpose: NCCL's waits for every rank, some still in a collective, while
    # ending this process lets torchrun's agent end them (SIGTERM) and the stage exit non-zero.
    yield Stage(ranks, device)
    leave(ranks)
