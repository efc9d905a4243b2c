"""The GPU's fused ops, in Triton (it ships with CUDA torch): what ``CudaKernels`` runs.

Each op is one launch where eager torch takes several, and reads its inputs where they lie
(strided views into the qkv projection, the paged pool through the block tables), so a decode
step is a short, fixed sequence of kernels that a CUDA graph can replay:

  * ``write_kv_rows``      rows into their pool slots; a negative slot (a CUDA graph's padding
                           row) is skipped
  * ``paged_decode_attention``  one query per row over its paged context, straight from the
                           pool (bf16/fp16/fp32, or int8/fp8 codes with their per-32 scales);
                           the context split over programs (flash-decoding) when the batch
                           is too small to fill the GPU, then one combine
  * ``rms_norm``, ``add_rms_norm``  (residual += x, then the norm: one pass)
  * ``rope_``              rotary embedding in place, cos/sin read at each row's position
  * ``silu_mul``           SiLU(gate) * up

Every kernel computes in float32 and rounds once on store. ``TRITON_INTERPRET=1`` runs them
on CPU tensors (float32 and float16: the interpreter has no bfloat16), which is how the
test suite checks them where there is no GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.quantization.formats import FORMATS, Q4_0, Q8_0
from ridge.quantization.methods import PACKED_ROW_BLOCK

# Inline PTX (dp4a) where the GPU is NVIDIA's; ROCm's Triton and the interpreter take the
# same kernels' byte-by-byte form
_PTX = torch.version.hip is None

# Integer views for a plain copy of rows (the copy kernel moves bits, whatever they encode)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# -- KV write ------------------------------------------------------------------------------
@triton.jit
def _write_rows_kernel(src, src_stride, dst, slots, row_elems, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    if slot >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_elems
        vals = tl.load(src + t * src_stride + offs, mask=mask)
        tl.store(dst + slot.to(tl.int64) * row_elems + offs, vals, mask=mask)


def write_rows(pool: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """x (T, ...) into ``pool`` (num_blocks, block_size, ...) at flat slots; a row whose slot
    is negative is not written. Each row of x must be contiguous (rows may be strided apart)."""
    tokens = x.shape[0]
    if tokens == 0:
        return
    row_elems = pool[0, 0].numel()
    rows = x.reshape(tokens, -1)
    if rows.shape[1] != row_elems or rows.stride(1) != 1:
        rows = rows.contiguous()
    bits = _BITS[pool.element_size()]
    block = min(_pow2(row_elems), 1024)
    grid = (tokens, triton.cdiv(row_elems, block))
    _write_rows_kernel[grid](rows.view(bits), rows.stride(0), pool.view(bits), slots, row_elems, BLOCK=block)


# -- paged decode attention ----------------------------------------------------------------
@triton.jit
def _attend_block(
    qv,
    m,
    denom,
    acc,
    k_pool,
    v_pool,
    k_scale,
    v_scale,
    block,
    kvh,
    offs_t,
    offs_d,
    t_ok,
    d_ok,
    seen,
    pool_s0,
    pool_s1,
    pool_s2,
    sc_s0,
    sc_s1,
    sc_s2,
    sm_scale,
    SCALE_GROUP: tl.constexpr,
    KIND: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One pool block's keys and values (dequantized in registers for an int8 / fp8 pool) into
    the queries' running softmax (m, denom, acc); ``seen`` masks the scores (query, key)."""
    kv_mask = t_ok[:, None] & d_ok[None, :]
    off = block * pool_s0 + offs_t[:, None] * pool_s1 + kvh * pool_s2 + offs_d[None, :]
    kt = tl.load(k_pool + off, mask=kv_mask, other=0)
    vt = tl.load(v_pool + off, mask=kv_mask, other=0)
    if KIND != 0:
        s_off = block * sc_s0 + offs_t[:, None] * sc_s1 + kvh * sc_s2 + (offs_d // SCALE_GROUP)[None, :]
        ks = tl.load(k_scale + s_off, mask=kv_mask, other=0.0).to(tl.float32)
        vs = tl.load(v_scale + s_off, mask=kv_mask, other=0.0).to(tl.float32)
        if KIND == 1:
            kt = (kt.to(tl.float32) * ks).to(qv.dtype)
            vt = (vt.to(tl.float32) * vs).to(qv.dtype)
        else:
            kt = (kt.to(tl.float8e4nv, bitcast=True).to(tl.float32) * ks).to(qv.dtype)
            vt = (vt.to(tl.float8e4nv, bitcast=True).to(tl.float32) * vs).to(qv.dtype)
    if IEEE:
        s = tl.dot(qv, tl.trans(kt), input_precision="ieee")
    else:
        s = tl.dot(qv, tl.trans(kt))
    s = tl.where(seen, s * sm_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that sees nothing yet
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return m_new, denom, acc


@triton.jit
def _decode_attention_kernel(
    q,
    q_s0,
    q_s1,
    k_pool,
    v_pool,
    k_scale,
    v_scale,
    pool_s0,
    pool_s1,
    pool_s2,
    sc_s0,
    sc_s1,
    sc_s2,
    tables,
    tables_s0,
    context_lens,
    out,
    out_s0,
    out_s1,
    ws_m,
    ws_l,
    ws_acc,
    sm_scale,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the pool's tokens per block
    SCALE_GROUP: tl.constexpr,  # values per scale (quantized pools)
    KIND: tl.constexpr,  # 0: model dtype, 1: int8 codes, 2: fp8 e4m3 codes (stored as bytes)
    SPLITS: tl.constexpr,
    IEEE: tl.constexpr,  # float32: exact dots (no tf32)
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens + seq).to(tl.int32)
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    per_split = tl.cdiv(num_blocks, SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, num_blocks)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_SIZE)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    qv = tl.load(
        q + seq * q_s0 + heads[:, None] * q_s1 + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    )

    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for b in range(first, last):
        block = tl.load(tables + seq * tables_s0 + b).to(tl.int64)
        t_ok = b * BLOCK_SIZE + offs_t < ctx
        m, denom, acc = _attend_block(
            qv, m, denom, acc, k_pool, v_pool, k_scale, v_scale, block, kvh, offs_t, offs_d, t_ok, d_ok, t_ok[None, :],
            pool_s0, pool_s1, pool_s2, sc_s0, sc_s1, sc_s2, sm_scale, SCALE_GROUP, KIND, IEEE,
        )  # fmt: skip

    out_mask = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        result = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(
            out + seq * out_s0 + heads[:, None] * out_s1 + offs_d[None, :],
            result.to(out.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # partials per (row, head, split): the running max, the sum and the unnormalized output
        part = (seq * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split
        tl.store(ws_m + part, m, mask=g_ok)
        tl.store(ws_l + part, denom, mask=g_ok)
        tl.store(ws_acc + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=out_mask)


@triton.jit
def _decode_combine_kernel(
    ws_m, ws_l, ws_acc, out, out_s0, out_s1, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head) * SPLITS
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(ws_m + base + offs_s)
    denom = tl.load(ws_l + base + offs_s)
    acc = tl.load(ws_acc + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :])
    m_all = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # an empty split weighs nothing
    total = tl.sum(denom * w, 0)
    result = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + seq * out_s0 + head * out_s1 + offs_d, result.to(out.dtype.element_ty), mask=offs_d < HEAD_DIM)


KV_KINDS = {"auto": 0, "int8": 1, "fp8": 2}


def decode_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, programs: int) -> int:
    """How many programs share one row's context: enough that ``num_seqs * num_kv_heads *
    splits`` fills about ``programs`` (two per multiprocessor), never more than the table's
    blocks, a power of two up to 16. Depends on shapes only (a CUDA graph fixes them)."""
    want = max(1, programs // max(num_seqs * num_kv_heads, 1))
    return min(_pow2(want) if want > 1 else 1, 16, _pow2(max_blocks))


def _pool_args(q: torch.Tensor, k_pool, v_pool, k_scale, v_scale) -> tuple:
    """The arguments both attention kernels start with: the queries, the pools and their scales
    (a model-dtype pool passes itself for the scales it does not read), with their strides."""
    quantized = k_scale is not None
    sc, v_sc = (k_scale, v_scale) if quantized else (k_pool, v_pool)
    return (q, q.stride(0), q.stride(1), k_pool, v_pool, sc, v_sc, *k_pool.stride()[:3], *sc.stride()[:3])


def _pool_constants(q: torch.Tensor, k_pool, k_scale, kind: str) -> dict:
    """The compile-time shapes both attention kernels take."""
    head_dim = q.shape[2]
    return dict(
        GROUP=q.shape[1] // k_pool.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=max(_pow2(head_dim), 16),
        BLOCK_SIZE=k_pool.shape[1],
        SCALE_GROUP=head_dim // k_scale.shape[-1] if k_scale is not None else 1,
        KIND=KV_KINDS[kind],
        IEEE=q.dtype is torch.float32,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kind: str,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    programs: int,
) -> torch.Tensor:
    """q (D, Hq, Dh), each head's last dim contiguous -> (D, Hq, Dh): row i's query against
    the first ``context_lens[i]`` tokens its block table maps (a row of length 0 gives 0)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    const = _pool_constants(q, k_pool, k_scale, kind)
    block_d = const["BLOCK_D"]
    splits = decode_splits(num_seqs, num_kv_heads, block_tables.shape[1], programs)
    if splits > 1:
        ws_m = torch.empty((num_seqs * num_heads * splits,), dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((num_seqs * num_heads * splits, block_d), dtype=torch.float32, device=q.device)
    else:
        ws_m = ws_l = ws_acc = out  # not touched
    _decode_attention_kernel[(num_seqs, num_kv_heads, splits)](
        *_pool_args(q, k_pool, v_pool, k_scale, v_scale),
        block_tables,
        block_tables.stride(0),
        context_lens,
        out,
        out.stride(0),
        out.stride(1),
        ws_m,
        ws_l,
        ws_acc,
        scale,
        BLOCK_G=max(_pow2(const["GROUP"]), 16),
        SPLITS=splits,
        **const,
    )
    if splits > 1:
        _decode_combine_kernel[(num_seqs, num_heads)](
            ws_m, ws_l, ws_acc, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=splits
        )
    return out


@triton.jit
def _prefill_attention_kernel(
    q,
    q_s0,
    q_s1,
    k_pool,
    v_pool,
    k_scale,
    v_scale,
    pool_s0,
    pool_s1,
    pool_s2,
    sc_s0,
    sc_s1,
    sc_s2,
    tables,
    tables_s0,
    tiles,  # (num_tiles, 2): each tile's chunk and first row within it
    chunks,  # (num_chunks, 3): first flat row, rows, context length after the chunk
    out,
    out_s0,
    out_s1,
    sm_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    KIND: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    chunk = tl.load(tiles + tile * 2)
    row0 = tl.load(tiles + tile * 2 + 1)
    first = tl.load(chunks + chunk * 3)
    count = tl.load(chunks + chunk * 3 + 1)
    ctx = tl.load(chunks + chunk * 3 + 2)
    rows = row0 + tl.arange(0, BLOCK_M)
    r_ok = rows < count
    q_pos = ctx - count + rows  # each query's absolute position: it sees keys 0 ..= q_pos
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_SIZE)
    d_ok = offs_d < HEAD_DIM
    flat = (first + rows).to(tl.int64)
    qv = tl.load(
        q + flat[:, None] * q_s0 + head * q_s1 + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0
    )

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    last_key = tl.minimum(ctx, ctx - count + row0 + BLOCK_M)  # the tile's last query sees up to here
    for b in range(0, tl.cdiv(last_key, BLOCK_SIZE)):
        block = tl.load(tables + chunk * tables_s0 + b).to(tl.int64)
        key = b * BLOCK_SIZE + offs_t
        t_ok = key < ctx
        seen = t_ok[None, :] & (key[None, :] <= q_pos[:, None])
        m, denom, acc = _attend_block(
            qv, m, denom, acc, k_pool, v_pool, k_scale, v_scale, block, kvh, offs_t, offs_d, t_ok, d_ok, seen,
            pool_s0, pool_s1, pool_s2, sc_s0, sc_s1, sc_s2, sm_scale, SCALE_GROUP, KIND, IEEE,
        )  # fmt: skip
    result = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(
        out + flat[:, None] * out_s0 + head * out_s1 + offs_d[None, :],
        result.to(out.dtype.element_ty),
        mask=r_ok[:, None] & d_ok[None, :],
    )


PREFILL_BLOCK_M = 32


def prefill_index(starts: list[int], lengths: list[int], contexts: list[int], device: torch.device):
    """A step's prefill chunks as the kernel reads them: (tiles (num_tiles, 2): chunk and first
    row of each tile of ``PREFILL_BLOCK_M`` query rows; chunks (num_chunks, 3): first flat row,
    rows, context length), one host-to-device copy."""
    tiles = [(c, row) for c, n in enumerate(lengths) for row in range(0, n, PREFILL_BLOCK_M)]
    values = [v for tile in tiles for v in tile] + [v for chunk in zip(starts, lengths, contexts) for v in chunk]
    index = torch.tensor(values, dtype=torch.int32).to(device)
    return index[: 2 * len(tiles)].view(-1, 2), index[2 * len(tiles) :].view(-1, 3)


def paged_prefill_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kind: str,
    tables: torch.Tensor,
    tiles: torch.Tensor,
    chunks: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Every prefill chunk of a step in one launch: chunk c's rows (q's flat rows ``chunks[c,
    0]`` on, ``chunks[c, 1]`` of them) attend causally over the first ``chunks[c, 2]`` tokens
    its row of ``tables`` maps (the chunk's own K/V already in the pool); into ``out``'s rows
    (returned). ``scale`` multiplies the scores (default Dh ** -0.5)."""
    _prefill_attention_kernel[(tiles.shape[0], q.shape[1])](
        *_pool_args(q, k_pool, v_pool, k_scale, v_scale),
        tables,
        tables.stride(0),
        tiles,
        chunks,
        out,
        out.stride(0),
        out.stride(1),
        q.shape[-1] ** -0.5 if scale is None else scale,
        BLOCK_M=PREFILL_BLOCK_M,
        **_pool_constants(q, k_pool, k_scale, kind),
    )
    return out


def pool_attention_supported(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Shapes the kernel takes: a block size that is a power of two of at least 16 (its dots),
    whole groups of query heads per KV head, a contiguous pool."""
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    return (
        block_size >= 16
        and block_size & (block_size - 1) == 0
        and q.shape[1] % num_kv_heads == 0
        and q.shape[2] == k_pool.shape[3]
        and q.stride(2) == 1
        and k_pool.is_contiguous()
    )


# -- norms, rotary, gating -------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x, x_s0, x_s1, inner, residual, res_s0, out, weight, n, eps, BLOCK: tl.constexpr, ADD: tl.constexpr
):
    row = tl.program_id(0)
    x_off = (row // inner) * x_s0 + (row % inner) * x_s1
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + x_off + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # residual += x, rounded to the stream's dtype as torch's in-place add rounds
        r = tl.load(residual + row * res_s0 + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (r + v).to(residual.dtype.element_ty)
        tl.store(residual + row * res_s0 + offs, summed, mask=mask)
        v = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, 0) / n + eps)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * n + offs, (v * rstd * w).to(out.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(rows, stride between outer rows, stride between inner rows, inner rows) of x (..., N)
    seen as rows of N, where one (T, N) or (T, H, N) stride pattern covers it; None otherwise."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x.shape[0], x.stride(0), 0, 1
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.stride(0), x.stride(1), x.shape[1]
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """F.rms_norm over the last dim into a new contiguous tensor; None where x's layout is not
    taken (the caller runs torch's)."""
    layout = _rows(x)
    if layout is None:
        return None
    rows, s0, s1, inner = layout
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, s0, s1, inner, x, 0, out, weight, n, eps, BLOCK=_pow2(n), ADD=False)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """residual += x (in place), then rms_norm(residual); None where the layouts are not taken."""
    if x.dim() != 2 or x.stride(-1) != 1 or not residual.is_contiguous() or x.shape != residual.shape:
        return None
    rows, n = residual.shape
    out = torch.empty_like(residual)
    if rows:
        _rms_norm_kernel[(rows,)](
            x, x.stride(0), 0, 1, residual, residual.stride(0), out, weight, n, eps, BLOCK=_pow2(n), ADD=True
        )
    return out


@triton.jit
def _rotate(a, b, positions, t, cos, sin, table_s0, offs, mask, HALF: tl.constexpr):
    """A head's halves a and b rotated at token t's position (float32 tables), in float32:
    x * cos + rotate_half(x) * sin, rotate_half(x) = (-b, a)."""
    pos = tl.load(positions + t).to(tl.int64)
    c1 = tl.load(cos + pos * table_s0 + offs, mask=mask, other=0.0)
    c2 = tl.load(cos + pos * table_s0 + HALF + offs, mask=mask, other=0.0)
    s1 = tl.load(sin + pos * table_s0 + offs, mask=mask, other=0.0)
    s2 = tl.load(sin + pos * table_s0 + HALF + offs, mask=mask, other=0.0)
    a, b = a.to(tl.float32), b.to(tl.float32)
    return a * c1 - b * s1, b * c2 + a * s2


@triton.jit
def _rope_kernel(x, x_s0, x_s1, positions, cos, sin, table_s0, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = x + t * x_s0 + tl.program_id(1) * x_s1
    a = tl.load(base + offs, mask=mask, other=0.0)
    b = tl.load(base + HALF + offs, mask=mask, other=0.0)
    a, b = _rotate(a, b, positions, t, cos, sin, table_s0, offs, mask, HALF)
    tl.store(base + offs, a.to(x.dtype.element_ty), mask=mask)
    tl.store(base + HALF + offs, b.to(x.dtype.element_ty), mask=mask)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x (T, H, D) rotated in place at ``positions`` with float32 tables (max_positions, D),
    one program per token and head; False (x untouched) where the layout is not taken."""
    if x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] % 2 or cos.shape[-1] != x.shape[-1] or not cos.is_contiguous():
        return False
    tokens, heads, dim = x.shape
    if tokens and heads:
        half = dim // 2
        _rope_kernel[(tokens, heads)](
            x, x.stride(0), x.stride(1), positions, cos, sin, cos.stride(0), HALF=half, BLOCK=_pow2(half)
        )
    return True


@triton.jit
def _rope_write_kv_kernel(
    qkv,
    qkv_s0,
    positions,
    cos,
    sin,
    table_s0,
    k_pool,
    v_pool,
    slots,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per token and head of [q heads | k heads | v heads]: q and k rotated in place
    # (_rotate, as _rope_kernel), k and v also written at the token's slot
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    base = qkv + t * qkv_s0 + h * D
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    a = tl.load(base + offs, mask=mask, other=0.0)
    b = tl.load(base + HALF + offs, mask=mask, other=0.0)
    if h < NQ + NKV:
        ra, rb = _rotate(a, b, positions, t, cos, sin, table_s0, offs, mask, HALF)
        a, b = ra.to(qkv.dtype.element_ty), rb.to(qkv.dtype.element_ty)
        tl.store(base + offs, a, mask=mask)
        tl.store(base + HALF + offs, b, mask=mask)
        if h >= NQ and slot >= 0:
            row = k_pool + (slot * NKV + (h - NQ)) * D
            tl.store(row + offs, a, mask=mask)
            tl.store(row + HALF + offs, b, mask=mask)
    elif slot >= 0:
        row = v_pool + (slot * NKV + (h - NQ - NKV)) * D
        tl.store(row + offs, a, mask=mask)
        tl.store(row + HALF + offs, b, mask=mask)


def rope_write_kv_(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
) -> bool:
    """One launch for RoPE and the KV write of a step: qkv (T, (Hq + 2 Hkv) D), its q and k
    heads rotated in place at ``positions`` (float32 tables (max_positions, D)), the rotated k
    and v rows written into the pools (num_blocks, block_size, Hkv, D) of qkv's dtype at flat
    ``slots`` (a negative slot writes nothing). What ``rope_`` then ``write_rows`` twice do, the
    same bits. False (nothing done) where the layouts are not taken."""
    tokens = qkv.shape[0]
    dim = k_pool.shape[-1]
    heads = num_heads + 2 * num_kv_heads
    if (
        qkv.dim() != 2
        or qkv.stride(-1) != 1
        or qkv.shape[1] != heads * dim
        or dim % 2
        or k_pool.dtype != qkv.dtype
        or v_pool.dtype != qkv.dtype
        or not (k_pool.is_contiguous() and v_pool.is_contiguous())
        or k_pool.shape[2] != num_kv_heads
        or cos.shape[-1] != dim
        or not cos.is_contiguous()
    ):
        return False
    if tokens:
        half = dim // 2
        _rope_write_kv_kernel[(tokens, heads)](
            qkv,
            qkv.stride(0),
            positions,
            cos,
            sin,
            cos.stride(0),
            k_pool,
            v_pool,
            slots,
            NQ=num_heads,
            NKV=num_kv_heads,
            D=dim,
            HALF=half,
            BLOCK=_pow2(half),
        )
    return True


@triton.jit
def _silu_mul_kernel(gate_up, gu_s0, out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_up + row * gu_s0 + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * gu_s0 + n + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * n + offs, (g / (1.0 + tl.exp(-g)) * u).to(out.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """(T, 2I) -> SiLU(first half) * second half, (T, I); None where the layout is not taken."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2:
        return None
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(_pow2(n), 1024)
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, gate_up.stride(0), out, n, BLOCK=block)
    return out


# -- dense GEMV (one row of x) ------------------------------------------------------------------
# The candidates (rows of W a program, elements of K a step, warps) that CudaKernels.tune_gemv
# times against torch's matmul (cuBLAS) for each weight shape at start-up; cuBLAS's GEMV reaches
# 1.4-1.7 TB/s on TinyLlama's 2048-wide layers (H200, README "CUDA"), their launch ramp longer
# than their data.
GEMV_CONFIGS = ((4, 1024, 4), (8, 512, 4), (2, 1024, 2), (16, 512, 8))


@triton.jit
def _dense_gemv_kernel(
    x, w, w_s0, bias, out, N, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    # BLOCK_N rows of W a program, each step's products summed in float32 and kept apart per
    # lane until one reduction at the end
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    rows = w + rn.to(tl.int64)[:, None] * w_s0
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        wv = tl.load(rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xv = tl.load(x + kk, mask=k_ok, other=0.0)
        acc += wv.to(tl.float32) * xv.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out + rn, y.to(out.dtype.element_ty), mask=n_ok)


def dense_gemv(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, config: tuple[int, int, int]
) -> torch.Tensor | None:
    """x (1, K) @ w^T (+ bias) for a dense w (N, K) of x's dtype, ``config`` one of
    ``GEMV_CONFIGS``: (1, N), float32 sums. None where the layouts are not taken."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1 or w.dim() != 2 or w.stride(-1) != 1:
        return None
    if w.dtype != x.dtype or w.shape[1] != x.shape[1]:
        return None
    n, k = w.shape
    block_n, block_k, warps = config
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _dense_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, w.stride(0), bias if bias is not None else out, out, n, k,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return out


# -- block-format matmul (Q8_0, Q4_0) --------------------------------------------------------
# ``pack_blocks`` moves each row's scales behind its codes (the same bytes, so the same size):
#     row n: [ codes: K bytes (Q8_0) or K/2 (Q4_0, byte j of block b holds elements 16 and 0
#              apart, low nibble first, as GGUF has them) | scales: K/32 fp16 ]
# rows grouped 16 to a leading index, as the CPU kernels group theirs (a row range of 16-row
# blocks is a slice: one expert's rows of a stacked layer).
PACKED_ROWS = PACKED_ROW_BLOCK
BLOCK_FORMATS = (Q8_0.name, Q4_0.name)  # the formats this kernel takes (sizes from formats.py)


def pack_blocks(name: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
    """GGUF blocks (n, k/32 * type_size) -> the kernel's rows (n/16, 16 * row bytes); None where
    the format or shape is not taken."""
    if name not in BLOCK_FORMATS or n % PACKED_ROWS or k % 32:
        return None
    type_size = FORMATS[name].type_size
    b = blocks.reshape(n, k // 32, type_size)
    packed = torch.cat([b[..., 2:].reshape(n, -1), b[..., :2].reshape(n, -1)], dim=1)
    return packed.reshape(n // PACKED_ROWS, -1).contiguous()


def unpack_blocks(name: str, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The kernel's rows back to GGUF blocks (n, k/32 * type_size)."""
    type_size = FORMATS[name].type_size
    rows = packed.reshape(n, -1)
    codes, scales = rows[:, : k // 32 * (type_size - 2)], rows[:, k // 32 * (type_size - 2) :]
    blocks = torch.cat([scales.reshape(n, k // 32, 2), codes.reshape(n, k // 32, type_size - 2)], dim=2)
    return blocks.reshape(n, -1)


@triton.jit
def _codes_f32(byte, NIBBLES: tl.constexpr, HIGH: tl.constexpr):
    """A block's codes (int32 holding the unsigned bytes) as exact float32 values without an
    integer-to-float conversion (a quarter-rate instruction): the code's bits ORed into the
    mantissa of 2^23, minus 2^23 and the format's offset. Q4_0: the low or high nibble, 0..15,
    minus 8; Q8_0: the signed byte (its sign bit flipped gives 0..255, minus 128)."""
    if NIBBLES:
        v = (byte >> 4) if HIGH else (byte & 15)
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return (byte ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _block_gemv_kernel(
    x,
    x_s0,
    packed,
    scales,  # the same bytes as fp16
    bias,
    out,
    out_s0,
    N,
    K,
    ROW_BYTES,  # a row's bytes: codes, then scales
    CODE_BYTES,
    NIBBLES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,  # 32-element blocks a step
):
    # One row of x a program (program_id(1)), BLOCK_N rows of W: each step reads the codes of
    # BLOCK_B blocks, (BLOCK_N, BLOCK_B, bytes a block), sums each block's products in float32
    # and scales the block's sum, not each weight; the blocks' sums are kept apart until the
    # end (one reduction across threads, not one a step). Q4_0's byte j of a block holds
    # elements j (low nibble) and j + 16 (high), multiplied against x's matching elements.
    PER: tl.constexpr = 16 if NIBBLES else 32  # code bytes of a block
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    t = tl.arange(0, PER)
    bb = tl.arange(0, BLOCK_B)
    row = rn.to(tl.int64) * ROW_BYTES
    srow = (row + CODE_BYTES) // 2
    xrow = x + tl.program_id(1).to(tl.int64) * x_s0
    nblocks = K // 32
    acc = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
    for b0 in range(0, nblocks, BLOCK_B):
        blk = b0 + bb
        b_ok = blk < nblocks
        w_ptr = packed + row[:, None, None] + (blk * PER)[None, :, None] + t[None, None, :]
        byte = tl.load(w_ptr, mask=n_ok[:, None, None] & b_ok[None, :, None], other=0).to(tl.int32)
        kx = blk[:, None] * 32 + t[None, :]
        xv = tl.load(xrow + kx, mask=b_ok[:, None], other=0.0).to(tl.float32)
        part = tl.sum(_codes_f32(byte, NIBBLES, False) * xv[None, :, :], axis=2)
        if NIBBLES:
            x_hi = tl.load(xrow + kx + 16, mask=b_ok[:, None], other=0.0).to(tl.float32)
            part += tl.sum(_codes_f32(byte, NIBBLES, True) * x_hi[None, :, :], axis=2)
        s_mask = n_ok[:, None] & b_ok[None, :]
        acc += part * tl.load(scales + srow[:, None] + blk[None, :], mask=s_mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=1)
    if HAS_BIAS:
        total += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out + tl.program_id(1).to(tl.int64) * out_s0 + rn, total.to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + the dot product of the four signed bytes of a and of b (int32 tensors): the GPU's
    ``dp4a``, one instruction for four multiply-adds; the interpreter (no inline assembly)
    sums the sign-extended bytes."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        s = c
        for i in tl.static_range(4):
            s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return s


@triton.jit
def _quantize_q8_kernel(x, x_s0, xq, xd, K, BLOCK_B: tl.constexpr):
    # x's row program_id(0), BLOCK_B of its 32-element blocks: int8 codes round(x * 127 / amax)
    # (half away from zero, llama.cpp's Q8_1), and per block d = amax / 127 and d * sum(codes)
    # (what Q4_0's offset of 8 subtracts), at xd[row, 0, block] and xd[row, 1, block].
    row = tl.program_id(0).to(tl.int64)
    nb = K // 32
    blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    b_ok = blk < nb
    kk = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    v = tl.load(x + row * x_s0 + kk, mask=b_ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    s = v * tl.where(amax > 0, 127.0 / amax, 0.0)[:, None]
    q = tl.where(s >= 0, s + 0.5, s - 0.5).to(tl.int32)
    tl.store(xq + row * K + kk, q.to(tl.int8), mask=b_ok[:, None])
    d = amax / 127.0
    tl.store(xd + row * 2 * nb + blk, d, mask=b_ok)
    tl.store(xd + row * 2 * nb + nb + blk, d * tl.sum(q, axis=1).to(tl.float32), mask=b_ok)


@triton.jit
def _block_gemv_q8_kernel(
    xq,  # x's int8 codes as int32 words (4 a word)
    xd,  # (rows, 2, K/32) float32: each block's d, then d * sum(codes)
    packed,  # pack_blocks' rows as int32 words
    scales,  # the same bytes as fp16
    bias,
    out,
    out_s0,
    M,
    N,
    K,
    ROW_BYTES,
    CODE_BYTES,
    NIBBLES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # llama.cpp's CUDA MMVQ in Triton: x quantized to int8 per 32 (``_quantize_q8_kernel``),
    # each block's products summed exactly in int32 by dp4a, four codes a word (Q4_0: the low
    # nibbles of a word are elements 4w..4w+3 of its block, the high ones 16 further, so two
    # masks and a shift make two words of int8 codes, no conversion to float), then scaled once:
    # d_w * (d_x * sum(x_codes * w_codes) [- 8 * d_x * sum(x_codes)]). All M <= BLOCK_M rows of
    # x in one program, which reads its BLOCK_N rows of W once, BLOCK_B blocks a step; the
    # blocks' sums kept apart until the end (one reduction across threads, not one a step).
    # Tensors are (W row, block, word) for one row of x (measured faster on the H200 than the
    # same code with a leading axis of 1), else (x row, W row, block, word).
    WORDS: tl.constexpr = 4 if NIBBLES else 8  # code words a block
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    bb = tl.arange(0, BLOCK_B)
    srow = (rn.to(tl.int64) * ROW_BYTES + CODE_BYTES) // 2
    nb = K // 32
    if BLOCK_M == 1:
        w = tl.arange(0, WORDS)
        row = rn.to(tl.int64) * (ROW_BYTES // 4)
        acc = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
        for b0 in range(0, nb, BLOCK_B):
            blk = b0 + bb
            b_ok = blk < nb
            w_ptr = packed + row[:, None, None] + (blk * WORDS)[None, :, None] + w[None, None, :]
            word = tl.load(w_ptr, mask=n_ok[:, None, None] & b_ok[None, :, None], other=0)
            xw = xq + blk[:, None] * 8 + w[None, :]
            zero = tl.zeros_like(word)
            if NIBBLES:
                s = _dp4a(word & 0x0F0F0F0F, tl.load(xw, mask=b_ok[:, None], other=0)[None, :, :], zero, ASM)
                s = _dp4a((word >> 4) & 0x0F0F0F0F, tl.load(xw + 4, mask=b_ok[:, None], other=0)[None, :, :], s, ASM)
            else:
                s = _dp4a(word, tl.load(xw, mask=b_ok[:, None], other=0)[None, :, :], zero, ASM)
            part = tl.sum(s, axis=2).to(tl.float32) * tl.load(xd + blk, mask=b_ok, other=0.0)[None, :]
            if NIBBLES:
                part -= 8.0 * tl.load(xd + nb + blk, mask=b_ok, other=0.0)[None, :]
            s_mask = n_ok[:, None] & b_ok[None, :]
            acc += part * tl.load(scales + srow[:, None] + blk[None, :], mask=s_mask, other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=1)[None, :]
    else:
        w = tl.arange(0, WORDS)[None, None, None, :]
        row = (rn.to(tl.int64) * (ROW_BYTES // 4))[None, :, None, None]
        xrow = (rm.to(tl.int64) * (K // 4))[:, None, None, None]
        drow = (rm.to(tl.int64) * 2 * nb)[:, None, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_B), tl.float32)
        for b0 in range(0, nb, BLOCK_B):
            blk = b0 + bb
            b_ok = blk < nb
            blk4 = blk[None, None, :, None]
            ok4 = b_ok[None, None, :, None]
            word = tl.load(packed + row + blk4 * WORDS + w, mask=n_ok[None, :, None, None] & ok4, other=0)
            xw = xq + xrow + blk4 * 8 + w
            x_ok = m_ok[:, None, None, None] & ok4
            zero = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_B, WORDS), tl.int32)
            if NIBBLES:
                s = _dp4a(word & 0x0F0F0F0F, tl.load(xw, mask=x_ok, other=0), zero, ASM)
                s = _dp4a((word >> 4) & 0x0F0F0F0F, tl.load(xw + 4, mask=x_ok, other=0), s, ASM)
            else:
                s = _dp4a(word, tl.load(xw, mask=x_ok, other=0), zero, ASM)
            blk3 = blk[None, None, :]
            ok3 = m_ok[:, None, None] & b_ok[None, None, :]
            part = tl.sum(s, axis=3).to(tl.float32) * tl.load(xd + drow + blk3, mask=ok3, other=0.0)
            if NIBBLES:
                part -= 8.0 * tl.load(xd + drow + nb + blk3, mask=ok3, other=0.0)
            s_mask = n_ok[:, None] & b_ok[None, :]
            acc += part * tl.load(scales + srow[:, None] + blk[None, :], mask=s_mask, other=0.0).to(tl.float32)[None]
        total = tl.sum(acc, axis=2)
    if HAS_BIAS:
        total += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o_ptr = out + rm.to(tl.int64)[:, None] * out_s0 + rn[None, :]
    tl.store(o_ptr, total.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quantize_rows_q8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, K), K a multiple of 32 -> (int8 codes (m, K), (m, 2, K/32) float32: each block's
    d, then d * sum(codes)): the activations of ``_block_gemv_q8_kernel``."""
    m, k = rows.shape
    xq = torch.empty((m, k), dtype=torch.int8, device=rows.device)
    xd = torch.empty((m, 2, k // 32), dtype=torch.float32, device=rows.device)
    block_b = min(32, _pow2(k // 32))
    _quantize_q8_kernel[(m, triton.cdiv(k // 32, block_b))](rows, rows.stride(0), xq, xd, k, BLOCK_B=block_b)
    return xq, xd


@triton.jit
def _block_matmul_kernel(
    x,
    x_s0,
    packed,
    scales,  # the same bytes as fp16
    bias,
    out,
    out_s0,
    M,
    N,
    K,
    ROW_BYTES,
    CODE_BYTES,
    NIBBLES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    W_FIRST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x against W's tiles dequantized in registers to the reference's dense weight in x's dtype
    # (code * scale, value for value), through the tensor cores. Each step reads BLOCK_K // 32
    # whole blocks of each of BLOCK_N rows of W, (row, block, byte): contiguous bytes, so wide
    # loads. Q4_0's byte j of a block holds elements j (low nibble) and j + 16 (high): the low
    # nibbles of all the step's blocks make one operand, against x's first halves of the same
    # blocks, and the high nibbles another, against the second halves; no shuffle of either.
    # W_FIRST computes (W x^T)^T: the dequantized W is the dot's left operand, which Hopper's
    # wgmma reads from registers (x, the right one, from shared memory), for few rows of x.
    G: tl.constexpr = BLOCK_K // 32  # blocks a step
    PER: tl.constexpr = 16 if NIBBLES else 32  # code bytes a block
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.arange(0, G)
    t = tl.arange(0, PER)
    n_ok = rn < N
    m_ok = rm < M
    nb = K // 32
    row = rn.to(tl.int64) * ROW_BYTES
    srow = (row + CODE_BYTES) // 2
    xrow = rm.to(tl.int64) * x_s0
    if W_FIRST:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for b0 in range(0, nb, G):
        blk = b0 + g
        b_ok = blk < nb
        w_mask = n_ok[:, None, None] & b_ok[None, :, None]
        w_ptr = packed + row[:, None, None] + (blk * PER)[None, :, None] + t[None, None, :]
        byte = tl.load(w_ptr, mask=w_mask, other=0)
        scale = tl.load(scales + srow[:, None] + blk[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0.0)
        scale = scale.to(tl.float32)[:, :, None]
        x_ptr = x + xrow[:, None, None] + (blk * 32)[None, :, None] + t[None, None, :]
        x_mask = m_ok[:, None, None] & b_ok[None, :, None]
        for half in tl.static_range(2 if NIBBLES else 1):
            w = (_codes_f32(byte.to(tl.int32), NIBBLES, half == 1) * scale).to(x.dtype.element_ty)
            w = tl.reshape(w, (BLOCK_N, G * PER))
            xv = tl.reshape(tl.load(x_ptr + half * 16, mask=x_mask, other=0.0), (BLOCK_M, G * PER))
            if W_FIRST:
                if IEEE:
                    acc += tl.dot(w, tl.trans(xv), input_precision="ieee")
                else:
                    acc += tl.dot(w, tl.trans(xv))
            elif IEEE:
                acc += tl.dot(xv, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xv, tl.trans(w))
    if W_FIRST:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rm[:, None] * out_s0 + rn[None, :], acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _block_matmul_q8_kernel(
    xq,  # x's int8 codes
    xd,  # (rows, 2, K/32) float32: each block's d (then d * sum(codes), unused here)
    packed,
    scales,  # the same bytes as fp16
    bias,
    out,
    out_s0,
    M,
    N,
    K,
    ROW_BYTES,
    CODE_BYTES,
    NIBBLES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # llama.cpp's MMQ in Triton: x's int8 codes against W's (Q4_0's nibbles minus 8) through
    # the int8 tensor cores, one 32-element block a dot (its int32 sums exact), each block's
    # tile of sums scaled by x's d of its row and W's of its column: one float multiply-add per
    # tile element a block, not a conversion and a multiply per weight. BLOCK_K // 32 blocks a
    # step.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = tl.arange(0, 32)
    n_ok = rn < N
    m_ok = rm < M
    nb = K // 32
    row = rn.to(tl.int64) * ROW_BYTES
    srow = (row + CODE_BYTES) // 2
    xrow = rm.to(tl.int64) * K
    drow = rm.to(tl.int64) * 2 * nb
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for b0 in range(0, nb, BLOCK_K // 32):
        for j in tl.static_range(BLOCK_K // 32):
            b = b0 + j
            k_ok = (b * 32 + t < K)[None, :]  # past the last block: x's codes 0, its scales any
            xa = tl.load(xq + xrow[:, None] + (b * 32 + t)[None, :], mask=m_ok[:, None] & k_ok, other=0)
            if NIBBLES:
                byte = tl.load(packed + row[:, None] + (b * 16 + t % 16)[None, :], mask=n_ok[:, None] & k_ok, other=0)
                code = (((byte.to(tl.int32) >> (4 * (t // 16))[None, :]) & 15) - 8).to(tl.int8)
            else:
                code = tl.load(packed + row[:, None] + (b * 32 + t)[None, :], mask=n_ok[:, None] & k_ok, other=0)
                code = code.to(tl.int8, bitcast=True)
            sums = tl.dot(xa, tl.trans(code), out_dtype=tl.int32)
            bc = tl.minimum(b, nb - 1)
            dx = tl.load(xd + drow + bc, mask=m_ok, other=0.0)
            dw = tl.load(scales + srow + bc, mask=n_ok, other=0.0).to(tl.float32)
            acc += sums.to(tl.float32) * dx[:, None] * dw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rm[:, None] * out_s0 + rn[None, :], acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


GEMV_MAX_ROWS = 4  # x rows up to which each row is a GEMV (W read once a row) rather than a tile
# Triton's interpreter (CPU tensors: the test suite without a GPU) runs a grid's programs one
# after another, each op a numpy call: there a GEMV takes this many rows of W a program instead
# of the GPU's 4 (the same kernel over a few wide programs: block_matmul_config's
# ``interpreted``; explicit configs are kept as given)
INTERPRETED_GEMV_BLOCK_N = 64
# The kernels (a config's first element): GEMVs with x as int8 codes (dp4a) or as floats; tiles
# through the tensor cores, x's int8 codes against W's, or x against W dequantized to x's dtype
# (W the right operand, or the left: ``_block_matmul_kernel``'s W_FIRST)
GEMV_Q8, GEMV_F32, TILE_Q8, TILE, TILE_T = "gemv_q8", "gemv_f32", "tile_q8", "tile", "tile_t"


def q8_taken(dtype: torch.dtype, k: int) -> bool:
    """Whether x of this dtype and width may be quantized to int8 codes: 16-bit activations (a
    float32 model keeps float products: the parity runs) and rows that start on a word
    (K % 64)."""
    return dtype in (torch.bfloat16, torch.float16) and k % 64 == 0


def block_matmul_config(
    m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, nibbles: bool = True, interpreted: bool = False
) -> tuple[str, int, int, int, int]:
    """(kernel, BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for m rows of x of this dtype against n
    rows of W (Q4_0 where ``nibbles``, else Q8_0); a GEMV's BLOCK_M is its rows, up to
    ``GEMV_MAX_ROWS``; BLOCK_K // 32 blocks a step. From the sweeps of
    ``benchmarks/cuda_block_matmul.py``: the GEMVs' on the H200 (2026-11-26; one row: 4 rows of
    W, 64 blocks a step, 2 warps), the tiles' on the H100 (2026-11-26, 16, 32 and 64 rows of
    the Llama-shaped layers). Wide layers (n >= 8192: gate_up) take 128 columns a program, the
    others narrow tiles, so that their few columns still make enough programs for the SMs.
    ``interpreted``: for Triton's interpreter, GEMVs of ``INTERPRETED_GEMV_BLOCK_N`` columns."""
    q8 = q8_taken(dtype, k)
    if m <= GEMV_MAX_ROWS:
        block_n = INTERPRETED_GEMV_BLOCK_N if interpreted else 4
        if q8:
            return GEMV_Q8, m, block_n, 2048 if m == 1 else 1024, 2 if m == 1 else 4
        return GEMV_F32, 1, block_n, 1024, 2
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if dtype not in (torch.bfloat16, torch.float16):  # float32: the parity runs' tiles
        return TILE, block_m, 16 if m <= 16 else 64, 128 if k % 128 == 0 else 32, 4
    if n >= 8192:
        if block_m == 16:
            return (TILE, 16, 64, 128, 4) if nibbles or not q8 else (TILE_Q8, 16, 64, 128, 4)
        return TILE_T, block_m, 128, 128, 8 if nibbles else 4
    if block_m == 16:
        return TILE, 16, 32, 128 if nibbles else 256, 4
    if block_m == 32:
        return TILE_T, 32, 64 if nibbles else 32, 256, 4
    return (TILE_T, 64, 32, 128, 4) if nibbles else (TILE, 64, 32, 256, 4)


def block_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    name: str,
    n: int,
    bias: torch.Tensor | None,
    config: tuple[str, int, int, int, int] | None = None,
) -> torch.Tensor | None:
    """x (..., K) @ W^T (+ bias) with W in ``pack_blocks``' rows, never dequantized to memory:
    a few rows of x run a GEMV kernel (16-bit x quantized to int8 per 32 and each block's
    products summed in int32 by dp4a, or float32 x's products summed in float32; then each
    block's sum scaled); more rows a tile kernel through the tensor cores (W's tiles dequantized
    in registers to the reference's dense weight in x's dtype, value for value; or, where
    chosen, x's int8 codes against W's, each block's int32 sums scaled). None where x's layout
    is not taken. ``config``: ``block_matmul_config``'s tuple, to try others
    (``benchmarks/cuda_block_matmul.py``)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        return None
    m = rows.shape[0]
    type_size, nibbles = FORMATS[name].type_size, FORMATS[name].nibbles
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        kernel, block_m, block_n, block_k, warps = config or block_matmul_config(
            m, n, k, x.dtype, nibbles, interpreted=not x.is_cuda
        )
        if kernel in (GEMV_Q8, TILE_Q8) and not q8_taken(x.dtype, k):
            kernel = GEMV_F32 if kernel == GEMV_Q8 else TILE
        flat = packed.view(-1)
        common = dict(ROW_BYTES=k // 32 * type_size, CODE_BYTES=k // 32 * (type_size - 2), NIBBLES=nibbles)
        common.update(HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=warps)
        b = bias if bias is not None else out
        xq, xd = quantize_rows_q8(rows) if kernel in (GEMV_Q8, TILE_Q8) else (None, None)
        if kernel == GEMV_Q8:
            for r in range(0, m, GEMV_MAX_ROWS):  # GEMV_MAX_ROWS rows a launch (more: a sweep's config)
                rs, mr = slice(r, r + GEMV_MAX_ROWS), min(m - r, GEMV_MAX_ROWS)
                _block_gemv_q8_kernel[(triton.cdiv(n, block_n),)](
                    xq[rs].view(torch.int32), xd[rs], flat.view(torch.int32), flat.view(torch.float16), b, out[rs],
                    out.stride(0), mr, n, k, ASM=_PTX and x.is_cuda, BLOCK_M=_pow2(mr), BLOCK_B=max(1, block_k // 32),
                    **common,
                )  # fmt: skip
        elif kernel == GEMV_F32:
            grid = (triton.cdiv(n, block_n), m)
            _block_gemv_kernel[grid](
                rows, rows.stride(0), flat, flat.view(torch.float16), b, out, out.stride(0), n, k,
                BLOCK_B=max(1, block_k // 32), **common,
            )  # fmt: skip
        elif kernel == TILE_Q8:
            grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
            _block_matmul_q8_kernel[grid](
                xq, xd, flat, flat.view(torch.float16), b, out, out.stride(0), m, n, k,
                BLOCK_M=block_m, BLOCK_K=block_k, **common,
            )  # fmt: skip
        else:
            grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
            _block_matmul_kernel[grid](
                rows, rows.stride(0), flat, flat.view(torch.float16), b, out, out.stride(0), m, n, k,
                IEEE=x.dtype is torch.float32, W_FIRST=kernel == TILE_T, BLOCK_M=block_m, BLOCK_K=block_k, **common,
            )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
