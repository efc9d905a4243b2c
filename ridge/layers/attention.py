"""Attention over the paged KV cache: one write, then two read paths.

Tokens of a step are flattened; decodes come first, then prefill chunks:

    flat tokens:  [ d0 d1 ... d(D-1) | p0 chunk ........ | p1 chunk .... ]
                    one query each      queries start:end  (per request)

Each token's K/V is first written to its slot (``slot = block_id * block_size + offset``).
Then:
  * decode path:  one query per sequence against its whole paged context (scores are
                  D x H x 1 x L), by the kernels object (``layers/kernels.py``): grouped
                  matmuls over gathered blocks in torch, or straight from the pool in C++;
  * prefill path: per request, the chunk's queries against the cached prefix plus the chunk,
                  causal (scores are one request's chunk x context, never more).

A block table maps a sequence's logical block i to a physical block in the pool:

    position p  ->  block_table[p // block_size], offset p % block_size
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ridge.kv import cache as kv_cache
from ridge.kv.cache import PagedKV


@dataclass
class PrefillChunk:
    """A run of query tokens of one request: flat rows [start, end), context_len after the chunk."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # (num_blocks_of_request,) long

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to, for one step."""

    slot_mapping: torch.Tensor  # (T,) long: cache slot of each flat token
    num_decode_tokens: int = 0  # the first D flat tokens are decodes
    decode_block_tables: torch.Tensor | None = None  # (D, max_blocks) long, padded with 0
    decode_context_lens: torch.Tensor | None = None  # (D,) long
    decode_mask: torch.Tensor | None = None  # (D, 1, 1, L) bool: slot l < context_len (torch path; built once per step)
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill_index: tuple | None = None  # the kernels' view of the prefills, built by the first layer that asks


def index_copy_rows(pool: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """x (T, ...) into ``pool`` (num_blocks, block_size, ...) at flat slots."""
    pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, x)


def write_slots(
    pool: torch.Tensor,
    scales: torch.Tensor | None,
    x: torch.Tensor,
    slots: torch.Tensor,
    kind: str,
    write_rows=index_copy_rows,
) -> None:
    """x: (T, H, D) into ``pool`` (num_blocks, block_size, H, D) at flat slots (quantized
    first, with their scales, for an int8/fp8 cache); ``write_rows(pool, rows, slots)`` moves
    the rows (the GPU's skips negative slots: a CUDA graph's padding)."""
    if scales is not None:
        x, scale = kv_cache.quantize(x, kind)
        write_rows(scales, scale, slots)
    write_rows(pool, x, slots)


def write_kv(cache: PagedKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, write_rows=index_copy_rows) -> None:
    """k/v: (T, Hkv, D) into their pools at flat slots."""
    write_slots(cache.k, cache.k_scale, k, slots, cache.kind, write_rows)
    write_slots(cache.v, cache.v_scale, v, slots, cache.kind, write_rows)


def gather_context(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The sequence's cached K (or V, or their scales) in order: (..., num_blocks * block_size, Hkv[, D])."""
    blocks = pool[block_table]  # (..., nb, bs, Hkv, D)
    return blocks.flatten(block_table.dim() - 1, block_table.dim())


def gather_values(cache: PagedKV, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks in ``block_table``, in order and in ``dtype`` (dequantized)."""
    keys, values = gather_context(cache.k, block_table), gather_context(cache.v, block_table)
    if not cache.quantized:
        return keys, values
    k_scale, v_scale = gather_context(cache.k_scale, block_table), gather_context(cache.v_scale, block_table)
    return (
        kv_cache.dequantize(keys, k_scale, cache.kind, dtype),
        kv_cache.dequantize(values, v_scale, cache.kind, dtype),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKV,
    meta: AttentionMetadata,
    ops,
    kv_written: bool = False,
) -> torch.Tensor:
    """q: (T, Hq, D), k/v: (T, Hkv, D) of this step's tokens -> output (T, Hq, D).

    ``ops`` (the kernels) writes the step's K/V (``write_kv``; not when ``kv_written``: the
    kernels' ``rope_write_kv`` wrote them) and gives the two paths:
    ``decode_attention(q, cache, meta)`` and ``prefill_attention(q, k, v, cache, chunk)``,
    called once the step's K/V are in the cache; ``prefill_attention_all`` takes every prefill
    chunk of the step at once where the kernels can (False: one call per chunk).
    """
    if not kv_written:
        ops.write_kv(cache, k, v, meta.slot_mapping)
    num_decodes = meta.num_decode_tokens
    if num_decodes == q.shape[0]:  # a pure decode step: no copy into a shared output
        return ops.decode_attention(q, cache, meta)
    out = torch.empty_like(q)
    if num_decodes:
        out[:num_decodes] = ops.decode_attention(q[:num_decodes], cache, meta)
    if meta.prefills and not ops.prefill_attention_all(q, cache, meta, out):
        for chunk in meta.prefills:
            s, e = chunk.start, chunk.end
            out[s:e] = ops.prefill_attention(q[s:e], k[s:e], v[s:e], cache, chunk)
    return out


def decode_valid_mask(context_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """(D, 1, 1, L): which gathered slots hold a token of each sequence."""
    return (torch.arange(max_len, device=context_lens.device)[None, :] < context_lens[:, None])[:, None, None, :]


def prefill_attention(q, k, v, cache: PagedKV, chunk: PrefillChunk) -> torch.Tensor:
    """One prefill chunk's queries (n, Hq, D) over its request's context (the cache holds the
    chunk's K/V already; k/v are the chunk's own, used where nothing precedes it)."""
    n, ctx = chunk.num_tokens, chunk.context_len
    if ctx == n and not cache.quantized:
        # Nothing cached before this chunk: attend within the chunk, plain causal.
        keys, values, mask, causal = k, v, None, True
    else:
        # The cached prefix (and, in a quantized cache, the chunk too: every path then sees
        # the same stored values, so a prompt in one chunk or several computes the same).
        block_size = cache.k.shape[1]
        table = chunk.block_table[: (ctx + block_size - 1) // block_size]
        keys, values = gather_values(cache, table, q.dtype)
        keys, values = keys[:ctx], values[:ctx]
        # Query i sits at absolute position ctx - n + i and sees keys 0 ..= that position.
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        causal = False
    # 3-D on purpose: on the CPU a 4-D call takes torch's flash kernel, whose sums run in blocks
    # that depend on the chunk's length, so a prompt chunked differently would compute
    # differently; the math path's each score and each weighted sum is its own
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # (Hq, n, Dh)
        keys.transpose(0, 1),  # (Hkv, ctx, Dh)
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
