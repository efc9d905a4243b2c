"""Hardware the roofline is drawn for: datasheet presets, custom values, or this machine measured.

A ``Hardware`` has a dense (no-sparsity) peak FLOP/s per dtype, a memory bandwidth, a memory
capacity and a note saying where the numbers come from. ``resolve_hardware`` turns a
``--hardware`` value (a preset name, ``local``, ``custom``, or a hardware JSON file such as
the local probe's cache) into one, with ``--peak-tflops`` / ``--bandwidth-gbs`` /
``--memory-gib`` overrides applied.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ridge.roofline.ops import DTYPE_BYTES

GIB = 1024**3
TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Measurement:
    """A probed quantity: the median of ``samples`` runs and their range (the spread)."""

    median: float
    low: float
    high: float
    samples: int

    def __post_init__(self) -> None:
        if not (0 < self.low <= self.median <= self.high):
            raise ValueError(f"Measurement needs 0 < low <= median <= high, got {self}")
        if self.samples < 1:
            raise ValueError("Measurement needs at least one sample")

    @classmethod
    def of(cls, values: list[float]) -> Measurement:
        ordered = sorted(values)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        return cls(median=median, low=ordered[0], high=ordered[-1], samples=len(ordered))

    def to_json(self) -> dict[str, float | int]:
        return {"median": self.median, "low": self.low, "high": self.high, "samples": self.samples}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        return cls(float(data["median"]), float(data["low"]), float(data["high"]), int(data["samples"]))


@dataclass(frozen=True)
class Hardware:
    """Peak FLOP/s per dtype (dense), bandwidth in bytes/s, capacity in bytes, and provenance.

    Probed hardware also carries ``measured_at`` and the ``Measurement`` behind each number.
    """

    name: str
    peak_flops: Mapping[str, float]
    bandwidth_bytes_per_s: float
    memory_bytes: float
    source: str
    measured_at: str | None = None
    bandwidth_probe: Measurement | None = None
    flops_probes: Mapping[str, Measurement] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read-only views: a Hardware is a value, shared by presets and analyses.
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "flops_probes", MappingProxyType(dict(self.flops_probes)))
        if not self.peak_flops:
            raise ValueError(f"hardware {self.name!r}: needs a peak FLOP/s for at least one dtype")
        for dtype, value in self.peak_flops.items():
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"hardware {self.name!r}: unknown dtype {dtype!r}")
            if not value > 0:
                raise ValueError(f"hardware {self.name!r}: peak for {dtype} must be positive")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"hardware {self.name!r}: bandwidth must be positive")
        if not self.memory_bytes > 0:
            raise ValueError(f"hardware {self.name!r}: memory must be positive")

    def peak(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            have = ", ".join(self.peak_flops)
            raise ValueError(
                f"hardware {self.name!r} has no {dtype} peak (it has: {have}); "
                "pass --peak-tflops or pick another --compute-dtype"
            ) from None

    def ridge_point(self, dtype: str) -> float:
        """FLOPs per byte at which compute and memory time are equal."""
        return self.peak(dtype) / self.bandwidth_bytes_per_s

    def with_overrides(
        self,
        *,
        dtype: str,
        peak_tflops: float | None = None,
        bandwidth_gbs: float | None = None,
        memory_gib: float | None = None,
    ) -> Hardware:
        """A copy with user-given values; the source note records what was overridden."""
        changes: dict[str, Any] = {}
        said = []
        if peak_tflops is not None:
            if peak_tflops <= 0:
                raise ValueError("--peak-tflops must be positive")
            changes["peak_flops"] = {**self.peak_flops, dtype: peak_tflops * TERA}
            said.append(f"{dtype} peak {peak_tflops:g} TFLOP/s")
        if bandwidth_gbs is not None:
            if bandwidth_gbs <= 0:
                raise ValueError("--bandwidth-gbs must be positive")
            changes["bandwidth_bytes_per_s"] = bandwidth_gbs * GIGA
            said.append(f"bandwidth {bandwidth_gbs:g} GB/s")
        if memory_gib is not None:
            if memory_gib <= 0:
                raise ValueError("--memory-gib must be positive")
            changes["memory_bytes"] = memory_gib * GIB
            said.append(f"memory {memory_gib:g} GiB")
        if not changes:
            return self
        return replace(self, source=f"{self.source}; user-set: {', '.join(said)}", **changes)

    def with_kernel_peak(self, dtype: str, measured: Measurement, kernel: str) -> Hardware:
        """A copy whose ``dtype`` peak is one kernel's measured compute ceiling (ridge's
        quantized GEMM for a block format: what its arithmetic, not the ISA's, can do). The
        source says what share that is of the ``dtype`` matmul peak it replaces (for int8 on a
        probed CPU, torch's int8 GEMM: how far the kernel's unpacking and scaling keep it from
        the instructions' own rate)."""
        said = f"{dtype} peak: {kernel}, {measured.high / 1e9:.0f} GFLOP/s"
        replaced = self.peak_flops.get(dtype)
        if replaced and measured.high <= replaced:
            said += f" ({measured.high / replaced:.0%} of the {dtype} matmul peak, {replaced / 1e9:.0f} GFLOP/s)"
        elif replaced:  # torch's int8 GEMM without VNNI (AVX2 alone) is the slower one
            said += f" ({measured.high / replaced:.1f}x the {dtype} matmul peak, {replaced / 1e9:.1f} GFLOP/s)"
        return replace(
            self,
            peak_flops={**self.peak_flops, dtype: measured.high},
            flops_probes={**self.flops_probes, dtype: measured},
            source=f"{self.source}; {said}",
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "memory_bytes": self.memory_bytes,
            "source": self.source,
        }
        if self.measured_at:
            data["measured_at"] = self.measured_at
        if self.bandwidth_probe:
            data["bandwidth_probe"] = self.bandwidth_probe.to_json()
        if self.flops_probes:
            data["flops_probes"] = {k: m.to_json() for k, m in self.flops_probes.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Hardware:
        """Inverse of ``to_json``; also reads hand-written files with just the four numbers."""
        try:
            return cls(
                name=str(data.get("name", "custom")),
                peak_flops={str(k): float(v) for k, v in data["peak_flops"].items()},
                bandwidth_bytes_per_s=float(data["bandwidth_bytes_per_s"]),
                memory_bytes=float(data["memory_bytes"]),
                source=str(data.get("source", "hardware JSON file")),
                measured_at=data.get("measured_at"),
                bandwidth_probe=(
                    Measurement.from_json(data["bandwidth_probe"]) if data.get("bandwidth_probe") else None
                ),
                flops_probes={k: Measurement.from_json(v) for k, v in (data.get("flops_probes") or {}).items()},
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"hardware JSON is missing or mistyping a field: {exc}") from None


def _tflops(**peaks: float) -> dict[str, float]:
    return {dtype: value * TERA for dtype, value in peaks.items()}


# Datasheet figures, dense (vendors quote 2x "with sparsity"); capacities in GiB (HBM and GDDR
# parts are binary-sized; driver reservations not subtracted).
HARDWARE_PRESETS: Mapping[str, Hardware] = MappingProxyType(
    {
        hw.name: hw
        for hw in (
            Hardware(
                name="a100-40gb",
                peak_flops=_tflops(fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624, int4=1248),
                bandwidth_bytes_per_s=1555 * GIGA,
                memory_bytes=40 * GIB,
                source="NVIDIA A100 datasheet, SXM4 40GB: 1,555 GB/s HBM2; tensor peaks dense",
            ),
            Hardware(
                name="a100-80gb",
                peak_flops=_tflops(fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624, int4=1248),
                bandwidth_bytes_per_s=2039 * GIGA,
                memory_bytes=80 * GIB,
                source="NVIDIA A100 datasheet, SXM4 80GB: 2,039 GB/s HBM2e; tensor peaks dense",
            ),
            Hardware(
                name="h100-sxm",
                peak_flops=_tflops(fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
                bandwidth_bytes_per_s=3350 * GIGA,
                memory_bytes=80 * GIB,
                source="NVIDIA H100 datasheet, SXM5: 3.35 TB/s HBM3; 989.4 TFLOP/s bf16 dense (1,979 sparse)",
            ),
            Hardware(
                name="h100-pcie",
                peak_flops=_tflops(fp32=51, tf32=378, bf16=756, fp16=756, fp8=1513, int8=1513),
                bandwidth_bytes_per_s=2000 * GIGA,
                memory_bytes=80 * GIB,
                source="NVIDIA H100 datasheet, PCIe: 2.0 TB/s HBM2e; 756 TFLOP/s bf16 dense (1,513 sparse)",
            ),
            Hardware(
                name="h200",
                peak_flops=_tflops(fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
                bandwidth_bytes_per_s=4800 * GIGA,
                memory_bytes=141 * GIB,
                source="NVIDIA H200 datasheet, SXM: 4.8 TB/s HBM3e, 141 GB; same tensor cores as H100 SXM",
            ),
            Hardware(
                name="b200",
                peak_flops=_tflops(fp32=75, tf32=1125, bf16=2250, fp16=2250, fp8=4500, int8=4500, fp4=9000),
                bandwidth_bytes_per_s=8000 * GIGA,
                memory_bytes=180 * GIB,
                source="NVIDIA HGX B200 datasheet, per GPU: 8 TB/s HBM3e, 180 GB; 2.25 PFLOP/s bf16 dense",
            ),
            Hardware(
                name="l40s",
                peak_flops=_tflops(fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733, int8=733, int4=733),
                bandwidth_bytes_per_s=864 * GIGA,
                memory_bytes=48 * GIB,
                source="NVIDIA L40S datasheet: 864 GB/s GDDR6; 362 TFLOP/s bf16 dense (733 sparse)",
            ),
            Hardware(
                name="rtx-4090",
                peak_flops=_tflops(fp32=82.6, bf16=165.2, fp16=165.2, fp8=330.3, int8=660.6, int4=1321.2),
                bandwidth_bytes_per_s=1008 * GIGA,
                memory_bytes=24 * GIB,
                source="NVIDIA Ada whitepaper, GeForce RTX 4090: 1,008 GB/s GDDR6X; fp16/bf16 with fp32 "
                "accumulate 165.2 TFLOP/s dense",
            ),
            Hardware(
                name="mi300x",
                peak_flops=_tflops(fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9, int8=2614.9),
                bandwidth_bytes_per_s=5300 * GIGA,
                memory_bytes=192 * GIB,
                source="AMD Instinct MI300X datasheet: 5.3 TB/s HBM3, 192 GB; 1,307 TFLOP/s bf16 dense",
            ),
        )
    }
)

DEFAULT_HARDWARE = "h100-sxm"


def resolve_hardware(
    spec: str | None,
    *,
    dtype: str = "bf16",
    peak_tflops: float | None = None,
    bandwidth_gbs: float | None = None,
    memory_gib: float | None = None,
    cache_dir: Path | None = None,
    reprobe: bool = False,
) -> Hardware:
    """A preset name, ``local`` (probed, cached), ``custom``, or a hardware JSON file.

    None means the default preset. ``custom`` builds hardware from the flags alone (both
    --peak-tflops and --bandwidth-gbs needed); otherwise the flags override the resolved
    hardware, the peak for ``dtype``.
    """
    overrides = dict(dtype=dtype, peak_tflops=peak_tflops, bandwidth_gbs=bandwidth_gbs, memory_gib=memory_gib)
    spec = spec or DEFAULT_HARDWARE
    if spec == "custom":
        if peak_tflops is None or bandwidth_gbs is None:
            raise ValueError("--hardware custom needs --peak-tflops and --bandwidth-gbs")
        return Hardware(
            name="custom",
            peak_flops={dtype: peak_tflops * TERA},
            bandwidth_bytes_per_s=bandwidth_gbs * GIGA,
            memory_bytes=(memory_gib or 80) * GIB,
            source="user-given values" + ("" if memory_gib else " (memory defaults to 80 GiB)"),
        )
    if spec == "local":
        from ridge.roofline.probe import local_hardware

        return local_hardware(cache_dir=cache_dir, reprobe=reprobe).with_overrides(**overrides)
    if spec in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[spec].with_overrides(**overrides)
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return Hardware.from_json(data).with_overrides(**overrides)
    known = ", ".join([*HARDWARE_PRESETS, "local", "custom"])
    raise ValueError(f"--hardware {spec!r} is not one of {known}, nor a hardware JSON file")
