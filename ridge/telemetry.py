"""Every engine step placed on the roofline.

The engine records each step's shape (prefill chunks, decode contexts) and wall time; the
FLOPs and bytes come from the analyzer's operator model (``roofline.ops.step_cost``, the one
source of truth) and are priced when read, not on the hot path. A report gives, per phase
(prefill-only, decode-only, mixed steps), the achieved bandwidth and FLOP/s and the fraction
of the roofline: ``sum(max(FLOPs / peak, bytes / bandwidth)) / sum(wall time)``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ridge.roofline.hardware import Hardware
from ridge.roofline.ops import StepCost, step_cost
from ridge.roofline.shapes import ModelShape

PHASES = ("prefill", "decode", "mixed")
TORCH_TO_ROOFLINE_DTYPE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass
class StepRecord:
    prefill_chunks: tuple[tuple[int, int], ...]  # (query tokens, context after the chunk)
    decode_contexts: tuple[int, ...]  # context (incl. the new token) of each decode
    wall_s: float
    cost: StepCost | None = None  # priced on first read

    @property
    def phase(self) -> str:
        if self.prefill_chunks and self.decode_contexts:
            return "mixed"
        return "prefill" if self.prefill_chunks else "decode"

    @property
    def tokens(self) -> int:
        return sum(q for q, _ in self.prefill_chunks) + len(self.decode_contexts)


@dataclass
class PhaseStats:
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    floor_s: float = 0.0  # roofline time: sum over steps of max(flops / peak, bytes / bw)
    floored_wall_s: float = 0.0  # wall time of the steps priced with a known roofline

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes / self.wall_s if self.wall_s else 0.0

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.wall_s if self.wall_s else 0.0

    @property
    def roofline_fraction(self) -> float:
        return self.floor_s / self.floored_wall_s if self.floored_wall_s else 0.0

    def to_json(self) -> dict:
        return {
            "steps": self.steps, "tokens": self.tokens, "wall_s": self.wall_s, "flops": self.flops,
            "bytes": self.bytes, "floor_s": self.floor_s, "floored_wall_s": self.floored_wall_s,
            "achieved_gb_per_s": self.achieved_bytes_per_s / 1e9,
            "achieved_gflop_per_s": self.achieved_flops_per_s / 1e9, "roofline_fraction": self.roofline_fraction,
        }


@dataclass
class Telemetry:
    """Step records of one engine, and their place on a roofline.

    ``hardware`` is resolved on first report (probing the local machine can take seconds).
    Totals cover every step since the last ``reset``; ``recent`` keeps the last steps in full.
    """

    model: ModelShape
    weight_bytes: float  # per parameter
    kv_bytes: float  # per cached element
    act_bytes: float
    compute_dtype: str  # the roofline dtype of the peak ("bf16", ...)
    hardware_fn: Callable[[], Hardware]
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))
    _pending: list = field(default_factory=list)
    _totals: dict = field(default_factory=lambda: {p: PhaseStats() for p in PHASES})
    _hardware: Hardware | None = None

    def record(self, prefill_chunks, decode_contexts, wall_s: float) -> None:
        """Hot path: keep the shape and the time; pricing happens on read."""
        rec = StepRecord(tuple(prefill_chunks), tuple(decode_contexts), wall_s)
        self.recent.append(rec)
        self._pending.append(rec)

    def price(self, rec: StepRecord) -> StepCost:
        if rec.cost is None:
            rec.cost = step_cost(self.model, rec.prefill_chunks, rec.decode_contexts,
                                 self.weight_bytes, self.kv_bytes, self.act_bytes)
        return rec.cost

    @property
    def hardware_resolved(self) -> bool:
        return self._hardware is not None

    @property
    def hardware(self) -> Hardware:
        if self._hardware is None:
            self._hardware = self.hardware_fn()
        return self._hardware

    def floor_s(self, cost: StepCost) -> float:
        hw = self.hardware
        return max(cost.flops / hw.peak(self.compute_dtype), cost.bytes / hw.bandwidth_bytes_per_s)

    def phases(self) -> dict[str, PhaseStats]:
        """Per-phase totals since the last reset (pricing any steps not yet priced).

        Roofline floors need the hardware: steps priced before it is resolved (a server
        resolves it at start-up; ``report`` does first) count in FLOPs and bytes only.
        """
        for rec in self._pending:
            cost = self.price(rec)
            stats = self._totals[rec.phase]
            stats.steps += 1
            stats.tokens += rec.tokens
            stats.wall_s += rec.wall_s
            stats.flops += cost.flops
            stats.bytes += cost.bytes
            if self._hardware is not None:
                stats.floor_s += self.floor_s(cost)
                stats.floored_wall_s += rec.wall_s
        self._pending.clear()
        return self._totals

    def reset(self) -> None:
        self._pending.clear()
        self.recent.clear()
        self._totals = {p: PhaseStats() for p in PHASES}

    def report(self) -> dict:
        hw = self.hardware
        return {
            "hardware": {"name": hw.name, "bandwidth_gb_per_s": hw.bandwidth_bytes_per_s / 1e9,
                         "peak_gflop_per_s": hw.peak(self.compute_dtype) / 1e9, "dtype": self.compute_dtype,
                         "measured_at": hw.measured_at},
            "phases": {name: stats.to_json() for name, stats in self.phases().items() if stats.steps},
        }

    def format(self) -> str:
        """A few lines for humans: achieved GB/s and GFLOP/s and the roofline fraction per phase."""
        rep = self.report()
        hw = rep["hardware"]
        lines = [f"roofline ({hw['name']}: {hw['bandwidth_gb_per_s']:.1f} GB/s, "
                 f"{hw['peak_gflop_per_s']:.0f} GFLOP/s {hw['dtype']})"]
        for name, s in rep["phases"].items():
            lines.append(
                f"  {name:<8} {s['steps']:>5} steps  {s['achieved_gb_per_s']:7.1f} GB/s  "
                f"{s['achieved_gflop_per_s']:8.1f} GFLOP/s  {100 * s['roofline_fraction']:5.1f}% of roofline"
            )
        return "\n".join(lines)


def cuda_hardware(device) -> Hardware:
    """A CUDA device measured now: read bandwidth (sum over 2 GiB) and a bf16 GEMM, medians of 5."""
    import statistics

    import torch

    def timed(fn, repeats=5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    data = torch.ones(2**29, dtype=torch.float32, device=device)
    bandwidth = data.numel() * 4 / timed(data.sum)
    del data
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    peak = 2 * n**3 / timed(lambda: a @ a)
    props = torch.cuda.get_device_properties(device)
    import datetime as dt

    return Hardware(
        name=f"cuda:{props.name}",
        peak_flops={"bf16": peak, "fp16": peak, "fp32": peak / 2},
        bandwidth_bytes_per_s=bandwidth,
        memory_bytes=float(props.total_memory),
        source="measured now: sum() over 2 GiB fp32; 8192^3 bf16 matmul (fp32 peak assumed half)",
        measured_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )
