"""Random but valid blocks of a GGUF block type, for formats ridge reads but does not produce
(IQ4_NL, the K-quants): any bytes are valid codes; only the fp16 factors need finite, realistic
values. The tests' weights for those formats, and benchmarks' (whose timings do not depend on
the values)."""

from __future__ import annotations

import numpy as np
import torch

from ridge.quantization.formats import BlockFormat


def random_blocks(fmt: BlockFormat, rows: int, k: int, seed: int, scale: float = 0.002) -> torch.Tensor:
    """(rows, K/32 * type_size) uint8: random codes, each block's fp16 d uniform in +-``scale``
    (weights then reach about 127 * scale)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, k // fmt.block, fmt.type_size), dtype=np.uint8)
    factors = 2 if fmt.block > 32 else 1  # a K-quant super-block: d, then dmin (Q6_K: d last)
    d = rng.uniform(-scale, scale, size=(rows, k // fmt.block, factors)).astype(np.float16)
    if factors == 2:  # 6-bit codes up to 63 multiply them: keep the weights as large as a block's
        d /= 16
    if fmt.ggml_name == "Q6_K":  # d at the end, after 16 int8 scales up to 127
        data[..., -2:] = (d[..., :1] / 4).astype(np.float16).view(np.uint8)
    elif fmt.ggml_name == "Q3_K":  # d at the end; 6-bit scales - 32 times codes -4..3 reach 128
        data[..., -2:] = (d[..., :1] * 16).astype(np.float16).view(np.uint8)
    elif fmt.ggml_name == "Q2_K":  # d and dmin at the end; 4-bit scales times codes 0..3 reach 45
        data[..., -4:] = (d * 48).astype(np.float16).view(np.uint8).reshape(*d.shape[:-1], 4)
    else:
        data[..., 0 : 2 * factors] = d.view(np.uint8).reshape(*d.shape[:-1], 2 * factors)
    return torch.from_numpy(data.reshape(rows, -1))
