"""ridge's own CPU kernel: a bf16 GEMM for small M (decode), built on first use.

Stock ``F.linear`` with one row reads bf16 weights at about half the memory bandwidth on
the AVX-512 machines ridge is developed on (see ``../shared/notes/cpu-matmul.md``); this
kernel (``csrc/linear_bf16.cpp``) streams them at ~90%. It is compiled with torch's
cpp_extension the first time (about half a minute) and cached on disk. Where it cannot be
used (no AVX-512 BF16, no compiler, another dtype or device) ridge uses ``F.linear``.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc") / "linear_bf16.cpp"
# Above this many rows the step is compute-bound and oneDNN's GEMM (F.linear) wins.
MAX_KERNEL_ROWS = 64

MatmulFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def cache_dir() -> Path:
    return Path(os.environ.get("RIDGE_CACHE_DIR", Path.home() / ".cache" / "ridge"))


def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


def build_linear_bf16():
    """Compile (or load the cached build of) the kernel; returns the extension module."""
    from torch.utils.cpp_extension import load

    build_dir = cache_dir() / "extensions" / f"torch-{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        name="ridge_linear_bf16",
        sources=[str(CSRC)],
        extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


class CpuLinear:
    """``F.linear`` with bf16 rows up to ``MAX_KERNEL_ROWS`` routed to ridge's kernel."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype is torch.bfloat16 and x.numel() // x.shape[-1] <= MAX_KERNEL_ROWS:
            return self.kernel.linear_bf16(x, weight, bias)
        return F.linear(x, weight, bias)


def select_matmul(kind: str, device: torch.device, dtype: torch.dtype) -> MatmulFn:
    """'torch' -> F.linear; 'auto' -> the CPU kernel where it applies and builds, else F.linear."""
    if kind == "torch" or device.type != "cpu" or dtype is not torch.bfloat16:
        return F.linear
    if not cpu_has_avx512_bf16():
        if kind == "ridge":
            raise ValueError("kernels='ridge' needs a CPU with AVX-512 BF16")
        return F.linear
    try:
        return CpuLinear(build_linear_bf16())
    except Exception as exc:  # no compiler, no ninja, ...: fall back, loudly
        if kind == "ridge":
            raise ValueError(f"cannot build ridge's CPU kernel: {exc}") from None
        warnings.warn(f"ridge: CPU kernel unavailable ({exc}); using F.linear", stacklevel=2)
        return F.linear
