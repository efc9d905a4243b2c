"""Linear layers, including the packed ones that fuse several checkpoint matrices.

A layer's weight format is its method's business (``quantization/methods.py``): the method
creates the tensors, loads checkpoint tensors into them, lets the kernels repack them, and
is the torch reference for the matmul. The model calls ``kernels.matmul(x, layer)``, which
dispatches on the method's format.

A packed layer stacks its shards along the output dimension; the loader hands each
checkpoint tensor to the method with its row range (see ``models/llama.py``'s packing map):

    qkv_proj  rows: [ q_proj (Hq*D) | k_proj (Hkv*D) | v_proj (Hkv*D) ]
    gate_up   rows: [ gate_proj (I) | up_proj (I) ]

Under tensor parallelism a layer holds one rank's slice (``distributed/parallel.py``):
``tp_rows`` gives, per output shard, the rows of the checkpoint tensor it takes (column
parallel), ``tp_cols`` the columns (row parallel); the loader narrows each checkpoint tensor
to them before the method sees it. Both None: the whole tensor.

A stacked expert layer (``ExpertLinear``) is a packed layer whose shards are every expert's
projections in turn, so each expert owns a contiguous run of rows:

    experts.gate_up_proj rows: [ e0 gate (I) | e0 up (I) | e1 gate (I) | e1 up (I) | ... ]
    experts.down_proj    rows: [ e0 (d) | e1 (d) | ... ]          expert e: rows e*N .. (e+1)*N
"""

from __future__ import annotations

import torch
from torch import nn

from ridge.distributed.parallel import Shard
from ridge.quantization.methods import LinearMethod, UnquantizedLinearMethod


class Linear(nn.Module):
    """y = x W^T (+ b), W held however ``method`` holds it.

    ``packed`` is the kernels' layout once repacked (``unpacker`` rebuilds the plain form);
    ``dense_weight()`` always gives the (out, in) matrix, and calling the layer computes
    through the method's torch reference (slow when packed, off the hot path).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        method: LinearMethod | None = None,
        tp_rows: list[Shard] | None = None,
        tp_cols: Shard | None = None,
        full: tuple[list[int], int] | None = None,
        output_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if output_sizes is not None:  # a packed layer's shards (PackedLinear), known to its method
            self.output_sizes = list(output_sizes)
        self.tp_rows, self.tp_cols = tp_rows, tp_cols  # this rank's slice of the checkpoint tensor
        # the unsplit layer: each output shard's rows and K (None: this layer is not split)
        self.full = full
        self.method = method or UnquantizedLinearMethod()
        self.packed: torch.Tensor | None = None
        self.unpacker = None  # the kernels that packed it
        self.parts: tuple[Linear, ...] | None = None  # a method holding shards apart (ShardedLinearMethod)
        self.weight_is_shared = False  # a tied lm_head: the embedding's Parameter, never freed
        self.method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def _apply(self, fn, recurse=True):
        """``to`` / ``to_empty`` reach the parts too (held outside the module tree)."""
        super()._apply(fn, recurse)
        for part in self.parts or ():
            part._apply(fn, recurse)
        return self

    def dense_weight(self) -> torch.Tensor:
        return self.method.dense_weight(self)

    def weight_nbytes(self) -> int:
        return self.method.weight_nbytes(self)

    @property
    def full_shape(self) -> tuple[int, int]:
        """(N, K) of the checkpoint's (unsplit) weight."""
        if self.full is None:
            return self.out_features, self.in_features
        return sum(self.full[0]), self.full[1]

    def local_part(self, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: output shard ``shard`` (None: the whole
        layer, every shard in turn), narrowed to ``tp_rows`` and ``tp_cols``. A view of the
        tensor (of the memory-mapped file) unless the shards must be joined."""
        if self.tp_rows is not None:
            if shard is not None:
                tensor = self.tp_rows[shard].of(tensor, 0)
            else:
                parts, offset = [], 0
                for size, rows in zip(self.full[0], self.tp_rows, strict=True):
                    parts.append(tensor.narrow(0, offset + rows.start, rows.length))
                    offset += size
                tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.tp_cols is not None and tensor.dim() == 2:
            tensor = self.tp_cols.of(tensor, 1)
        return tensor

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, {self.method.name}"


class PackedLinear(Linear):
    """A linear layer whose rows are the concatenation of ``output_sizes`` shards."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        method: LinearMethod | None = None,
        tp_rows: list[Shard] | None = None,
        tp_cols: Shard | None = None,
        full: tuple[list[int], int] | None = None,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias, method, tp_rows, tp_cols, full, output_sizes)

    def shard_rows(self, index: int) -> slice:
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(self.output_sizes, dim=-1))


class ExpertLinear(PackedLinear):
    """``num_experts`` projections (in -> sum(output_sizes) each) stacked along the output
    rows: one tensor (in any format) for a layer's experts, expert e at ``expert_rows(e)``."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        output_sizes: list[int],
        method: LinearMethod | None = None,
        tp_rows: list[Shard] | None = None,
        tp_cols: Shard | None = None,
        full: tuple[list[int], int] | None = None,
    ) -> None:
        # each expert's shards alike
        rows = None if tp_rows is None else list(tp_rows) * num_experts
        full = None if full is None else (list(full[0]) * num_experts, full[1])
        super().__init__(in_features, list(output_sizes) * num_experts, False, method, rows, tp_cols, full)
        self.num_experts = num_experts
        self.rows_per_expert = sum(output_sizes)

    def expert_rows(self, expert: int) -> slice:
        return slice(expert * self.rows_per_expert, (expert + 1) * self.rows_per_expert)
