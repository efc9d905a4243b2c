"""How a linear layer holds, loads, repacks and applies its weight (vLLM's ``LinearMethod``).

A ``Linear`` owns one method object; the method creates the layer's tensors, takes each
checkpoint tensor into them, hands them to the kernels for repacking once loading is done,
and is the torch reference for the matmul. Nothing else touches a layer's storage.

    UnquantizedLinearMethod   weight (N, K) in the model's dtype (a Parameter)
    BlockQuantLinearMethod    blocks (N, K/32 * type_size) uint8: GGUF's bytes (formats.py)

After ``process_weights_after_loading`` a layer may hold its weight in the kernels' layout
instead (``layer.packed``), with the plain form freed; ``dense_weight`` rebuilds the
(N, K) matrix from whichever form is held (slow, off the hot path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ridge.quantization.formats import BlockFormat

if TYPE_CHECKING:
    from ridge.layers.linear import Linear


class LinearMethod:
    """The interface: one instance per layer kind; state lives on the layer."""

    format: BlockFormat | None = None  # None: an unquantized weight

    @property
    def name(self) -> str:
        return self.format.name if self.format else "unquantized"

    def create_weights(self, layer: Linear) -> None:
        raise NotImplementedError

    def load_weight(self, layer: Linear, tensor: torch.Tensor, rows: slice | None) -> None:
        """A dense checkpoint tensor, the whole weight (rows None) or a packed shard's rows."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear, kernels) -> None:
        """Repack for ``kernels`` (which may decline and return None)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The torch reference: any device, any float dtype."""
        return F.linear(x, self.dense_weight(layer).to(x.dtype), layer.bias)

    def apply_rows(self, layer: Linear, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """The torch reference for the output rows ``rows`` only (one expert of a stacked
        layer): x @ W[rows]^T, reading no other row's weight where the held form allows."""
        return F.linear(x, self.dense_rows(layer, rows).to(x.dtype))

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        raise NotImplementedError

    def dense_rows(self, layer: Linear, rows: slice) -> torch.Tensor:
        """W[rows] as a dense (rows, K) matrix."""
        return self.dense_weight(layer)[rows]

    def weight_nbytes(self, layer: Linear) -> int:
        """Bytes a matmul reads: whichever form of the weight the layer holds."""
        if layer.packed is not None:
            return layer.packed.numel() * layer.packed.element_size()
        return self._plain_nbytes(layer)

    def _plain_nbytes(self, layer: Linear) -> int:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features), requires_grad=False)

    def load_weight(self, layer, tensor, rows):
        weight = layer.weight
        with torch.no_grad():
            if rows is not None:
                _check_shape(weight[rows], tensor)
                weight[rows].copy_(tensor)
            elif tensor.dtype == weight.dtype and weight.device.type == "cpu":
                _check_shape(weight, tensor)
                weight.data = tensor  # a memory-mapped file itself: no copy (a tied layer shares the Parameter)
            else:
                _check_shape(weight, tensor)
                weight.copy_(tensor)

    def process_weights_after_loading(self, layer, kernels):
        if layer.packed is not None:  # already repacked
            return
        weight = layer.weight
        packed = kernels.pack_dense(weight.detach())
        if packed is None:
            return
        layer.packed, layer.unpacker = packed, kernels
        if not layer.weight_is_shared:  # a tied lm_head keeps the embedding's
            layer.weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def apply(self, layer, x):
        return F.linear(x, self.dense_weight(layer), layer.bias)

    def dense_weight(self, layer):
        if layer.weight.numel() == 0 and layer.packed is not None:
            return layer.unpacker.unpack_dense(layer.packed, layer.out_features, layer.in_features)
        return layer.weight

    def dense_rows(self, layer, rows):
        if layer.weight.numel() == 0 and layer.packed is not None:
            return _unpack_rows(
                layer, rows, lambda packed, n: layer.unpacker.unpack_dense(packed, n, layer.in_features)
            )
        return layer.weight[rows]

    def _plain_nbytes(self, layer):
        return layer.weight.numel() * layer.weight.element_size()


class BlockQuantLinearMethod(LinearMethod):
    """A weight in one of llama.cpp's block formats; dense checkpoint tensors are quantized as
    they load (group 32 along K), GGUF blocks of the same format are taken as they are."""

    def __init__(self, fmt: BlockFormat) -> None:
        self.format = fmt

    def create_weights(self, layer):
        if layer.in_features % self.format.block:
            raise ValueError(
                f"{self.format.name} needs in_features divisible by {self.format.block}, got {layer.in_features}"
                + (" (this rank's columns of a row-parallel layer)" if getattr(layer, "tp_cols", None) else "")
            )
        layer.register_buffer(
            "blocks", torch.empty(layer.out_features, self.format.row_bytes(layer.in_features), dtype=torch.uint8)
        )

    def load_weight(self, layer, tensor, rows):
        target = layer.blocks if rows is None else layer.blocks[rows]
        expected = (target.shape[0], layer.in_features)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight has shape {tuple(tensor.shape)}, the config expects {expected}")
        target.copy_(self.format.quantize(tensor.to(target.device)))

    def load_blocks(self, layer, blocks: torch.Tensor, rows: slice | None) -> None:
        """Blocks of this very format (a GGUF tensor's bytes, (rows, K/32 * type_size) uint8)."""
        target = layer.blocks if rows is None else layer.blocks[rows]
        _check_shape(target, blocks)
        target.copy_(blocks)

    def process_weights_after_loading(self, layer, kernels):
        if layer.packed is not None:  # already repacked
            return
        packed = kernels.pack_blocks(self.format, layer.blocks, layer.out_features, layer.in_features)
        if packed is None:
            return
        layer.packed, layer.unpacker = packed, kernels
        layer.blocks = torch.empty(0, dtype=torch.uint8, device=layer.blocks.device)

    def blocks_of(self, layer) -> torch.Tensor:
        if layer.blocks.numel() == 0 and layer.packed is not None:
            return layer.unpacker.unpack_blocks(self.format, layer.packed, layer.out_features, layer.in_features)
        return layer.blocks

    def dense_weight(self, layer):
        return self.format.dequantize(self.blocks_of(layer), layer.in_features)

    def dense_rows(self, layer, rows):
        if layer.blocks.numel() == 0 and layer.packed is not None:
            fmt, k = self.format, layer.in_features
            blocks = _unpack_rows(layer, rows, lambda packed, n: layer.unpacker.unpack_blocks(fmt, packed, n, k))
        else:
            blocks = layer.blocks[rows]
        return self.format.dequantize(blocks, layer.in_features)

    def _plain_nbytes(self, layer):
        return layer.blocks.numel()


# The kernels pack rows in blocks of 16 (linear_bf16, linear_quant): a row range on block
# boundaries is a contiguous slice of the packed tensor.
PACKED_ROW_BLOCK = 16


def _unpack_rows(layer, rows: slice, unpack) -> torch.Tensor:
    """Rows of a packed weight: only their blocks unpacked where the range is block-aligned."""
    start, stop = rows.start or 0, rows.stop
    if start % PACKED_ROW_BLOCK == 0 and (stop % PACKED_ROW_BLOCK == 0 or stop == layer.out_features):
        blocks = layer.packed[start // PACKED_ROW_BLOCK : -(-stop // PACKED_ROW_BLOCK)]
        return unpack(blocks, stop - start)
    return unpack(layer.packed, layer.out_features)[rows]


def _check_shape(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight has shape {tuple(src.shape)}, the config expects {tuple(dst.shape)}")
