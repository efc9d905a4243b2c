"""Executors: how the engine reaches its workers. The engine hands a plan to ``execute_model``
and gets the driver's ``RunnerOutput`` back; it never holds a model.

    UniProcExecutor   one worker in this process (tensor_parallel_size 1)

Every executor offers the same calls: ``info`` (the model as data), ``num_kv_blocks`` once
``init_kv_cache`` ran, ``execute_model(plan)``, ``probe_matmul_flops(rows)``, ``shutdown()``.
"""

from __future__ import annotations

from ridge.engine.step import RunnerOutput, SchedulerOutput
from ridge.worker.worker import ModelInfo, Worker, WorkerConfig


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

    def probe_matmul_flops(self, rows: int) -> float:
        return self.worker.probe_matmul_flops(rows)

    def score(self, ids: list[int]):
        return self.worker.score(ids)

    def shutdown(self) -> None:
        pass


def make_executor(config: WorkerConfig) -> UniProcExecutor:
    return UniProcExecutor(config)
