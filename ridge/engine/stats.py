"""The engine's state as plain data: one snapshot, taken between steps, that a server renders
(``/metrics``) without reaching into the scheduler, the KV manager, the telemetry or the
speculator. Every field is a number, a string or a container of them (plus dataclass copies),
so a snapshot can cross a thread or a process."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ridge.engine.structured import StructuredStats
from ridge.kv_transfer.stats import KVTransferStats
from ridge.spec_decode.stats import SpecDecodeStats
from ridge.telemetry import PhaseStats


@dataclass
class EngineStats:
    num_unfinished_requests: int = 0  # user requests (n sequences each) not finished
    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests
    kv_blocks: dict[str, int] = field(default_factory=dict)  # free / used / cached / total
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # configuration, as labels: scheduler, dtype, device, block_size, num_kv_blocks, ...
    info: dict[str, str] = field(default_factory=dict)
    # the steps on the roofline per phase, since the engine started (copies)
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    roofline_resolved: bool = False  # the phases' roofline fractions are known
    spec_decode: SpecDecodeStats | None = None  # None: no speculation
    spec_decode_k: int = 0  # tokens proposed per sequence in the last step
    kv_transfer: KVTransferStats | None = None  # None: not a producer or consumer
    structured: StructuredStats = field(default_factory=StructuredStats)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @classmethod
    def collect(cls, engine) -> EngineStats:
        """Read ``engine`` (an ``LLMEngine``) now; call between steps, on its thread."""
        sched, kv, cfg = engine.scheduler, engine.kv, engine.config
        telemetry, speculator = engine.telemetry, engine.speculator
        return cls(
            num_unfinished_requests=engine.num_unfinished_requests,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_cache_usage=kv.usage,
            kv_blocks=kv.pool.counts(),
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=sched.num_preemptions,
            info={
                "scheduler": cfg.scheduler,
                "dtype": str(engine.dtype).removeprefix("torch."),
                "device": str(engine.device),
                "block_size": str(cfg.block_size),
                "num_kv_blocks": str(engine.num_kv_blocks),
                "max_num_seqs": str(cfg.max_num_seqs),
                "max_model_len": str(engine.max_model_len),
                "tensor_parallel_size": str(cfg.tensor_parallel_size),
                "kv_role": cfg.kv_transfer_config.kv_role if cfg.kv_transfer_config is not None else "",
            },
            phases={name: copy.copy(stats) for name, stats in telemetry.phases().items()},
            roofline_resolved=telemetry.hardware_resolved,
            spec_decode=copy.deepcopy(speculator.stats) if speculator is not None else None,
            spec_decode_k=speculator.last_k if speculator is not None else 0,
            kv_transfer=engine.kv_transfer.snapshot() if engine.kv_transfer is not None else None,
            structured=engine.structured.stats.copy(),
        )
