"""The KV pool's tensors: one ``PagedKV`` per layer, in the model's dtype or quantized.

    k, v        (num_blocks, block_size, Hkv, D)   model dtype, or 1-byte codes
    k_scale     (num_blocks, block_size, Hkv, D/32)  fp16, one per 32 values of a token's head
    v_scale     (quantized caches only; None otherwise; one per head where D is not a multiple of 32)

What a token stores is the model's to say (``model.kv_cache_spec()``, a ``KVCacheSpec``):
K and V per KV head for standard attention; for DeepSeek's latent attention one vector per
token (latent + rotary key, ``Hkv`` = 1) that serves as both, so ``v`` is ``k`` itself.

``--kv-cache-dtype`` (vLLM's flag): ``auto`` keeps the model's dtype; ``int8`` stores
round(x / s) with s = amax / 127 per group of 32 values of a token's head (llama.cpp's q8_0
cache: the granularity of its Q8_0 blocks); ``fp8`` stores x / s as float8 e4m3 (s = amax /
448) per the same groups. The scale is rounded to fp16 before the codes are computed, so
``codes * scale`` is exactly what every read path sees. Writes quantize; the decode kernels
read codes and scales straight from the pool; the prefill path dequantizes what it gathers.
A block's bytes hold its tokens' scales too, so the block arithmetic, the prefix cache and
``--kv-cache-memory`` see one unit.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import NamedTuple

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANT_MAX = {"int8": 127.0, "fp8": 448.0}  # largest code: int8, float8 e4m3
SCALE_DTYPE = torch.float16
SCALE_GROUP = 32  # values per scale along a head (a whole head where head_dim is not a multiple)
HUGE_PAGE = 2 << 20  # bytes of an x86 transparent huge page


class PagedKV(NamedTuple):
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    kind: str = "auto"  # "auto" (model dtype), "int8" or "fp8"

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token keeps per layer: ``num_heads`` vectors of ``head_dim`` for K, and as
    many again for V unless ``keys_only`` (MLA's latent: values are read from the same
    vector). The block pool, ``--kv-cache-memory`` and the telemetry all size from it."""

    num_layers: int
    num_heads: int
    head_dim: int
    keys_only: bool = False

    def bytes_per_token(self, kind: str, dtype: torch.dtype) -> int:
        """Bytes one token holds over all layers (an int8/fp8 cache: codes and scales)."""
        tensors = 1 if self.keys_only else 2
        return tensors * self.num_layers * self.num_heads * bytes_per_token_head(kind, self.head_dim, dtype)

    def bytes_per_element(self, kind: str, dtype: torch.dtype) -> float:
        """Bytes per cached value (codes plus each token-head's share of its scale)."""
        return bytes_per_token_head(kind, self.head_dim, dtype) / self.head_dim


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return name


def scale_groups(head_dim: int) -> int:
    """Scales per token and head of a quantized cache."""
    return head_dim // SCALE_GROUP if head_dim % SCALE_GROUP == 0 else 1


def bytes_per_token_head(kind: str, head_dim: int, dtype: torch.dtype) -> int:
    """K or V bytes one token holds for one KV head (codes and scales)."""
    if kind == "auto":
        return head_dim * dtype.itemsize
    return head_dim + scale_groups(head_dim) * SCALE_DTYPE.itemsize


def allocate(
    spec: KVCacheSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kind: str = "auto",
) -> list[PagedKV]:
    """One preallocated pool per layer.

    Not zero-filled: no read path lets a slot nobody wrote change a result (prefill reads
    ``[:context_len]``, the C++ decode kernels stop at the context length, and the torch
    decode path zeroes the masked slots it gathers), so the pool costs nothing until used:
    the OS maps its pages as they are first written (zero-filling gigabytes took seconds).
    """
    shape = (num_blocks, block_size, spec.num_heads, spec.head_dim)
    code_dtype = dtype if kind == "auto" else torch.int8 if kind == "int8" else torch.uint8  # fp8 as bytes

    def layer() -> PagedKV:
        k = pool_empty(shape, code_dtype, device)
        v = k if spec.keys_only else pool_empty(shape, code_dtype, device)
        if kind == "auto":
            return PagedKV(k, v)
        scales = (*shape[:-1], scale_groups(spec.head_dim))
        k_scale = pool_empty(scales, SCALE_DTYPE, device)
        v_scale = k_scale if spec.keys_only else pool_empty(scales, SCALE_DTYPE, device)
        return PagedKV(k, v, k_scale, v_scale, kind)

    return [layer() for _ in range(spec.num_layers)]


def pool_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized pool tensor; in host memory, in 2 MiB pages where the OS grants them.

    A decode step reads each sequence's blocks from all over its layer's pool: in 4 KiB pages
    every block is its own TLB miss, and after a step's weights have streamed through the
    caches each miss walks page tables from memory. torch's allocator never asks for huge pages
    (transparent huge pages are "madvise" on most hosts), so a host pool is its own private
    anonymous mapping that asks for them before its first touch (its pages still cost nothing
    until written), 2 MiB aligned, unmapped when the last tensor on it goes. Measured on a
    2-core Xeon (2026-12-03; README "The pool in 2 MiB pages"): whole decode steps of a Q4_K_M
    TinyLlama over shuffled blocks, alternated in one process, 1.00x at 160 tokens, 1.02-1.03x
    at 512-900, 1.06-1.07x at 1,024-2,048 and batch 1-16, int8 16 x 4,096 1.10x.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as torch's
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> codes (..., D) and fp16 scales (..., groups), per group of a head."""
    groups = scale_groups(x.shape[-1])
    xf = x.float().unflatten(-1, (groups, -1))
    scale = (xf.abs().amax(dim=-1) / QUANT_MAX[kind]).to(SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    scaled = xf * inv
    if kind == "int8":
        codes = scaled.round().clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.flatten(-2), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., D), scales (..., groups) -> values (..., D) in ``dtype``."""
    values = codes.float() if kind == "int8" else codes.view(torch.float8_e4m3fn).float()
    return (values.unflatten(-1, (scale.shape[-1], -1)) * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)
