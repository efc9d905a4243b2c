"""Prefill attention as each token's decode, for each CPU extension's kernels (``CpuKernels`` in
test_cpu_kernels.py, ``Avx2Kernels`` in test_avx2_ops.py): against torch's path
(scaled_dot_product_attention over the gathered context) within a rounding, a prompt in one
chunk and in three gives the same bytes, each row equals the decode of that token, and slots
past the context (NaN here) are never read."""

from __future__ import annotations

import torch

from ridge.kv.cache import PagedKV, quantize
from ridge.layers.attention import AttentionMetadata, PrefillChunk
from ridge.layers.kernels import TorchKernels


def check_prefill_as_decodes(fast, dtype: torch.dtype = torch.bfloat16, kind: str | None = None) -> None:
    """``kind``: an int8 or fp8 cache (the codes of the same K/V), else one of ``dtype``."""
    ctx, block_size, heads, kv_heads, dim = 45, 4, 8, 2, 64
    blocks = -(-ctx // block_size)
    gen = torch.Generator().manual_seed(7)
    k, v, q = (torch.randn(ctx, h, dim, generator=gen).to(dtype) for h in (kv_heads, kv_heads, heads))
    table = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:blocks]
    slots = (table.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(blocks))[:ctx]
    k_cache, v_cache = (torch.full((40, block_size, kv_heads, dim), float("nan"), dtype=dtype) for _ in range(2))
    k_cache.view(-1, kv_heads, dim)[slots], v_cache.view(-1, kv_heads, dim)[slots] = k, v
    cache = PagedKV(k_cache, v_cache)
    if kind is not None:
        (k8, ks), (v8, vs) = quantize(k_cache, kind), quantize(v_cache, kind)
        cache = PagedKV(k8, v8, ks, vs, kind)

    def chunked(ops, cuts):
        return torch.cat(
            [
                ops.prefill_attention(q[s:e], k[s:e], v[s:e], cache, PrefillChunk(s, e, e, table))
                for s, e in zip(cuts, cuts[1:])
            ]
        )

    whole = chunked(fast, [0, ctx])
    want = chunked(TorchKernels(), [0, ctx]).float()
    tolerance = 0.01 if dtype is torch.bfloat16 else 1e-5
    assert (whole.float() - want).abs().max().item() <= tolerance * want.abs().max().item()
    assert torch.equal(chunked(fast, [0, 7, 30, ctx]), whole)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(3, dtype=torch.long),
        num_decode_tokens=3,
        decode_block_tables=table.expand(3, blocks),
        decode_context_lens=torch.tensor([1, 20, ctx]),
    )
    assert torch.equal(fast.decode_attention(q[[0, 19, ctx - 1]], cache, meta), whole[[0, 19, ctx - 1]])
