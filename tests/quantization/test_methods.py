"""The linear methods on their own: a packed layer held per shard (``ShardedLinearMethod``)
against the same shards as separate layers, on the torch path and ridge's CPU kernels."""

from __future__ import annotations

import pytest
import torch

from ridge.layers.cpu_kernels import cpu_has_avx512_bf16, select_kernels
from ridge.layers.kernels import TorchKernels
from ridge.layers.linear import Linear, PackedLinear
from ridge.quantization.formats import FORMATS
from ridge.quantization.methods import BlockQuantLinearMethod, ShardedLinearMethod
from ridge.quantization.random_blocks import random_blocks

SIZES = [64, 32, 32]  # q, k, v of a tiny attention layer
K = 256


def _layers(formats, bias: bool):
    """A packed layer held per shard and, shard by shard, plain layers of the same blocks."""
    packed = PackedLinear(K, SIZES, bias, ShardedLinearMethod(tuple(formats)))
    alone = []
    for shard, (size, fmt) in enumerate(zip(SIZES, formats, strict=True)):
        blocks = random_blocks(fmt, size, K, seed=shard)
        packed.method.load_blocks(packed, blocks, packed.shard_rows(shard))
        layer = Linear(K, size, False, BlockQuantLinearMethod(fmt))
        layer.method.load_blocks(layer, blocks, None)
        alone.append(layer)
    if bias:
        packed.bias.data = torch.randn(sum(SIZES))
    return packed, alone


@pytest.mark.parametrize("kernels", ["torch", "ridge"])
def test_a_packed_layer_held_per_shard_computes_each_shard_in_its_own_format(kernels):
    if kernels == "ridge" and not cpu_has_avx512_bf16():
        pytest.skip("ridge's CPU kernels need AVX-512 BF16")
    q4_k, int8 = FORMATS["q4_k"], FORMATS["int8"]
    packed, alone = _layers([q4_k, q4_k, int8], bias=True)
    # one part per run of like shards: q and k together, v apart
    assert [p.method.name for p in packed.parts] == ["q4_k", "int8"] and packed.method.name == "q4_k+q4_k+int8"
    assert [p.out_features for p in packed.parts] == [96, 32]
    assert [packed.method.shard_format(i) for i in range(3)] == [q4_k, q4_k, int8]
    assert packed.weight_nbytes() == 96 * q4_k.row_bytes(K) + 32 * int8.row_bytes(K)
    ops = TorchKernels() if kernels == "torch" else select_kernels("ridge", torch.device("cpu"), torch.float32)
    for layer in (packed, *alone):
        layer.method.process_weights_after_loading(layer, ops)
    if kernels == "ridge":
        assert all(p.packed is not None for p in packed.parts)
    x = torch.randn(3, K)
    expected = torch.cat([ops.matmul(x, layer) for layer in alone], dim=-1) + packed.bias
    assert torch.equal(ops.matmul(x, packed), expected)
    dense = torch.cat([layer.dense_weight().float() for layer in alone])
    assert torch.equal(packed.dense_weight(), dense)  # read back from whichever form is held
    torch.testing.assert_close(packed(x), x @ dense.T + packed.bias)  # the torch reference


def test_rows_must_fall_within_one_format():
    q4_k, int8 = FORMATS["q4_k"], FORMATS["int8"]
    layer = PackedLinear(K, SIZES, False, ShardedLinearMethod((q4_k, q4_k, int8)))
    with pytest.raises(ValueError, match="cross the layer's formats"):
        layer.method.load_blocks(layer, random_blocks(q4_k, 96 + 32, K, seed=0), slice(0, 128))
    with pytest.raises(ValueError, match="2 shard formats for a layer of 3 shards"):
        PackedLinear(K, SIZES, False, ShardedLinearMethod((q4_k, int8)))
