"""The GPU's Triton kernels (``layers/triton_kernels.py``) against the torch reference
(``TorchKernels``, ``kv/cache.py``). On a GPU they run compiled; elsewhere through Triton's
interpreter on CPU tensors (float32 and float16: the interpreter has no bfloat16), which is
how CI checks their indexing, masks, splits and padding rows without a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, in its interpreter (tests/conftest.py sets it)

from ridge.kv import cache as kv_cache
from ridge.layers import triton_kernels as tk
from ridge.layers.attention import AttentionMetadata, write_kv
from ridge.layers.kernels import TorchKernels
from ridge.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter takes the model dtypes numpy has; a GPU takes bfloat16 too
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err:.2e}"


def _pool(num_blocks, block_size, heads, dim, dtype, kind):
    """A pool of random K/V (quantized for int8/fp8), written through the reference, and its
    poison: slots nobody wrote hold NaN (or the largest code), which no read may use."""
    caches = kv_cache.allocate(kv_cache.KVCacheSpec(1, heads, dim), num_blocks, block_size, dtype, DEVICE, kind)
    cache = caches[0]
    for t in (cache.k, cache.v):
        t.fill_(float("nan") if kind == "auto" else 127)
    if cache.quantized:
        cache.k_scale.fill_(float("nan"))
        cache.v_scale.fill_(float("nan"))
    return cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_rows_writes_each_row_at_its_slot_and_skips_negative_slots(dtype):
    pool = torch.zeros(4, 16, 2, 8, dtype=dtype, device=DEVICE)
    qkv = torch.randn(3, 40, dtype=dtype, device=DEVICE)  # rows of a wider tensor: k is a strided view
    k = qkv[:, 8:24].view(3, 2, 8)
    slots = torch.tensor([17, -1, 63], device=DEVICE)
    tk.write_rows(pool, k, slots)
    flat = pool.view(-1, 2, 8)
    assert torch.equal(flat[17], k[0]) and torch.equal(flat[63], k[2])
    written = torch.zeros(64, dtype=torch.bool)
    written[[17, 63]] = True
    assert not flat[~written.to(DEVICE)].any()  # the padding row (slot -1) wrote nothing


@pytest.mark.parametrize("kind", ["auto", "int8"] + (["fp8"] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(4, 2, 16), (8, 1, 32), (2, 2, 24)],  # GQA, one shared head, a head of no power of two
)
@pytest.mark.parametrize("programs", [1, 64])  # one program per row and KV head; the context split
def test_paged_decode_attention_matches_the_reference(kind, heads, kv_heads, dim, programs):
    dtype = torch.float32
    torch.manual_seed(heads * 100 + dim)
    block_size, num_blocks = 16, 12
    cache = _pool(num_blocks, block_size, kv_heads, dim, dtype, kind)
    lens = [37, 1, 16, 0, 70]  # a row of length 0: a CUDA graph's padding
    tables = torch.zeros(len(lens), 6, dtype=torch.long)
    free = list(torch.randperm(num_blocks).tolist())
    slots = []
    for row, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            tables[row, b] = free.pop() if free else 0
        slots += [int(tables[row, p // block_size]) * block_size + p % block_size for p in range(n)]
    # each (block, offset) written once: rows share no block here
    assert len(set(slots)) == len(slots) or num_blocks < sum(-(-n // block_size) for n in lens)
    slots_t = torch.tensor(slots, device=DEVICE)
    write_kv(
        cache,
        torch.randn(len(slots), kv_heads, dim, device=DEVICE),
        torch.randn(len(slots), kv_heads, dim, device=DEVICE),
        slots_t,
    )
    q = torch.randn(len(lens), heads, dim, device=DEVICE)
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        num_decode_tokens=len(lens),
        decode_block_tables=tables.to(DEVICE),
        decode_context_lens=torch.tensor(lens, device=DEVICE),
    )
    got = tk.paged_decode_attention(
        q, cache.k, cache.v, cache.k_scale, cache.v_scale, kind, meta.decode_block_tables, meta.decode_context_lens,
        dim**-0.5, programs,
    )  # fmt: skip
    want = TorchKernels().decode_attention(q, cache, meta)
    live = [i for i, n in enumerate(lens) if n]
    _close(got[live], want[live], dtype)
    assert not got[lens.index(0)].any()  # nothing to attend to: zeros, not NaN


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_rope_and_gating_match_the_reference(dtype):
    torch.manual_seed(0)
    ref = TorchKernels()
    x = torch.randn(5, 48, dtype=dtype, device=DEVICE)
    w = torch.randn(48, dtype=dtype, device=DEVICE)
    _close(tk.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), dtype)
    # per head, on a strided view (Qwen3's q/k norms read qkv's columns)
    qkv = torch.randn(5, 3 * 32, dtype=dtype, device=DEVICE)
    heads = qkv[:, :64].view(5, 4, 16)
    hw = torch.randn(16, dtype=dtype, device=DEVICE)
    _close(tk.rms_norm(heads, hw, 1e-6), ref.rms_norm(heads, hw, 1e-6), dtype)

    residual = torch.randn(5, 48, dtype=dtype, device=DEVICE)
    want_residual = residual.clone()
    want = ref.add_rms_norm(x, want_residual, w, 1e-5)
    got = tk.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, want_residual)  # the in-place add rounds as torch's does
    _close(got, want, dtype)

    rotary = RotaryEmbedding(16, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([0, 3, 17, 63, 5], device=DEVICE)
    view = qkv[:, : 6 * 16].view(5, 6, 16)  # q and k heads side by side, strided rows
    want = ref.rope(view.clone(), rotary(positions, dtype))
    assert tk.rope_(view, positions, rotary.cos, rotary.sin)
    _close(view, want, dtype)

    gate_up = torch.randn(5, 2 * 40, dtype=dtype, device=DEVICE)
    _close(tk.silu_mul(gate_up), ref.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (3, 1, 24)])
def test_rope_write_kv_is_rope_then_both_writes_in_one_launch(dtype, heads, kv_heads, dim):
    torch.manual_seed(0)
    tokens, width = 4, (heads + 2 * kv_heads) * dim
    rotary = RotaryEmbedding(dim, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([0, 9, 63, 30], device=DEVICE)
    slots = torch.tensor([5, -1, 40, 17], device=DEVICE)  # a padding row writes nothing
    wide = torch.randn(tokens, width + 8, dtype=dtype, device=DEVICE)
    qkv = wide[:, :width]  # rows strided apart, as a matmul's output slice may be
    pools = [torch.zeros(4, 16, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(4)]

    want = qkv.clone()  # the unfused ops: rope on q and k, then one write per pool
    qk = want[:, : (heads + kv_heads) * dim].view(tokens, -1, dim)
    assert tk.rope_(qk, positions, rotary.cos, rotary.sin)
    tk.write_rows(pools[0], qk[:, heads:], slots)
    tk.write_rows(pools[1], want[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim), slots)

    assert tk.rope_write_kv_(qkv, heads, kv_heads, positions, rotary.cos, rotary.sin, pools[2], pools[3], slots)
    # q and k rotated in place, v untouched, the pools' rows the rotated ones. The same bits
    # where the rotation rounds to 16 bits; float32 on a GPU may differ in the last bit where
    # the compiler contracts a product and a sum into one fma in one kernel but not the other.
    exact = dtype != torch.float32 or DEVICE.type != "cuda"
    for got, ref in ((qkv, want), (pools[2], pools[0]), (pools[3], pools[1])):
        assert torch.equal(got, ref) if exact else torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    written = slots[slots >= 0]
    rotated_k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    assert torch.equal(pools[2].view(-1, kv_heads, dim)[written], rotated_k[slots >= 0])
    assert pools[2].view(-1, kv_heads, dim)[slots[1:]].abs().sum() > 0
    # a pool of another dtype (a quantized cache's codes) is not taken
    codes = torch.zeros(4, 16, kv_heads, dim, dtype=torch.int8, device=DEVICE)
    assert not tk.rope_write_kv_(qkv, heads, kv_heads, positions, rotary.cos, rotary.sin, codes, codes, slots)


def test_decode_splits_depend_on_shapes_only():
    assert tk.decode_splits(1, 4, 128, 264) == 16  # one sequence: its context over many programs
    assert tk.decode_splits(64, 8, 128, 264) == 1  # a full batch fills the GPU by itself
    assert tk.decode_splits(1, 4, 2, 264) == 2  # never more splits than the table has blocks


def _x_as_int8(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 GEMV sees it: codes round(x * 127 / amax) per 32 (half away from zero),
    times amax / 127, in float32."""
    m, k = x.shape
    v = x.float().reshape(m, k // 32, 32)
    amax = v.abs().amax(-1, keepdim=True)
    s = v * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.where(s >= 0, s + 0.5, s - 0.5).trunc() * (amax / 127)).reshape(m, k)


@pytest.mark.parametrize("fmt_name", ["int8", "int4"])  # Q8_0, Q4_0
@pytest.mark.parametrize(("m", "k"), [(1, 96), (1, 512), (3, 128), (5, 256), (40, 128)])
def test_block_matmul_matches_the_reference_dense_weight(fmt_name, m, k):
    """Every kernel against the dense weight's matmul: the int8 GEMV (16-bit x, K % 64) against
    x quantized as it quantizes it (and within 2% of x itself), the others against x."""
    from ridge.quantization.formats import FORMATS

    fmt = FORMATS[fmt_name]
    torch.manual_seed(m + k)
    n = 48
    blocks = fmt.quantize(torch.randn(n, k)).to(DEVICE)
    packed = tk.pack_blocks(fmt.name, blocks, n, k)
    assert packed.numel() == blocks.numel()  # the same bytes, rearranged
    assert torch.equal(tk.unpack_blocks(fmt.name, packed, n, k), blocks)
    dense = fmt.dequantize(blocks, k)
    for dtype in DTYPES:
        x = torch.randn(m, k, dtype=dtype, device=DEVICE)
        bias = torch.randn(n, dtype=dtype, device=DEVICE)
        q8 = tk.q8_taken(dtype, k)

        def want(config, w=dense, b=bias, x=x, dtype=dtype, q8=q8):
            int8 = q8 and (config or tk.block_matmul_config(m, n, k, dtype, fmt.nibbles))[0] in (tk.GEMV_Q8, tk.TILE_Q8)
            b = None if b is None else b.float()
            return torch.nn.functional.linear(_x_as_int8(x) if int8 else x.float(), w.float(), b).to(dtype)

        _close(tk.block_matmul(x, packed, fmt.name, n, bias), want(None), dtype)
        if q8 and m <= tk.GEMV_MAX_ROWS:  # the int8 GEMV: its own rounding of x, and no more
            assert tk.block_matmul_config(m, n, k, dtype, fmt.nibbles)[0] == tk.GEMV_Q8
            got = tk.block_matmul(x, packed, fmt.name, n, bias)
            _close(got, torch.nn.functional.linear(x, dense.to(dtype), bias), torch.bfloat16)
        # rows 16-31 alone (one expert's rows of a stacked layer): their 16-row block
        _close(tk.block_matmul(x, packed[1:2], fmt.name, 16, None), want(None, dense[16:32], None), dtype)
        # any tile computes the same function: GEMVs or tensor-core tiles, a step longer than K
        # (on a GPU each config compiles: float16 keeps only the defaults, which bfloat16 shares)
        if DEVICE.type == "cuda" and dtype is torch.float16:
            continue
        configs = [(tk.GEMV_Q8, 4, 8, 512, 4), (tk.GEMV_F32, 1, 16, 256, 4), (tk.GEMV_F32, 1, 2, 1024, 1)]
        configs += [(tk.TILE, 16, 32, 64, 2), (tk.TILE, 32, 16, 256, 8), (tk.TILE_T, 16, 64, 128, 4)]
        configs += [(tk.TILE_T, 32, 128, 128, 8), (tk.TILE_Q8, 16, 32, 64, 4)]
        for config in configs + [(tk.TILE_Q8, 32, 16, 128, 4)]:
            if config[0] in (tk.GEMV_Q8, tk.GEMV_F32) and m > 8:  # a GEMV program per row: slow here
                continue
            _close(tk.block_matmul(x, packed, fmt.name, n, bias, config), want(config), dtype)


@pytest.mark.parametrize("kind", ["auto", "int8"] + (["fp8"] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (2, 2, 24)])
def test_paged_prefill_attention_matches_the_reference_per_chunk(kind, heads, kv_heads, dim):
    """Several chunks in one launch: a whole prompt, a chunk after a cached prefix, one longer
    than a tile (33 rows), one token."""
    from ridge.layers.attention import PrefillChunk, prefill_attention

    torch.manual_seed(heads + dim)
    block_size, num_blocks = 16, 16
    cache = _pool(num_blocks, block_size, kv_heads, dim, torch.float32, kind)
    specs = [(5, 5), (7, 20), (33, 40), (1, 9)]  # (rows, context after the chunk)
    free = torch.randperm(num_blocks).tolist()
    chunks, slots, row = [], [], 0
    for n, ctx in specs:
        table = torch.tensor([free.pop() for _ in range(-(-ctx // block_size))], device=DEVICE)
        prefix = list(range(ctx - n))  # the cached tokens: written first, as an earlier step did
        write_kv(
            cache,
            torch.randn(len(prefix), kv_heads, dim, device=DEVICE),
            torch.randn(len(prefix), kv_heads, dim, device=DEVICE),
            torch.tensor(
                [int(table[p // block_size]) * block_size + p % block_size for p in prefix],
                dtype=torch.long,
                device=DEVICE,
            ),
        )
        slots += [int(table[p // block_size]) * block_size + p % block_size for p in range(ctx - n, ctx)]
        chunks.append(PrefillChunk(row, row + n, ctx, table))
        row += n
    k = torch.randn(row, kv_heads, dim, device=DEVICE)
    v = torch.randn(row, kv_heads, dim, device=DEVICE)
    write_kv(cache, k, v, torch.tensor(slots, device=DEVICE))
    q = torch.randn(row, heads, dim, device=DEVICE)
    tiles, index = tk.prefill_index(
        [c.start for c in chunks], [c.num_tokens for c in chunks], [c.context_len for c in chunks], DEVICE
    )
    tables = torch.nn.utils.rnn.pad_sequence([c.block_table for c in chunks], batch_first=True)
    out = torch.full_like(q, float("nan"))
    tk.paged_prefill_attention(
        q, out, cache.k, cache.v, cache.k_scale, cache.v_scale, kind, tables, tiles, index, dim**-0.5
    )
    for c in chunks:
        want = prefill_attention(q[c.start : c.end], k[c.start : c.end], v[c.start : c.end], cache, c)
        _close(out[c.start : c.end], want, torch.float32)
