"""How a linear layer holds, loads, repacks and applies its weight (vLLM's ``LinearMethod``).

A ``Linear`` owns one method object; the method creates the layer's tensors, takes each
checkpoint tensor into them, hands them to the kernels for repacking once loading is done,
and is the torch reference for the matmul. Nothing else touches a layer's storage.

    UnquantizedLinearMethod   weight (N, K) in the model's dtype (a Parameter)
    BlockQuantLinearMethod    blocks (N, K/32 * type_size) uint8: GGUF's bytes (formats.py)
    ShardedLinearMethod       a packed layer whose shards keep different block formats: one
                              layer per run of like shards (``layer.parts``), each as above

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

    def shard_format(self, shard: int | None) -> BlockFormat | None:
        """The format output shard ``shard`` (None: the whole layer) is held in."""
        return self.format

    def load_weight(self, layer: Linear, tensor: torch.Tensor, rows: slice | None) -> None:
        """A dense checkpoint tensor, the whole weight (rows None) or a packed shard's rows."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear, kernels) -> None:
        """Repack for ``kernels`` (which may decline and return None); a weight kept as loaded
        goes where ``kernels.place_weight`` puts it."""

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
        if packed is None:  # read as loaded (a tied lm_head's placed weight is the embedding's too)
            layer.weight.data = kernels.place_weight(weight.detach())
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
        if packed is None:  # read as loaded
            layer.blocks = kernels.place_weight(layer.blocks)
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


class ShardedLinearMethod(LinearMethod):
    """A packed layer whose shards keep the formats a file gave them, where they differ
    (llama.cpp's Q4_K_M mix stores ``attn_q``/``attn_k`` as Q4_K and ``attn_v`` as Q6_K):
    converting every shard to the widest would read more bytes than the file holds. Each run
    of consecutive shards of one format becomes a layer of its own (``layer.parts``, plain
    ``Linear`` layers outside the module tree: the packed layer is what the model, the loader
    and the byte counts see); the matmul is one per part, outputs side by side, then the
    layer's bias (vLLM's GGUF linear method computes a mixed fused layer per shard too).

        qkv_proj (Q4_K_M): [ q_proj | k_proj ] q4_k  ->  parts[0]
                           [ v_proj ]          q6_k  ->  parts[1]
    """

    def __init__(self, formats: tuple[BlockFormat, ...]) -> None:
        self.formats = tuple(formats)

    @property
    def name(self) -> str:
        return "+".join(f.name for f in self.formats)

    def shard_format(self, shard):
        if shard is None:
            raise ValueError(f"a layer held as {self.name} per shard loads shard by shard")
        return self.formats[shard]

    def create_weights(self, layer):
        from ridge.layers.linear import Linear  # the layers import the methods

        sizes = layer.output_sizes
        if len(sizes) != len(self.formats):
            raise ValueError(f"{len(self.formats)} shard formats for a layer of {len(sizes)} shards")
        parts, start = [], 0
        for shard in range(1, len(sizes) + 1):
            if shard == len(sizes) or self.formats[shard] is not self.formats[start]:
                rows = sum(sizes[start:shard])
                parts.append(Linear(layer.in_features, rows, False, BlockQuantLinearMethod(self.formats[start])))
                start = shard
        layer.parts = tuple(parts)  # a tuple: not registered as submodules

    def _part_rows(self, layer, rows: slice) -> tuple[Linear, slice]:
        """The part holding ``rows`` (whole shards' rows) and the rows within it."""
        offset = 0
        for part in layer.parts:
            if offset <= rows.start and rows.stop <= offset + part.out_features:
                return part, slice(rows.start - offset, rows.stop - offset)
            offset += part.out_features
        raise ValueError(f"rows {rows.start}:{rows.stop} cross the layer's formats ({self.name})")

    def load_weight(self, layer, tensor, rows):
        if rows is None:  # the whole layer: each part its rows
            offset = 0
            for part in layer.parts:
                part.method.load_weight(part, tensor[offset : offset + part.out_features], None)
                offset += part.out_features
            return
        part, within = self._part_rows(layer, rows)
        part.method.load_weight(part, tensor, within)

    def load_blocks(self, layer, blocks, rows):
        part, within = self._part_rows(layer, rows)
        part.method.load_blocks(part, blocks, within)

    def process_weights_after_loading(self, layer, kernels):
        for part in layer.parts:
            part.method.process_weights_after_loading(part, kernels)

    def apply(self, layer, x):
        return self.join(layer, [part.method.apply(part, x) for part in layer.parts])

    def join(self, layer, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The parts' outputs side by side, then the layer's bias: the layer's output."""
        y = torch.cat(outputs, dim=-1)
        return y if layer.bias is None else y + layer.bias.to(y.dtype)

    def dense_weight(self, layer):
        return torch.cat([part.dense_weight().float() for part in layer.parts])

    def weight_nbytes(self, layer):
        return sum(part.weight_nbytes() for part in layer.parts)


# The kernels pack rows in blocks of 16 (linear_bf16, linear_quant): a row range on block
# boundaries is a contiguous slice of the packed tensor. A kernel set packing each row on its
# own (the AVX2 one) says so in its ``packed_row_block``.
PACKED_ROW_BLOCK = 16


def _unpack_rows(layer, rows: slice, unpack) -> torch.Tensor:
    """Rows of a packed weight: only their blocks unpacked where the range is block-aligned."""
    start, stop = rows.start or 0, rows.stop
    step = getattr(layer.unpacker, "packed_row_block", PACKED_ROW_BLOCK)
    if start % step == 0 and (stop % step == 0 or stop == layer.out_features):
        blocks = layer.packed[start // step : -(-stop // step)]
        return unpack(blocks, stop - start)
    return unpack(layer.packed, layer.out_features)[rows]


def _check_shape(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight has shape {tuple(src.shape)}, the config expects {tuple(dst.shape)}")
