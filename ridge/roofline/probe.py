"""``--hardware local``: this machine measured by short probes, cached on disk with the date.

Two probes, a few seconds in all, each keeping the *best* of several trials (a ceiling is the
most the machine can do; a slower trial only measured a disturbance):

* memory read bandwidth: ``sum()`` of a tensor far larger than the last-level cache, with
  every thread, and, where ridge's CPU kernels run, their weight-streaming GEMV over a
  weight as large (the decode step's own access pattern, which can beat ``sum()``);
* matmul FLOP/s per dtype: ``F.linear`` products (x @ W^T, the layout every model layer
  runs), square, growing the size while it stays within a time budget, and for bf16 the
  linear layer of ridge's own CPU kernels where they run (``select_kernels``: AVX-512's GEMM,
  or on AVX2 alone torch's float32 GEMM on the widened weight). Those beat torch's bf16 GEMM
  (on the 2-core Zen 3 EPYC, without AVX-512 BF16, 12-18 GFLOP/s against 78-95), and a peak
  they beat would put prefill above 100% of its roofline. ``torch.matmul`` of two row-major
  squares is not that layout: in bf16 there it ran 0.3-1.4 GFLOP/s and put every decode step
  of ``benchmarks/compare.py`` at "over 1000% of its floor".

Each number keeps the spread of its trials. The cache is ``$RIDGE_CACHE_DIR/hardware-local.json``
(else ``~/.cache/ridge/``); it is a hardware JSON file, so ``--hardware <that file>`` feeds the
same analysis. It records when it was taken and how busy the other processes kept the CPUs
meanwhile, and is probed again when asked (``--reprobe``), when the machine's fingerprint (CPU,
threads, torch) changed, when it is older than ``MAX_AGE``, or when it was taken under load.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ridge.config import default_cache_dir
from ridge.dtypes import PRICED_TORCH
from ridge.roofline.hardware import GIB, Hardware, Measurement

CACHE_FILE_NAME = "hardware-local.json"
# A cached probe older than this is taken again (a machine's memory level can change).
MAX_AGE = dt.timedelta(days=1)
# A probe during which other processes kept more than this share of the CPUs busy measured
# the neighbours too: it is used once, then taken again at the next start.
BUSY_LOAD = 0.25


# the dtypes whose matmuls the probe times (F.linear's; int8: torch._int_mm)
PROBE_DTYPES = ("fp32", "bf16", "fp16", "int8")


@dataclass(frozen=True)
class ProbeSettings:
    """Sizes and budgets of the probes (tests shrink them)."""

    bandwidth_bytes: int = 512 * 1024**2  # 16x the dev box's 32 MiB L3
    bandwidth_repeats: int = 10
    matmul_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    matmul_repeats: int = 5
    matmul_budget_s: float = 1.0  # per dtype
    dtypes: tuple[str, ...] = PROBE_DTYPES
    ridge_kernels: bool = True  # also time ridge's own CPU kernels (where they run)

    def __post_init__(self) -> None:
        if self.bandwidth_bytes < 4096 or self.bandwidth_repeats < 1 or self.matmul_repeats < 1:
            raise ValueError("ProbeSettings: sizes and repeat counts must be positive")
        if not self.matmul_sizes or sorted(self.matmul_sizes) != list(self.matmul_sizes):
            raise ValueError("ProbeSettings: matmul_sizes must be a non-empty ascending tuple")
        unknown = set(self.dtypes) - set(PROBE_DTYPES)
        if unknown:
            raise ValueError(f"ProbeSettings: cannot probe dtypes {sorted(unknown)}")


# What the probes time; a cache taken by other probes is taken again. 2: matmuls in F.linear's
# layout and ridge's kernels on AVX2 (1 timed torch.matmul of row-major squares).
PROBE_VERSION = 2


def machine_fingerprint() -> dict[str, str | int]:
    """What the measurements depend on (and how they are taken); a change invalidates the cache."""
    return {
        "probe": PROBE_VERSION,
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count() or 1,
        "threads": os.cpu_count() or 1,
        "torch": torch.__version__,
    }


def local_hardware(
    cache_dir: Path | None = None,
    reprobe: bool = False,
    settings: ProbeSettings = ProbeSettings(),
) -> Hardware:
    """This machine's roofline: from the cache when it is current, else probed and cached."""
    path = (cache_dir or default_cache_dir()) / CACHE_FILE_NAME
    fingerprint = machine_fingerprint()
    if not reprobe and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("fingerprint") == fingerprint and not cache_is_stale(data):
                return Hardware.from_json(data)
        except (json.JSONDecodeError, ValueError, TypeError):
            pass  # unreadable cache: measure again and overwrite it
    hardware, load = probe_local_with_load(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**hardware.to_json(), "fingerprint": fingerprint, "probe_settings": asdict(settings), "other_load": load}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return hardware


def cache_is_stale(data: dict, now: dt.datetime | None = None) -> bool:
    """Older than ``MAX_AGE``, taken under load, or not saying when or under what load."""
    measured = data.get("measured_at")
    load = data.get("other_load")
    if not measured or load is None:
        return True
    age = (now or dt.datetime.now(dt.UTC)) - dt.datetime.fromisoformat(measured)
    return age > MAX_AGE or age < dt.timedelta(0) or float(load) > BUSY_LOAD


def probe_local_with_load(settings: ProbeSettings = ProbeSettings()) -> tuple[Hardware, float]:
    """``probe_local``, and the share of the CPUs other processes kept busy around it (the
    larger of a reading just before and one just after)."""
    before = other_load()
    hardware = probe_local(settings)
    load = max(before, other_load())
    note = f"; other processes used {load:.0%} of the CPUs during the probe"
    if load > BUSY_LOAD:
        note += " (a busy machine: probed again at the next start)"
    return dataclasses.replace(hardware, source=hardware.source + note), load


def probe_local(settings: ProbeSettings = ProbeSettings()) -> Hardware:
    """Run the probes now (with every logical CPU as a torch thread) and return the result."""
    threads = os.cpu_count() or 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels = _ridge_kernels() if settings.ridge_kernels else None
        bandwidth = probe_bandwidth(settings, kernels)
        flops = {}
        for dtype in settings.dtypes:
            measured = probe_matmul(dtype, settings, kernels)
            if measured is not None:
                flops[dtype] = measured
    finally:
        torch.set_num_threads(previous)
    if not flops:
        raise RuntimeError("no matmul dtype could be probed on this machine")
    said = f" and ridge's {kernels.name} kernels' bf16 linear layer" if kernels is not None else ""
    return Hardware(
        name="local",
        peak_flops={dtype: m.high for dtype, m in flops.items()},
        bandwidth_bytes_per_s=bandwidth.high,
        memory_bytes=_physical_memory_bytes(),
        source=(
            f"measured on this machine ({cpu_model()}, {threads} threads, torch {torch.__version__}): "
            f"sum() over {settings.bandwidth_bytes / 1024**2:.0f} MiB fp32, square F.linear{said}; "
            "the best of repeated runs"
        ),
        measured_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        bandwidth_probe=bandwidth,
        flops_probes=flops,
    )


def probe_bandwidth(settings: ProbeSettings, kernels=None) -> Measurement:
    """Read bandwidth in bytes/s over repeated trials: ``sum()`` over a large fp32 tensor
    (read once per run) and, with ridge's kernels, their one-row bf16 linear layer over a
    weight as large (AVX-512: the streaming GEMV on the packed weight). ``Measurement.high`` is
    the ceiling; the spread says how steady the machine was."""
    data = torch.ones(settings.bandwidth_bytes // 4, dtype=torch.float32)
    data.sum()  # warm-up: first touch, thread pool start
    rates = [data.numel() * 4 / _seconds(data.sum) for _ in range(settings.bandwidth_repeats)]
    del data
    if kernels is not None:
        gemv = _ridge_gemv_runner(kernels, settings.bandwidth_bytes)
        if gemv is not None:
            run, nbytes = gemv
            run()
            rates += [nbytes / _seconds(run) for _ in range(settings.bandwidth_repeats)]
    return Measurement.of(rates)


def probe_read_bandwidth(settings: ProbeSettings = ProbeSettings()) -> Measurement:
    """``probe_bandwidth`` as ``--hardware local`` takes it: ``sum()`` and, where ridge's CPU
    kernels run (and ``settings.ridge_kernels``), their weight-streaming GEMV. Every floor
    ridge prints (the analyzer's, ``ridge bench``'s, the benchmarks') divides by its ``.high``:
    a ``sum()`` alone read 21-24 GB/s on the 2-core Xeon where ridge's bf16 decode step
    streamed 30, and put that step at 139% of its floor. (On the 2-core Zen 3 EPYC the two are
    close: ``sum()`` 21-24 GB/s, the AVX2 kernels' bf16 GEMV 18-21.)"""
    return probe_bandwidth(settings, _ridge_kernels() if settings.ridge_kernels else None)


def probe_matmul(dtype: str, settings: ProbeSettings, kernels=None) -> Measurement | None:
    """FLOP/s of n x n matmuls in ``dtype``: the size whose best run is fastest, within a time
    budget, for torch's ``F.linear`` and (bf16, with ridge's kernels) their linear layer; the
    better of the two.

    Returns None when the dtype has no usable matmul here.
    """
    candidates = [_probe_sizes(lambda n: _matmul_runner(dtype, n), settings)]
    if kernels is not None and dtype == "bf16":
        candidates.append(_probe_sizes(lambda n: _ridge_matmul_runner(kernels, n), settings))
    found = [m for m in candidates if m is not None]
    return max(found, key=lambda m: m.high) if found else None


def probe_block_kernel(
    fmt_name: str, repeats: int = 30, rows: int = 64, warmup_s: float = 0.15, min_s: float = 0.25
) -> Measurement | None:
    """FLOP/s (2 per multiply-add) of ridge's quantized GEMM for one block format when the
    arithmetic binds: ``rows`` activation rows (AVX-512: tiles of 16, each block of weights
    passing all of them while in L1; AVX2: 4 rows share each unpacked group) against a
    (512 x 2048) weight that stays in cache, so no memory stream limits it. The kernel's
    compute ceiling for ``ridge analyze --weight-format``; None where ridge's kernels do not
    run here or do not take the format. Zero blocks: the integer and float work per block does
    not depend on the values. On the 2-core EPYC Zen 4 (2 threads): int8 531, int4 546, q4_k 518,
    q5_k 494, iq4_xs 527, q6_k 461, q3_k 480, q2_k 410 GFLOP/s at 64 rows; one row reaches 28-42%
    of that (the weights' unpacking is not shared): above what a weight read from memory leaves
    it at batch 1, except Q3_K's and Q2_K's one-row loops, which at the memory's fast level
    (25-30 GB/s a core) run at about their own speed (README, "Stop 95"). On 2 Zen 5 cores
    (2026-11-28, median of 3): int8 1025, int4 1062, q4_k 1045, q5_k 1034, iq4_xs 1064, q6_k
    990, q3_k 1077, q2_k 1071 GFLOP/s, 51-56% of torch's int8 GEMM there (1.93 TFLOP/s); a
    decode step of 8 rows streamed from memory runs at that ceiling (q2_k 1036, q3_k 1067
    GFLOP/s): ``ridge analyze`` places q2_k's linear layers compute-bound from batch 3 at 80
    GB/s.

    The first runs of a process read low, so the kernel runs ``warmup_s`` before the
    ``repeats`` samples, which go on for at least ``min_s`` (2026-11-28, the Zen 5 cores: the
    first of 8 back-to-back probes read 0.91-0.98x the rest, and six ``ridge analyze`` runs
    with 60 ms of samples and no warm-up 562-1027 GFLOP/s for q4_k, four with it 1020-1047).
    """
    from ridge.quantization.formats import FORMAT_ALIASES, FORMATS

    kernels = _ridge_kernels()
    name = FORMAT_ALIASES.get(fmt_name.lower(), fmt_name.lower())
    if kernels is None or name not in FORMATS or not kernels.takes_format(FORMATS[name]):
        return None
    n, k = 512, 2048
    layer = _kernel_layer(kernels, n, k, fmt=FORMATS[name])
    x = torch.randn(rows, k).to(torch.bfloat16)

    def run():
        for _ in range(8):
            kernels.linear(x, layer)

    started = time.perf_counter()
    while time.perf_counter() - started < warmup_s:
        run()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < repeats or time.perf_counter() - started < min_s:
        samples.append(2 * 8 * rows * n * k / _seconds(run))
    return Measurement.of(samples)


def _probe_sizes(make_runner: Callable[[int], Callable[[], object]], settings: ProbeSettings) -> Measurement | None:
    best: Measurement | None = None
    spent = 0.0
    for n in settings.matmul_sizes:
        try:
            run = make_runner(n)
            first = _seconds(run)  # warm-up, also the price of one more run
        except (RuntimeError, NotImplementedError):
            return best
        spent += first
        if best is not None and spent + first * settings.matmul_repeats > settings.matmul_budget_s:
            break  # a bigger size would blow the budget (fp16 on CPUs without it is ~1 GFLOP/s)
        times = [_seconds(run) for _ in range(settings.matmul_repeats)]
        spent += sum(times)
        measured = Measurement.of([2 * n**3 / t for t in times])
        if best is None or measured.high > best.high:
            best = measured
        if spent > settings.matmul_budget_s:
            break
    return best


def _matmul_runner(dtype: str, n: int) -> Callable[[], object]:
    if dtype == "int8":
        a = torch.randint(-64, 64, (n, n), dtype=torch.int8)
        b = torch.randint(-64, 64, (n, n), dtype=torch.int8)
        return lambda: torch._int_mm(a, b)  # int8 x int8 -> int32, the VNNI path
    x = torch.randn(n, n).to(PRICED_TORCH[dtype])
    weight = torch.randn(n, n).to(PRICED_TORCH[dtype])
    return lambda: F.linear(x, weight)  # x @ W^T, W as (out, in): a model layer's layout


def _ridge_kernels():
    """ridge's CPU kernels for bf16 where they run here (``CpuKernels`` on AVX-512 BF16,
    ``Avx2Kernels`` on AVX2), else None: torch's numbers alone."""
    from ridge.layers.cpu_kernels import select_kernels
    from ridge.layers.kernels import TorchKernels

    with warnings.catch_warnings():  # no compiler: said by the engine when it loads, not here
        warnings.simplefilter("ignore")
        kernels = select_kernels("auto", torch.device("cpu"), torch.bfloat16)
    return None if type(kernels) is TorchKernels else kernels


def _kernel_layer(kernels, n: int, k: int, weight: torch.Tensor | None = None, fmt=None):
    """An (n x k) linear layer as a model's loader leaves it for ``kernels``: a bf16
    ``weight``, or zero blocks of block format ``fmt`` (the work per block does not depend on
    the values), repacked where the kernels repack."""
    from ridge.layers.linear import Linear
    from ridge.quantization.methods import BlockQuantLinearMethod

    layer = Linear(k, n, bias=False, method=BlockQuantLinearMethod(fmt) if fmt is not None else None)
    if fmt is not None:
        layer.blocks.zero_()
    else:
        layer.weight.data = weight
    layer.method.process_weights_after_loading(layer, kernels)
    return layer


def _ridge_matmul_runner(kernels, n: int) -> Callable[[], object]:
    """ridge's bf16 linear layer on n rows (the prefill path: the weight as the model holds it)."""
    x = torch.randn(n, n).to(torch.bfloat16)
    layer = _kernel_layer(kernels, n, n, weight=torch.randn(n, n).to(torch.bfloat16))
    return lambda: kernels.linear(x, layer)


def _ridge_gemv_runner(kernels, nbytes: int) -> tuple[Callable[[], object], int] | None:
    """ridge's one-row bf16 linear layer over a weight of about ``nbytes``: (run, bytes read)."""
    k = 4096
    n = max(16, (nbytes // (2 * k)) // 16 * 16)
    try:  # values don't change a read
        layer = _kernel_layer(kernels, n, k, weight=torch.full((n, k), 0.01, dtype=torch.bfloat16))
    except RuntimeError:
        return None
    x = torch.randn(1, k).to(torch.bfloat16)
    return (lambda: kernels.linear(x, layer)), n * k * 2


def other_load(window_s: float = 0.25) -> float:
    """The share of the CPUs other processes keep busy, sampled over ``window_s`` while this
    process sleeps (so all the busy time ``/proc/stat`` counts is theirs). 0 where unknown."""
    before = _machine_busy_s()
    time.sleep(window_s)
    after = _machine_busy_s()
    if before is None or after is None:
        return 0.0
    return min(1.0, max(0.0, (after - before) / (window_s * (os.cpu_count() or 1))))


def _machine_busy_s() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]  # steal counts: a neighbour VM took the CPU
    return busy / os.sysconf("SC_CLK_TCK")


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return max(time.perf_counter() - start, 1e-9)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for saying where a figure was measured, with its
    family and model numbers where the name leaves them out: a VM's "AMD EPYC" is a Zen 3
    (family 25 model 1), a Zen 4 (25, 17) or a Zen 5 (26, 2), and the benchmarks that keep
    one entry per CPU must not file one's figures under another's."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break  # the first processor's block
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def _physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * GIB  # unknown: a stated guess beats a crash; --memory-gib overrides it


def probe_linear_flops(
    matmul, layer, dtype: torch.dtype, device: torch.device, rows: int = 32, repeats: int = 5
) -> float:
    """FLOP/s that ``matmul(x, layer)`` (an engine's own kernel on one of its layers) reaches
    on ``rows`` rows: the compute roof its decode and verify steps really meet, which can be
    far below the machine's best GEMM (here: ridge's AVX-512 kernel against torch's AMX one).
    The median of ``repeats`` timed calls after one warm-up."""
    x = torch.randn(rows, layer.in_features, dtype=dtype, device=device)
    flops = 2.0 * rows * layer.in_features * layer.out_features
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        matmul(x, layer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return flops / statistics.median(times)
