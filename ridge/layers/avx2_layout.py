"""The AVX2 kernels' layout for the 32-weight block formats (``csrc/avx2_blocks.cpp``).

GGUF stores a row of Q8_0, Q4_0, Q4_1 or IQ4_NL as blocks of 32 weights, each its fp16
factor(s) then its codes. The AVX2 kernel reads a row 8 blocks at a time, and in that layout
it gathers the 8 factors from 8 places and splits each block's nibbles apart with a 128-bit
insert. ``pack_runs_of_8`` moves the same bytes, per row, so that each run of 8 blocks reads

    d[8] (fp16) | m[8] (fp16, Q4_1 only) | codes

- 4-bit codes as 4 vectors of 32 bytes: byte l of vector j holds element l of block 2j in its
  low nibble and element l of block 2j + 1 in its high one (one AND, or a shift and an AND,
  unpacks a block);
- Q8_0's codes as they were, block after block.

A row's last ``blocks % 8`` blocks stay in GGUF's layout. A row keeps its bytes and its size
(the packed tensor has the blocks' shape), so rows still slice one by one: an expert's rows,
or a tensor-parallel rank's (which packs its own shard once it is loaded).
"""

from __future__ import annotations

import torch

from ridge.quantization.formats import IQ4_NL, Q4_0, Q4_1, Q8_0, BlockFormat

RUN = 8  # blocks a run
FORMATS = frozenset(f.name for f in (Q8_0, Q4_0, Q4_1, IQ4_NL))


def _split(fmt: BlockFormat) -> tuple[int, int]:
    """(fp16 factors a block, bytes of codes a block)"""
    code_bytes = fmt.block * fmt.code_bits // 8
    return (fmt.type_size - code_bytes) // 2, code_bytes


def pack_runs_of_8(fmt: BlockFormat, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF rows (N, K / 32 * type_size) uint8 -> the same bytes in the runs' layout."""
    if fmt.name not in FORMATS:
        raise ValueError(f"{fmt.name}: only {sorted(FORMATS)} have the AVX2 run layout")
    n, row_bytes = blocks.shape
    runs = row_bytes // fmt.type_size // RUN
    head = blocks[:, : runs * RUN * fmt.type_size].reshape(n, runs, RUN, fmt.type_size)
    factors, code_bytes = _split(fmt)
    parts = [head[..., 2 * f : 2 * f + 2].reshape(n, runs, 2 * RUN) for f in range(factors)]
    qs = head[..., 2 * factors :]
    if fmt.code_bits == 8:
        parts.append(qs.reshape(n, runs, RUN * code_bytes))
    else:  # GGUF: byte j holds element j (low nibble) and j + 16 (high)
        codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # (n, runs, 8, 32), in element order
        parts.append((codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)).reshape(n, runs, RUN * code_bytes))
    tail = blocks[:, runs * RUN * fmt.type_size :]
    return torch.cat([torch.cat(parts, dim=-1).reshape(n, -1), tail], dim=1).contiguous()


def unpack_runs_of_8(fmt: BlockFormat, packed: torch.Tensor) -> torch.Tensor:
    """``pack_runs_of_8``'s inverse: GGUF's rows, byte for byte."""
    n, row_bytes = packed.shape
    runs = row_bytes // fmt.type_size // RUN
    head = packed[:, : runs * RUN * fmt.type_size].reshape(n, runs, RUN * fmt.type_size)
    factors, code_bytes = _split(fmt)
    blocks = [head[..., 2 * RUN * f : 2 * RUN * (f + 1)].reshape(n, runs, RUN, 2) for f in range(factors)]
    qs = head[..., 2 * RUN * factors :]
    if fmt.code_bits == 8:
        blocks.append(qs.reshape(n, runs, RUN, code_bytes))
    else:
        pairs = qs.reshape(n, runs, RUN // 2, 32)
        codes = torch.stack([pairs & 15, pairs >> 4], dim=3).reshape(n, runs, RUN, 32)  # element order
        blocks.append(codes[..., :16] | (codes[..., 16:] << 4))
    tail = packed[:, runs * RUN * fmt.type_size :]
    return torch.cat([torch.cat(blocks, dim=-1).reshape(n, -1), tail], dim=1).contiguous()
