"""Linear layers, including the packed ones that fuse several checkpoint matrices.

A packed layer stacks its shards along the output dimension; the loader copies each
checkpoint tensor into its row range (see ``models/llama.py``'s packing map):

    qkv_proj.weight  rows: [ q_proj (Hq*D) | k_proj (Hkv*D) | v_proj (Hkv*D) ]
    gate_up_proj     rows: [ gate_proj (I) | up_proj (I) ]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def dense_linear(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose matmul is the engine's kernels' (the model calls ``kernels.matmul(x, layer)``).

    Kernels may keep the weight in their own layout (``packed``, with ``unpack`` to get the
    dense ``(out, in)`` matrix back) and free the dense copy: ``dense_weight()`` always works,
    and so does calling the layer (through the dense weight; slow when packed, off the hot path).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed: torch.Tensor | None = None
        self.unpack = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(), self.bias)

    def dense_weight(self) -> torch.Tensor:
        if self.weight.numel() == 0 and self.packed is not None:
            return self.unpack(self.packed, self.out_features, self.in_features)
        return self.weight


class PackedLinear(Linear):
    """``nn.Linear`` whose rows are the concatenation of ``output_sizes`` shards."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, index: int) -> slice:
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(self.output_sizes, dim=-1))
