"""The ranks of a tensor-parallel engine and their process groups, on ``torch.distributed``.

Two ways to start N ranks:

* **One machine** (``LLM(tensor_parallel_size=N)``, ``--tensor-parallel-size N``): this process
  is rank 0; it hosts a ``TCPStore`` on loopback and starts ranks 1 .. N-1 itself
  (``torch.multiprocessing``, spawned). Each rank takes ``num_threads / N`` threads, pinned to
  cores of its own.
* **Several machines** (``torchrun``): every process was started by torchrun; rank, world size
  and the master's address come from the environment (``env://``). Rank 0 runs the engine
  (scheduler, sampler, the HTTP server); the others run the worker loop.

Each rank builds two process groups on the store: ``compute`` (gloo on CPU, NCCL on CUDA),
whose collectives run inside a step and time out after ``RIDGE_TP_TIMEOUT`` seconds (a hung
rank ends the engine with an error, never a hang), and ``control`` (gloo), on which rank 0
broadcasts each command: a waiting rank has no practical timeout (an idle server waits for
requests), but rank 0 gives each command the collective timeout to be taken (the load timeout,
``RIDGE_TP_LOAD_TIMEOUT``, while the ranks load). A rank that dies closes its connections,
which fails the other ranks' next collective at once.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ridge.distributed.parallel import TensorParallel

# Collectives inside a step (a prefill chunk on a slow rank included) finish well within this.
DEFAULT_TIMEOUT_S = 120.0
# Rank 0's commands: an idle engine sends none for as long as it stays idle.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# Starting: every rank joins the store and builds its groups (before loading any weight).
DEFAULT_CONNECT_TIMEOUT_S = 60.0
# Loading: every rank reads its shard of the weights (a large model from a slow disk: minutes).
DEFAULT_LOAD_TIMEOUT_S = 1800.0


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("RIDGE_TP_TIMEOUT", DEFAULT_TIMEOUT_S)))


def load_timeout() -> datetime.timedelta:
    """How long rank 0 waits for the other ranks to load their shards (``RIDGE_TP_LOAD_TIMEOUT``)."""
    return datetime.timedelta(seconds=float(os.environ.get("RIDGE_TP_LOAD_TIMEOUT", DEFAULT_LOAD_TIMEOUT_S)))


def connect_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("RIDGE_TP_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_S)))


@dataclass
class Rank:
    """One rank's place: its ``TensorParallel`` (compute group) and the control group."""

    tp: TensorParallel
    control: object
    store: object


def under_torchrun() -> bool:
    """Started by torchrun (or any launcher that sets the env:// variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def env_rank() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def groups_on(store, rank: int, size: int, device: torch.device) -> Rank:
    """This rank's compute and control groups on ``store``."""
    timeout = collective_timeout()
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, size, options)
    else:
        compute = _gloo(dist.PrefixStore("compute", store), rank, size, timeout)
    control = _gloo(dist.PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)
    return Rank(TensorParallel(rank, size, compute, device), control, store)


def _gloo(store, rank: int, size: int, timeout: datetime.timedelta):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    host = os.environ.get("RIDGE_TP_HOST") or ("127.0.0.1" if not under_torchrun() else None)
    device = (
        dist.ProcessGroupGloo.create_device(hostname=host) if host else dist.ProcessGroupGloo.create_default_device()
    )
    options._devices = [device]
    return dist.ProcessGroupGloo(store, rank, size, options)


def host_store(size: int) -> object:
    """Rank 0 of one machine: a store on a free loopback port (``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, size, True, timeout=connect_timeout(), wait_for_workers=False)


def join_store(port: int, size: int) -> object:
    """A rank of one machine: rank 0's store on loopback ``port``."""
    return dist.TCPStore("127.0.0.1", port, size, False, timeout=connect_timeout())


def wait_ready(store, size: int, alive) -> None:
    """Rank 0: wait until ranks 1 .. N-1 say ``ready/<rank>`` (or one reports ``error/<rank>``,
    or ``alive()`` turns False: a rank died before it could say anything)."""
    deadline = time.monotonic() + connect_timeout().total_seconds()
    waiting = set(range(1, size))
    while waiting:
        for rank in sorted(waiting):
            if store.check([f"error/{rank}"]):
                raise RuntimeError(f"rank {rank}: {store.get(f'error/{rank}').decode()}")
            if store.check([f"ready/{rank}"]):
                waiting.discard(rank)
        if waiting and not alive():
            raise RuntimeError("a rank exited while starting")
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(
                f"ranks {sorted(waiting)} did not start within {connect_timeout().total_seconds():.0f} s"
            )
        if waiting:
            time.sleep(0.05)


def join_env(device: torch.device) -> Rank:
    """A rank started by torchrun: rank, world size and the master from the environment."""
    rank, size = env_rank()
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    try:
        store, rank, size = next(dist.rendezvous("env://", rank, size, timeout=connect_timeout()))
    except Exception as exc:  # DistStoreError, RuntimeError, TimeoutError ...
        raise ValueError(
            f"tensor parallel: cannot reach the master at {addr}:{port} within "
            f"{connect_timeout().total_seconds():.0f} s ({type(exc).__name__}: {exc})"
        ) from None
    return groups_on(dist.PrefixStore("ridge", store), rank, size, device)


# A shared-memory slot per rank: an all-reduce or a logits gather larger than this goes over
# the compute group instead (a 2,048-token prefill of a 2,048-wide model in float32: 16 MiB).
SHM_SLOT_BYTES = 16 * 2**20


def shm_enabled() -> bool:
    """Ranks of one machine meet in shared memory (``RIDGE_TP_SHM=0``: gloo for everything)."""
    return os.environ.get("RIDGE_TP_SHM", "1") != "0" and os.path.isdir("/dev/shm")


def shm_group(name: str, rank: int, size: int, alive, create: bool = False):
    from ridge.distributed.shm import ShmGroup

    return ShmGroup(name, rank, size, SHM_SLOT_BYTES, collective_timeout().total_seconds(), alive, create)


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def check_cores(size: int, cores: list[int]) -> None:
    if size > len(cores):
        raise ValueError(
            f"tensor parallel size {size} is larger than the {len(cores)} CPU cores this process may use "
            "(one rank needs at least one core)"
        )


def pin_threads(rank: int, size: int, num_threads: int | None, cores: list[int]) -> int:
    """Give this rank its share of ``num_threads`` (default: of ``cores``), pinned to cores of
    its own; returns the rank's thread count. Where cores are fewer than ranks, ValueError."""
    check_cores(size, cores)
    share = len(cores) // size
    threads = max(1, num_threads // size) if num_threads else share
    mine = cores[rank * share : (rank + 1) * share]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, mine)
    torch.set_num_threads(threads)
    return threads
