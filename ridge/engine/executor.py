"""Executors: how the engine reaches its workers. The engine hands a plan to ``execute_model``
and gets the driver's ``RunnerOutput`` back; it never holds a model.

    UniProcExecutor     one worker in this process (tensor_parallel_size 1)
    MultiprocExecutor   N ranks: this process is rank 0, ranks 1 .. N-1 are processes it starts
                        (one machine), or that torchrun started (several machines)

Every executor offers the same calls: ``info`` (the model as data), ``available_kv_blocks``,
``init_kv_cache``, ``execute_model(plan)``, ``probe_matmul_flops(rows)``, ``score(ids)``,
``shutdown()``. A rank that fails (dies, hangs past the collective timeout, raises) ends the
executor: every later call raises ``WorkerFailure`` at once, naming the rank and its error.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from ridge.engine.client import EngineFatalError
from ridge.engine.step import RunnerOutput, SchedulerOutput
from ridge.worker.worker import ModelInfo, Worker, WorkerConfig, check_tensor_parallel, run_worker_loop

logger = logging.getLogger(__name__)


class WorkerFailure(EngineFatalError):
    """A tensor-parallel rank failed; the engine cannot go on."""


class UniProcExecutor:
    def __init__(self, config: WorkerConfig) -> None:
        self.worker = Worker(config)
        self.info: ModelInfo = self.worker.describe()
        self.num_kv_blocks = 0

    def available_kv_blocks(self, max_num_seqs: int) -> int:
        return self.worker.available_kv_blocks(max_num_seqs)

    def init_kv_cache(self, num_blocks: int, eos_token_ids: frozenset[int]) -> None:
        self.worker.init_kv_cache(num_blocks, eos_token_ids)
        self.num_kv_blocks = num_blocks

    def execute_model(self, plan: SchedulerOutput) -> RunnerOutput:
        return self.worker.execute_model(plan)

    # asynchronous scheduling (one process): the step enqueued, then its output when needed
    def launch_model(self, plan: SchedulerOutput):
        return self.worker.launch_model(plan)

    def finish_model(self, step) -> RunnerOutput:
        return self.worker.finish_model(step)

    def probe_matmul_flops(self, rows: int) -> float:
        return self.worker.probe_matmul_flops(rows)

    def score(self, ids: list[int]):
        return self.worker.score(ids)

    @property
    def kv_connector(self):
        return self.worker.kv_connector

    def kv_connect(self, peer) -> None:
        why = self.worker.kv_connect(peer)
        if why is not None:
            raise ValueError(why)

    def shutdown(self) -> None:
        self.worker.close()


def _local_rank_main(
    port: int, rank: int, size: int, config: WorkerConfig, parent: int, cores: list[int], shm_name: str | None
) -> None:
    """A rank of one machine (a process rank 0 spawned): join, load its shard, serve. Any
    failure is written to the store (``error/<rank>``) for rank 0 to report."""
    from ridge.distributed import launch

    store = None
    try:
        _watch_parent(parent)
        store = launch.join_store(port, size)
        launch.pin_threads(rank, size, config.num_threads, cores)
        device = _rank_device(config, rank)
        store.set(f"ready/{rank}", "1")
        ctx = launch.groups_on(store, rank, size, device)
        if shm_name is not None:
            ctx.tp.shm = launch.shm_group(shm_name, rank, size, alive=lambda: os.getppid() == parent)
        worker = Worker(config, tp=ctx.tp)
        run_worker_loop(worker, ctx.control)
    except BaseException as exc:  # reported to rank 0 through the store, then exit
        if store is not None:
            try:
                store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
            except Exception:
                pass
        os._exit(1)
    os._exit(0)


def _watch_parent(parent: int) -> None:
    """End this rank when the process that started it is gone (no orphans)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="ridge-parent-watch", daemon=True).start()


def _rank_device(config: WorkerConfig, local_rank: int) -> torch.device:
    from ridge.config import resolve_device

    device = resolve_device(config.device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


class MultiprocExecutor:
    """Rank 0 of ``tensor_parallel_size`` ranks. Each step is one broadcast of the plan on the
    control group, then the forward pass on every rank (all-reducing inside each layer) and
    the logits' gather; rank 0 samples."""

    def __init__(self, config: WorkerConfig, ctx=None) -> None:
        from ridge.distributed import launch

        self.size = config.tensor_parallel_size
        self.processes: list = []
        self._store = None
        self._shm = None
        self.failure: WorkerFailure | None = None
        self._saved_threads = torch.get_num_threads()
        self._saved_affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        device = _rank_device(config, 0)
        try:
            if ctx is None:  # one machine: start ranks 1 .. N-1 here
                cores = launch.usable_cores()
                if device.type == "cpu":
                    launch.check_cores(self.size, cores)
                check_tensor_parallel(config)  # bad sizes fail here, before any process starts
                launch.pin_threads(0, self.size, config.num_threads, cores)  # checks the size first
                store = launch.host_store(self.size)
                self._store = store
                alive = lambda: all(p.exitcode is None for p in self.processes)  # noqa: E731
                shm = None
                if device.type == "cpu" and launch.shm_enabled():
                    shm = launch.shm_group(f"ridge-tp-{os.getpid()}-{store.port}", 0, self.size, alive, create=True)
                    self._shm = shm
                self._start_ranks(store.port, config, cores, shm.path.rsplit("/", 1)[1] if shm else None)
                launch.wait_ready(store, self.size, alive)
                ctx = launch.groups_on(store, 0, self.size, device)
                ctx.tp.shm = shm
            self.ctx = ctx
            self.tp = ctx.tp
            self.worker = Worker(config, tp=ctx.tp)
        except BaseException as exc:
            self._stop_processes()
            self._restore()
            raise self._explain(exc) from None
        self.info: ModelInfo = self.worker.describe()
        self.num_kv_blocks = 0
        self._timeout = launch.collective_timeout()
        self._monitor = threading.Thread(target=self._watch, name="ridge-rank-watch", daemon=True)
        self._monitor.start()

    # -- ranks ----------------------------------------------------------------------------
    def _start_ranks(self, port: int, config: WorkerConfig, cores: list[int], shm_name: str | None) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        for rank in range(1, self.size):
            proc = context.Process(
                target=_local_rank_main,
                args=(port, rank, self.size, config, os.getpid(), cores, shm_name),
                name=f"ridge-rank-{rank}",
                daemon=True,
            )
            proc.start()
            self.processes.append(proc)

    def _watch(self) -> None:
        """A rank process that exits ends the engine (its error, when it reported one)."""
        while self.processes and self.failure is None:
            for proc in self.processes:
                if proc.exitcode is not None and self.failure is None:
                    self.failure = self._explain(RuntimeError(f"{proc.name} exited with code {proc.exitcode}"))
                    logger.error("%s", self.failure)
                    return
            time.sleep(0.2)

    def _rank_errors(self) -> list[str]:
        errors = []
        store = getattr(self, "_store", None) or getattr(getattr(self, "ctx", None), "store", None)
        for rank in range(1, self.size):
            try:
                if store is not None and store.check([f"error/{rank}"]):
                    errors.append(f"rank {rank}: {store.get(f'error/{rank}').decode()}")
            except Exception:
                pass
        return errors

    def _explain(self, exc: BaseException) -> BaseException:
        """What to raise for ``exc``: rank 0's own bad input as it is; a rank's reported error
        (bad input: ValueError), else a ``WorkerFailure`` naming what died."""
        if isinstance(exc, (WorkerFailure, ValueError)):
            return exc
        time.sleep(0.2)  # a failed rank writes its error before it exits
        errors = self._rank_errors()
        if errors and all(": ValueError: " in e for e in errors):
            rank, _, message = errors[0].partition(": ValueError: ")
            return ValueError(f"{rank}: {message}")
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.processes if p.exitcode is not None]
        detail = "; ".join(errors) or ", ".join(dead) or f"{type(exc).__name__}: {exc}"
        return WorkerFailure(f"tensor-parallel rank failed: {detail}")

    def _guard(self, fn, *args):
        if self.failure is not None:
            raise self.failure
        try:
            return fn(*args)
        except BaseException as exc:
            self.failure = failure = self._explain(exc)
            if not isinstance(failure, WorkerFailure):
                failure = WorkerFailure(str(failure))
                self.failure = failure
            self._stop_processes()
            raise failure from None

    def _call(self, name: str, *args):
        """``worker.name(*args)`` on every rank; the results, in rank order."""
        from ridge.distributed import launch

        def run():
            # the other ranks may still be loading their shards: a generous timeout
            timeout = launch.load_timeout()
            self.tp.broadcast_object(("call", name, args), group=self.ctx.control, timeout=timeout)
            mine = getattr(self.worker, name)(*args)
            return self.tp.gather_objects(mine, group=self.ctx.control, timeout=timeout)

        return self._guard(run)

    # -- the executor's calls -------------------------------------------------------------
    def available_kv_blocks(self, max_num_seqs: int) -> int:
        return min(self._call("available_kv_blocks", max_num_seqs))

    def init_kv_cache(self, num_blocks: int, eos_token_ids: frozenset[int]) -> None:
        self._call("init_kv_cache", num_blocks, eos_token_ids)
        self.num_kv_blocks = num_blocks

    def execute_model(self, plan: SchedulerOutput) -> RunnerOutput:
        def run():
            # a rank that does not take the plan within the collective timeout has hung
            self.tp.broadcast_object(("step", plan), group=self.ctx.control, timeout=self._timeout)
            return self.worker.execute_model(plan)

        return self._guard(run)

    def probe_matmul_flops(self, rows: int) -> float:
        return self.worker.probe_matmul_flops(rows)  # rank 0's shard: the layer each rank runs

    def score(self, ids: list[int]):
        return self._call("score", ids)[0]

    @property
    def kv_connector(self):
        return self.worker.kv_connector  # rank 0's: the control messages and events

    def kv_connect(self, peer) -> None:
        """Pair every rank with the peer's rank of the same number; ValueError naming the
        first rank that could not (the engine goes on)."""
        for rank, why in enumerate(self._call("kv_connect", peer)):
            if why is not None:
                raise ValueError(why if rank == 0 else f"rank {rank}: {why}")

    def shutdown(self) -> None:
        if self.failure is None and getattr(self, "ctx", None) is not None and self.processes is not None:
            try:
                self.tp.broadcast_object(("stop",), group=self.ctx.control, timeout=self._timeout)
            except Exception:
                pass
        self.failure = self.failure or WorkerFailure("the engine was shut down")
        if getattr(self, "worker", None) is not None:
            self.worker.close()
        self._stop_processes()
        self._restore()

    def _stop_processes(self) -> None:
        for proc in self.processes:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.processes = []

    def _restore(self) -> None:
        if self._shm is not None:
            self._shm.unlink()
            self._shm = None
        torch.set_num_threads(self._saved_threads)
        if self._saved_affinity is not None:
            os.sched_setaffinity(0, self._saved_affinity)


def make_executor(config: WorkerConfig):
    """One worker in-process, or ``tensor_parallel_size`` ranks. Under torchrun every process
    calls this: rank 0 returns its executor; the other ranks serve as workers until rank 0
    stops, then leave (SystemExit)."""
    from ridge.distributed import launch

    if launch.under_torchrun():
        rank, size = launch.env_rank()
        if size != config.tensor_parallel_size:
            raise ValueError(
                f"torchrun started {size} processes but tensor_parallel_size is {config.tensor_parallel_size}"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        ctx = launch.join_env(_rank_device(config, local_rank))
        if rank == 0:
            return MultiprocExecutor(config, ctx)
        run_worker_loop(Worker(config, tp=ctx.tp), ctx.control)
        raise SystemExit(0)
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    return MultiprocExecutor(config)
