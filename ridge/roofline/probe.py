"""``--hardware local``: this machine measured by short probes, cached on disk with the date.

Two probes, a few seconds in all: memory read bandwidth (``sum()`` of a tensor far larger than
the last-level cache, with every thread) and matmul FLOP/s per dtype (``torch.matmul`` of
square matrices, growing the size while it stays within a time budget, keeping the fastest
size). Each number is the median of several runs, kept with its range: memory bandwidth on
shared machines is noisy (on the 2-core dev box it is bimodal, ~35 vs ~60 GB/s).

The cache is ``$RIDGE_CACHE_DIR/hardware-local.json`` (else ``~/.cache/ridge/``); it is a
hardware JSON file, so ``--hardware <that file>`` feeds the same analysis. It is re-probed when
asked (``--reprobe``) or when the machine's fingerprint (CPU, threads, torch) changed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from ridge.config import default_cache_dir

from ridge.roofline.hardware import GIB, Hardware, Measurement

CACHE_FILE_NAME = "hardware-local.json"

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
}


@dataclass(frozen=True)
class ProbeSettings:
    """Sizes and budgets of the probes (tests shrink them)."""

    bandwidth_bytes: int = 512 * 1024**2  # 16x the dev box's 32 MiB L3
    bandwidth_repeats: int = 10
    matmul_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    matmul_repeats: int = 5
    matmul_budget_s: float = 1.0  # per dtype
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8")

    def __post_init__(self) -> None:
        if self.bandwidth_bytes < 4096 or self.bandwidth_repeats < 1 or self.matmul_repeats < 1:
            raise ValueError("ProbeSettings: sizes and repeat counts must be positive")
        if not self.matmul_sizes or sorted(self.matmul_sizes) != list(self.matmul_sizes):
            raise ValueError("ProbeSettings: matmul_sizes must be a non-empty ascending tuple")
        unknown = set(self.dtypes) - set(_TORCH_DTYPES)
        if unknown:
            raise ValueError(f"ProbeSettings: cannot probe dtypes {sorted(unknown)}")


def machine_fingerprint() -> dict[str, str | int]:
    """What the measurements depend on; a change invalidates the cache."""
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count() or 1,
        "threads": os.cpu_count() or 1,
        "torch": torch.__version__,
    }


def local_hardware(
    cache_dir: Path | None = None,
    reprobe: bool = False,
    settings: ProbeSettings = ProbeSettings(),
) -> Hardware:
    """This machine's roofline: from the cache when it matches, else probed and cached."""
    path = (cache_dir or default_cache_dir()) / CACHE_FILE_NAME
    fingerprint = machine_fingerprint()
    if not reprobe and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("fingerprint") == fingerprint:
                return Hardware.from_json(data)
        except (json.JSONDecodeError, ValueError):
            pass  # unreadable cache: measure again and overwrite it
    hardware = probe_local(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**hardware.to_json(), "fingerprint": fingerprint, "probe_settings": asdict(settings)}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return hardware


def probe_local(settings: ProbeSettings = ProbeSettings()) -> Hardware:
    """Run the probes now (with every logical CPU as a torch thread) and return the result."""
    threads = os.cpu_count() or 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = probe_bandwidth(settings)
        flops = {}
        for dtype in settings.dtypes:
            measured = probe_matmul(dtype, settings)
            if measured is not None:
                flops[dtype] = measured
    finally:
        torch.set_num_threads(previous)
    if not flops:
        raise RuntimeError("no matmul dtype could be probed on this machine")
    return Hardware(
        name="local",
        peak_flops={dtype: m.median for dtype, m in flops.items()},
        bandwidth_bytes_per_s=bandwidth.median,
        memory_bytes=_physical_memory_bytes(),
        source=(
            f"measured on this machine ({_cpu_model()}, {threads} threads, torch {torch.__version__}): "
            f"sum() over {settings.bandwidth_bytes / 1024**2:.0f} MiB fp32; square torch.matmul; "
            "medians of repeated runs"
        ),
        measured_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        bandwidth_probe=bandwidth,
        flops_probes=flops,
    )


def probe_bandwidth(settings: ProbeSettings) -> Measurement:
    """Read bandwidth in bytes/s: time ``sum()`` over a large fp32 tensor (read once per run)."""
    data = torch.ones(settings.bandwidth_bytes // 4, dtype=torch.float32)
    data.sum()  # warm-up: first touch, thread pool start
    rates = [data.numel() * 4 / _seconds(data.sum) for _ in range(settings.bandwidth_repeats)]
    return Measurement.of(rates)


def probe_matmul(dtype: str, settings: ProbeSettings) -> Measurement | None:
    """FLOP/s of an n x n matmul in ``dtype``: the best size that fits the time budget.

    Returns None when the dtype has no usable matmul here.
    """
    best: Measurement | None = None
    spent = 0.0
    for n in settings.matmul_sizes:
        try:
            run = _matmul_runner(dtype, n)
            first = _seconds(run)  # warm-up, also the price of one more run
        except (RuntimeError, NotImplementedError):
            return best
        spent += first
        if best is not None and spent + first * settings.matmul_repeats > settings.matmul_budget_s:
            break  # a bigger size would blow the budget (fp16 on CPUs without it is ~1 GFLOP/s)
        times = [_seconds(run) for _ in range(settings.matmul_repeats)]
        spent += sum(times)
        measured = Measurement.of([2 * n**3 / t for t in times])
        if best is None or measured.median > best.median:
            best = measured
        if spent > settings.matmul_budget_s:
            break
    return best


def _matmul_runner(dtype: str, n: int) -> Callable[[], object]:
    if dtype == "int8":
        a = torch.randint(-64, 64, (n, n), dtype=torch.int8)
        b = torch.randint(-64, 64, (n, n), dtype=torch.int8)
        return lambda: torch._int_mm(a, b)  # int8 x int8 -> int32, the VNNI path
    a = torch.randn(n, n).to(_TORCH_DTYPES[dtype])
    b = torch.randn(n, n).to(_TORCH_DTYPES[dtype])
    return lambda: torch.matmul(a, b)


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return max(time.perf_counter() - start, 1e-9)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * GIB  # unknown: a stated guess beats a crash; --memory-gib overrides it
