"""DeepSeek's multi-head latent attention (MLA) over the paged cache.

Per token and layer the cache holds one vector shared by all H heads (``KVCacheSpec`` with
``keys_only``: one "KV head", the pool serves as K and V):

    c = [ latent (r) | k_rope (p) ]          r = kv_lora_rank, p = qk_rope_head_dim

A head's key and value are expansions of it through ``kv_b_proj`` (W_uk[h]: nope x r,
W_uv[h]: v x r):

    k_h = [ W_uk[h] latent | k_rope ]        v_h = W_uv[h] latent

Prefill chunks (many queries per key) expand: K and V of the context through kv_b_proj,
then causal attention (q.k over nope + p dims, values v wide).

Decode rows (one query each) absorb W_uk into the query and W_uv into the output, and so
read only the latents, r + p values per token instead of H (nope + p + v):

    q_h . k_h = (W_uk[h]^T q_nope_h) . latent + q_rope_h . k_rope = [ q_lat_h | q_rope_h ] . c
    o_h = sum_l p_l v_h,l = W_uv[h] (sum_l p_l latent_l)

That is multi-query attention with key c and value c's first r dims: the kernels' decode
attention runs it with the pool as both K and V, and the p extra output dims are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridge.kv import cache as kv_cache
from ridge.kv.cache import PagedKV
from ridge.layers.attention import AttentionMetadata, PrefillChunk, gather_context, write_slots
from ridge.layers.linear import Linear


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    entry: torch.Tensor,
    cache: PagedKV,
    meta: AttentionMetadata,
    absorbed: tuple[torch.Tensor | Linear, torch.Tensor | Linear],
    kv_b_proj: Linear,
    scale: float,
    ops,
    absorb_decode: bool = True,
) -> torch.Tensor:
    """q_nope (T, H, nope), q_rope (T, H, p) rotated, entry (T, 1, r + p) this step's cache
    vectors (latent normalized, k_rope rotated) -> attention output (T, H, v).

    ``absorbed``: W_uk and W_uv^T as ``ops.head_matmul`` takes them (dense (H, nope, r) and
    (H, r, v), or stacked per-head layers of r and v rows: ``DeepseekAttention.absorb``).
    ``absorb_decode`` False runs decode rows the expanded way too (each sequence's whole
    context through kv_b_proj every step): the comparison the absorbed form is measured against.
    """
    write_slots(cache.k, cache.k_scale, entry, meta.slot_mapping, cache.kind)
    w_uk, w_uv_t = absorbed
    num_decodes, tokens = meta.num_decode_tokens, q_nope.shape[0]
    if num_decodes and not absorb_decode:
        return _all_expanded(q_nope, q_rope, entry, cache, meta, kv_b_proj, scale, ops, head_outputs(w_uv_t))
    if num_decodes == tokens:
        return _absorbed_decode(q_nope, q_rope, cache, meta, w_uk, w_uv_t, scale, ops)
    out = q_nope.new_empty(tokens, q_nope.shape[1], head_outputs(w_uv_t))
    if num_decodes:
        out[:num_decodes] = _absorbed_decode(
            q_nope[:num_decodes], q_rope[:num_decodes], cache, meta, w_uk, w_uv_t, scale, ops
        )
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.end
        out[s:e] = _expanded_prefill(q_nope[s:e], q_rope[s:e], entry[s:e], cache, chunk, kv_b_proj, scale, ops)
    return out


def head_outputs(w: torch.Tensor | Linear) -> int:
    """N of ``head_matmul``'s per-head matrices: dense (H, K, N), or a stacked layer of N rows a head."""
    return w.shape[2] if isinstance(w, torch.Tensor) else w.rows_per_expert


def _all_expanded(q_nope, q_rope, entry, cache, meta, kv_b_proj, scale, ops, v_dim) -> torch.Tensor:
    """Every row expanded: a decode row is a one-token chunk at the end of its context."""
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], v_dim)
    chunks = [
        PrefillChunk(i, i + 1, int(meta.decode_context_lens[i]), meta.decode_block_tables[i])
        for i in range(meta.num_decode_tokens)
    ]
    for chunk in chunks + list(meta.prefills):
        s, e = chunk.start, chunk.end
        out[s:e] = _expanded_prefill(q_nope[s:e], q_rope[s:e], entry[s:e], cache, chunk, kv_b_proj, scale, ops)
    return out


def _absorbed_decode(q_nope, q_rope, cache, meta, w_uk, w_uv_t, scale, ops) -> torch.Tensor:
    rank = head_outputs(w_uk)
    q_latent = ops.head_matmul(q_nope, w_uk)  # (D, H, nope) -> (D, H, r): each head's query in latent space
    q = torch.cat((q_latent, q_rope), dim=-1)  # (D, H, r + p) against the cached c
    out_latent = ops.decode_attention(q, cache, meta, scale, value_dim=rank)  # (D, H, r)
    return ops.head_matmul(out_latent, w_uv_t)  # (D, H, r) -> (D, H, v): back out through W_uv


def _expanded_prefill(q_nope, q_rope, entry, cache: PagedKV, chunk: PrefillChunk, kv_b_proj, scale, ops):
    n, ctx = chunk.num_tokens, chunk.context_len
    num_heads, rope = q_rope.shape[1], q_rope.shape[2]
    if ctx == n and not cache.quantized:
        context, mask, causal = entry, None, True  # nothing cached before this chunk
    else:
        block_size = cache.k.shape[1]
        table = chunk.block_table[: (ctx + block_size - 1) // block_size]
        context = gather_context(cache.k, table)[:ctx]  # (ctx, 1, r + p)
        if cache.quantized:
            scales = gather_context(cache.k_scale, table)[:ctx]
            context = kv_cache.dequantize(context, scales, cache.kind, q_nope.dtype)
        # Query i sits at absolute position ctx - n + i and sees keys 0 ..= that position.
        q_pos = torch.arange(ctx - n, ctx, device=q_nope.device)
        mask = torch.arange(ctx, device=q_nope.device)[None, :] <= q_pos[:, None]
        causal = False
    latent, k_rope = context[:, 0, :-rope], context[:, 0, -rope:]
    kv = ops.matmul(latent.contiguous(), kv_b_proj).view(ctx, num_heads, -1)
    nope = q_nope.shape[-1]
    keys = torch.cat((kv[..., :nope], k_rope[:, None, :].expand(ctx, num_heads, rope)), dim=-1)
    values = kv[..., nope:]
    query = torch.cat((q_nope, q_rope), dim=-1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
    )
    return out.transpose(0, 1)
