"""ridge's own CPU kernels: a bf16 GEMM for small M (decode) and fused decode ops.

Stock ``F.linear`` with one row reads bf16 weights at about half the memory bandwidth on
the AVX-512 machines ridge is developed on (see ``../shared/notes/cpu-matmul.md``); this
kernel (``csrc/linear_bf16.cpp``, weights repacked at load into 16-row x 2-k blocks)
streams them at ~95% and stays near the bandwidth floor up to batch 8; ``csrc/decode_ops.cpp``
fuses the small ops around it (and gives float32 its paged decode attention).

The extension is compiled with torch's cpp_extension and cached on disk
(``$RIDGE_CACHE_DIR/extensions``). Setup compiles it (``make run`` / ``make test`` run
``python -m ridge.layers.cpu_kernels``), so a first run only loads it; a build that does
happen at first use says so on stderr, with its progress, instead of looking hung. Where
the extension cannot be used (no AVX-512 BF16, no compiler, another dtype or device) ridge
runs the torch ops; on a CPU with AVX2 alone, the block formats' matmuls run a second, smaller
extension (``csrc/avx2_blocks.cpp``, ``Avx2Kernels``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import default_cache_dir

CSRC_DIR = Path(__file__).with_name("csrc")
SOURCES = (
    "linear_bf16.cpp",
    "linear_quant.cpp",
    "decode_ops.cpp",
    "decode_attention_quant.cpp",
    "decode_attention_shared.cpp",
    "decode_layers.cpp",
    "prefetch.cpp",
    "bindings.cpp",
)
HEADERS = (
    "amx.h",
    "block_runs.h",
    "cpu_vendor.h",
    "kernels.h",
    "kv_codes.h",
    "kv_query.h",
    "kv_write.h",
    "linear_call.h",
    "paged_rows.h",
    "plan_shared.h",
    "simd_math.h",
    "step_parts.h",
    "weight_arena.h",
)
EXTENSION_NAME = "ridge_cpu"


@dataclass(frozen=True)
class ExtensionSpec:
    """One of ridge's CPU extensions: its module name, what it compiles, with which
    instruction sets, and where under ``extension_build_dir()`` it builds (each its own ninja
    file)."""

    name: str
    label: str  # what progress lines call it
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    flags: tuple[str, ...]
    subdir: str = ""
    build_time: str = "1-2 minutes"


# The AVX-512 BF16/VNNI kernels: everything CpuKernels runs.
AVX512 = ExtensionSpec(
    EXTENSION_NAME,
    "the CPU kernels",
    SOURCES,
    HEADERS,
    (
        "-O3",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512bf16",
        "-mavx512vnni",
        "-mamx-tile",  # AMX runs only where the CPU has it (linear_bf16.cpp asks at run time)
        "-mamx-bf16",
        "-mamx-int8",
        "-mf16c",
        "-mgfni",  # cpu_has_avx512_bf16 asks for it
        "-mavx512vbmi",  # and for this (byte permutes: decode_attention_quant.cpp)
        "-mfma",
        "-fopenmp",
    ),
)
# The block formats' matmul, dense bf16 layers on a few rows and a decode step's other ops for
# CPUs with AVX2 only, and their decode plan (Avx2Kernels; csrc/avx2_blocks.cpp, csrc/avx2_dense.cpp,
# csrc/avx2_ops.cpp, csrc/avx2_plan.cpp).
AVX2 = ExtensionSpec(
    "ridge_cpu_avx2",
    "the AVX2 kernels",
    ("avx2_blocks.cpp", "avx2_dense.cpp", "avx2_ops.cpp", "avx2_plan.cpp"),
    (
        "avx2_kernels.h",
        "avx2_simd.h",
        "cpu_vendor.h",
        "kv_query.h",
        "kv_write.h",
        "paged_rows.h",
        "plan_shared.h",
        "step_parts.h",
        "weight_arena.h",
    ),
    # no contraction into FMAs but the kernel's own: one row's float ops must not depend on how
    # many rows a tile holds (a row's output does not depend on its batch)
    ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"),
    "avx2",
    "about a minute",
)
# Progress lines while a build runs (it takes 1-2 minutes on 2 cores).
PROGRESS_EVERY_S = 15.0
# cpp_extension's build lock: a build that was killed leaves it, and cpp_extension would wait on
# it forever. ridge waits for it instead, saying so, and takes a lock as such a leftover once
# nothing in the build directory has been written for this long (a live build writes an object
# file every minute or so; the longest, linear_quant.cpp, takes about one on 2 cores).
STALE_LOCK_S = 300.0
LOCK_POLL_S = 0.1
# Every load takes the lock for a moment (cpp_extension's ninja finds nothing to do): a wait
# shorter than this says nothing.
LOCK_QUIET_S = 2.0


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is not)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def cpu_has_avx512_bf16() -> bool:
    """AVX-512 BF16, VNNI, GFNI and VBMI: what the kernels use (Zen 4 and Sapphire Rapids on have
    all four; Cooper Lake has BF16 without GFNI, which the block formats' unpacking needs, or
    VBMI's byte permutes, which the fp8 KV cache's PV takes)."""
    flags = cpu_flags()
    return all(f in flags for f in ("avx512_bf16", "avx512_vnni", "gfni", "avx512vbmi"))


PREFETCH_ENV = "RIDGE_PREFETCH"


class PrefetchEnvError(ValueError):
    """``$RIDGE_PREFETCH`` does not say a prefetch policy (raised at load, never a silent fallback)."""


def prefetch_setting(text: str) -> tuple[str | None, dict[str, int]]:
    """``$RIDGE_PREFETCH``'s text -> (a vendor table's name or None, {key: value}).

    Comma-separated items, each a table (``amd``: Zen 4 and older, ``zen5``, ``intel``,
    ``cpu``: this CPU's) or ``key=value`` (``bf16_far``, ``quant_near_rows``,
    ``quant_near_every``, ``int8_near_rows``, ``quant_far_nta``, ``quant_far_lines``,
    ``quant_far_kib``, ``quant_interleave``, ``q3_k_set1_rows``, ``quant_shift_rows``,
    ``quant_far_scales``, ``quant_alternate``; csrc/linear_call.h), applied over the table,
    e.g. ``amd,quant_near_rows=1``."""
    preset, values = None, {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq:
            if preset is not None:
                raise PrefetchEnvError(f"{PREFETCH_ENV}: two tables, {preset!r} and {key!r}")
            preset = key
            continue
        try:
            values[key.strip()] = int(value)
        except ValueError:
            raise PrefetchEnvError(f"{PREFETCH_ENV}: {item!r} is not key=integer") from None
    return preset, values


def apply_prefetch(ext, text: str) -> dict[str, int]:
    """Set the extension's prefetch policy from ``$RIDGE_PREFETCH``-style text; returns it."""
    preset, values = prefetch_setting(text)
    # the extension's own check, asked before anything is set (never a C++ throw: one GPU
    # image's build crashed on those)
    error = ext.prefetch_error(preset or "", values)
    if error:
        raise PrefetchEnvError(f"{PREFETCH_ENV}={text!r}: {error}")
    policy = dict(ext.prefetch_preset(preset)) if preset else {}
    ext.set_prefetch_policy(policy | values)
    return ext.prefetch_policy()


def loaded_prefetch_policy() -> dict[str, int] | None:
    """The kernels' prefetch policy in this process (what benchmarks record beside their
    figures), or None where the extension is not loaded."""
    return dict(_LOADED.prefetch_policy()) if _LOADED is not None else None


def extension_build_dir(spec: ExtensionSpec = AVX512) -> Path:
    return default_cache_dir() / "extensions" / f"torch-{torch.__version__}" / spec.subdir


def extension_is_built(spec: ExtensionSpec = AVX512) -> bool:
    """A build of these sources newer than every one of them exists, made from this checkout's
    paths with this torch's headers (cpp_extension then only loads it; it rebuilds, for minutes,
    where its build file names another checkout's sources or another environment's torch)."""
    from torch.utils.cpp_extension import include_paths

    build_dir = extension_build_dir(spec)
    built, ninja = build_dir / f"{spec.name}.so", build_dir / "build.ninja"
    if not built.is_file() or not ninja.is_file():
        return False
    recipe = ninja.read_text()
    if include_paths()[0] not in recipe or any(f"compile {CSRC_DIR / name}" not in recipe for name in spec.sources):
        return False
    newest_source = max((CSRC_DIR / name).stat().st_mtime for name in spec.sources + spec.headers)
    return built.stat().st_mtime >= newest_source


def load_extension(progress=sys.stderr):
    """Load ridge's CPU extension, compiling it first if needed; returns the module.

    A compile prints what it is doing to ``progress`` (a start line, a line every
    ``PROGRESS_EVERY_S`` seconds, and the time it took); a load prints nothing. A process holds
    one copy: later calls return the module loaded first, whatever ``$RIDGE_CACHE_DIR`` says
    by then (a second copy from another build directory could not register its classes).
    ``$RIDGE_PREFETCH`` (``prefetch_setting``) changes the kernels' prefetch policy from the
    CPU vendor's; one it cannot apply raises ``PrefetchEnvError``.
    """
    global _LOADED
    if _LOADED is None:
        module = _load_extension(progress)
        if os.environ.get(PREFETCH_ENV):
            apply_prefetch(module, os.environ[PREFETCH_ENV])
        keep_freed_memory()
        _LOADED = module
    return _LOADED


_LOADED = None  # the extension this process loaded

# glibc's mallopt parameters, and the values keep_freed_memory sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_TRIM_BYTES = 512 << 20  # freed memory kept in the heap up to this much before its top goes back
MALLOC_MMAP_BYTES = 32 << 20  # glibc's largest: blocks up to this come from the heap, not a fresh mmap
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Let glibc keep and reuse the activations' freed blocks instead of giving them back to
    the kernel; True where it was set.

    A prefill step allocates and frees the same tens of megabytes op after op (a 512-token
    slab's gate_up output alone is 11.5 MB). Past glibc's dynamic thresholds those blocks were
    mmapped fresh or trimmed off the heap's top, so every op paid page faults and zeroed pages
    again: 11% of a Q2_K file's 512-token prefill ran in the kernel (0.25% for Q8_0, whose
    allocations happened to reuse), and setting these thresholds took that prefill from 418-448
    to 490-510 tokens/s (Q8_0 490 -> 502; 2-core Zen 5, 2026-11-27). A user's own ``MALLOC_*``
    settings (or a preloaded allocator's, which ignores mallopt) are left alone."""
    if sys.platform != "linux" or any(name in os.environ for name in MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES)) and bool(mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES))


def cpu_has_avx2() -> bool:
    """AVX2, FMA and F16C: what the AVX2 kernels use (every x86 core since Haswell and Zen 1)."""
    flags = cpu_flags()
    return {"avx2", "fma", "f16c"} <= flags


def load_avx2_extension(progress=sys.stderr):
    """Load the AVX2 kernels' extension (``csrc/avx2_blocks.cpp``), compiling it first if
    needed (about a minute), as ``load_extension`` does; returns the module."""
    global _LOADED_AVX2
    if _LOADED_AVX2 is None:
        _LOADED_AVX2 = _load_extension(progress, AVX2)
    return _LOADED_AVX2


_LOADED_AVX2 = None


def _load_extension(progress, spec: ExtensionSpec = AVX512):
    from torch.utils.cpp_extension import load

    # The ninja that pip installs with ridge sits beside this interpreter, which may not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    build_dir = extension_build_dir(spec)
    build_dir.mkdir(parents=True, exist_ok=True)
    _wait_for_build_lock(build_dir, progress)
    building = not extension_is_built(spec)
    done = threading.Event()
    if building and progress is not None:
        start = time.monotonic()
        print(
            f"ridge: compiling {spec.label} into {build_dir} (once per machine and torch version; "
            f"{spec.build_time} on 2 cores)...",
            file=progress,
            flush=True,
        )

        def heartbeat() -> None:
            while not done.wait(PROGRESS_EVERY_S):
                print(
                    f"ridge: still compiling {spec.label} ({time.monotonic() - start:.0f} s)",
                    file=progress,
                    flush=True,
                )

        threading.Thread(target=heartbeat, name="ridge-build-progress", daemon=True).start()
    try:
        module = load(
            name=spec.name,
            sources=[str(CSRC_DIR / name) for name in spec.sources],
            extra_cflags=list(spec.flags),
            build_directory=str(build_dir),
            verbose=False,
        )
    finally:
        done.set()
    if building and progress is not None:
        print(f"ridge: {spec.label} compiled in {time.monotonic() - start:.0f} s", file=progress, flush=True)
    return module


def _wait_for_build_lock(
    build_dir: Path,
    progress,
    stale_s: float = STALE_LOCK_S,
    poll_s: float = LOCK_POLL_S,
    quiet_s: float = LOCK_QUIET_S,
) -> None:
    """Return once ``build_dir`` holds no build lock: while another process's build holds it,
    wait, saying so every ``PROGRESS_EVERY_S`` once it has taken ``quiet_s``; a lock with
    nothing in the directory written for ``stale_s`` (a build that was killed) is removed, also
    said."""
    lock = build_dir / "lock"
    start, said = time.monotonic(), None
    while True:
        written = _mtime(lock)
        if not written:  # no lock (or it went while we looked)
            return
        written = max([written] + [_mtime(f) for f in build_dir.iterdir()])
        idle = time.time() - written
        if idle > stale_s:
            lock.unlink(missing_ok=True)
            if progress is not None:
                print(
                    f"ridge: removed a build lock in {build_dir}: nothing written there for {idle / 60:.0f} "
                    "minutes (a build that did not finish)",
                    file=progress,
                    flush=True,
                )
            return
        now = time.monotonic()
        if progress is not None and now - start >= quiet_s and (said is None or now - said >= PROGRESS_EVERY_S):
            said = now
            print(
                f"ridge: waiting for another process's build of the CPU kernels in {build_dir} (last write "
                f"{idle:.0f} s ago; a lock with nothing written for {stale_s:.0f} s is taken as a dead build)",
                file=progress,
                flush=True,
            )
        time.sleep(poll_s)


def _mtime(path: Path) -> float:
    """``path``'s last write, 0 where it went meanwhile (a build's temporary file)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def select_kernels(kind: str, device: torch.device, dtype: torch.dtype):
    """'torch' -> TorchKernels; 'auto' -> ridge's CPU extension where it applies and builds
    (``CpuKernels`` on AVX-512 BF16, ``Avx2Kernels`` on AVX2 alone), and on CUDA the Triton
    kernels (``CudaKernels``) where Triton is installed (CUDA torch ships it); 'ridge' -> the
    CPU extension 'auto' picks, or an error; 'avx2' -> ``Avx2Kernels`` on any CPU with AVX2 (an
    AVX-512 one too: what a CPU without AVX-512 runs, to compare or measure), or an error."""
    from ridge.layers.kernels import Avx2Kernels, CpuKernels, TorchKernels

    if kind == "avx2":
        if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
            raise ValueError("kernels='avx2' runs bfloat16 or float32 on CPU only")
        if not cpu_has_avx2():
            raise ValueError("kernels='avx2' needs a CPU with AVX2, FMA and F16C")
        try:
            return Avx2Kernels(load_avx2_extension())
        except Exception as exc:  # no compiler, no ninja, ...: asked for by name, so an error
            raise ValueError(f"cannot build ridge's AVX2 kernels: {exc}") from None

    if kind == "auto" and device.type == "cuda":
        try:
            from ridge.layers.cuda_kernels import CudaKernels
        except ImportError as exc:  # a CUDA torch without Triton: the reference ops, loudly
            warnings.warn(f"ridge: Triton unavailable ({exc}); using torch ops on CUDA", stacklevel=2)
            return TorchKernels()
        return CudaKernels(device)
    if kind == "torch" or device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        if kind == "ridge":
            raise ValueError("kernels='ridge' runs bfloat16 or float32 on CPU only")
        return TorchKernels()
    if not cpu_has_avx512_bf16() and not cpu_has_avx2():
        if kind == "ridge":
            raise ValueError("kernels='ridge' needs a CPU with AVX-512 BF16 or AVX2")
        return TorchKernels()
    try:
        return CpuKernels(load_extension()) if cpu_has_avx512_bf16() else Avx2Kernels(load_avx2_extension())
    except PrefetchEnvError:  # the user's setting, not the build: say so, never run slower silently
        raise
    except Exception as exc:  # no compiler, no ninja, ...: fall back, loudly
        if kind == "ridge":
            raise ValueError(f"cannot build ridge's CPU kernels: {exc}") from None
        warnings.warn(f"ridge: CPU kernels unavailable ({exc}); using torch ops", stacklevel=2)
        return TorchKernels()


def main(argv: list[str] | None = None) -> int:
    """``python -m ridge.layers.cpu_kernels``: compile the extensions this CPU runs now (setup
    runs this): the AVX-512 kernels, and the AVX2 ones wherever AVX2 is (ridge's kernels on a
    CPU without AVX-512; tested on every x86 machine)."""
    argparse.ArgumentParser(description=main.__doc__).parse_args(argv)
    built = [
        (spec, load)
        for spec, load, usable in (
            (AVX512, load_extension, cpu_has_avx512_bf16()),
            (AVX2, load_avx2_extension, cpu_has_avx2()),
        )
        if usable
    ]
    if not built:
        print("ridge: this CPU has neither AVX-512 BF16 nor AVX2; ridge will run torch's ops (nothing to compile)")
    for spec, load in built:
        try:
            load(progress=sys.stdout)
        except Exception as exc:  # setup goes on: ridge falls back to torch's ops
            print(f"ridge: could not compile {spec.label} ({exc}); ridge will run torch's ops for what they do")
            continue
        print(f"ridge: {spec.label} ready in {extension_build_dir(spec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
