"""ridge's own CPU kernels: a bf16 GEMM for small M (decode) and fused decode ops.

Stock ``F.linear`` with one row reads bf16 weights at about half the memory bandwidth on
the AVX-512 machines ridge is developed on (see ``../shared/notes/cpu-matmul.md``); this
kernel (``csrc/linear_bf16.cpp``, weights repacked at load into 16-row x 2-k blocks)
streams them at ~95% and stays near the bandwidth floor up to batch 8; ``csrc/decode_ops.cpp``
fuses the small ops around it (and gives float32 its paged decode attention). The extension is compiled with torch's cpp_extension the first time
(about a minute) and cached on disk. Where it cannot be used (no AVX-512 BF16, no
compiler, another dtype or device) ridge runs the torch ops.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

from ridge.config import default_cache_dir


CSRC_DIR = Path(__file__).with_name("csrc")
SOURCES = ("linear_bf16.cpp", "decode_ops.cpp", "bindings.cpp")
def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


def build_extension():
    """Compile (or load the cached build of) ridge's CPU extension; returns the module."""
    from torch.utils.cpp_extension import load

    # The ninja that pip installs with ridge sits beside this interpreter, which may not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    build_dir = default_cache_dir() / "extensions" / f"torch-{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        name="ridge_cpu",
        sources=[str(CSRC_DIR / name) for name in SOURCES],
        extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def select_kernels(kind: str, device: torch.device, dtype: torch.dtype):
    """'torch' -> TorchKernels; 'auto' -> ridge's CPU extension where it applies and builds."""
    from ridge.layers.kernels import CpuKernels, TorchKernels

    if kind == "torch" or device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        if kind == "ridge":
            raise ValueError("kernels='ridge' runs bfloat16 or float32 on CPU only")
        return TorchKernels()
    if not cpu_has_avx512_bf16():
        if kind == "ridge":
            raise ValueError("kernels='ridge' needs a CPU with AVX-512 BF16")
        return TorchKernels()
    try:
        return CpuKernels(build_extension())
    except Exception as exc:  # no compiler, no ninja, ...: fall back, loudly
        if kind == "ridge":
            raise ValueError(f"cannot build ridge's CPU kernels: {exc}") from None
        warnings.warn(f"ridge: CPU kernels unavailable ({exc}); using torch ops", stacklevel=2)
        return TorchKernels()
