"""The AVX2 kernels' decode-step ops (``csrc/avx2_ops.cpp`` through ``Avx2Kernels``): RMSNorm with
and without the residual add, SiLU-and-multiply, RoPE and paged decode attention, each against
torch's path (``TorchKernels``) in float32 and bfloat16, plus the inputs they hand back to torch
and the inputs they refuse. Runs on every x86 machine with AVX2 (the AVX-512 ones too)."""

from __future__ import annotations

import pytest
import torch

from ridge.kv.cache import PagedKV, dequantize, quantize
from ridge.layers.attention import AttentionMetadata
from ridge.layers.cpu_kernels import cpu_has_avx2, load_avx2_extension
from ridge.layers.kernels import Avx2Kernels, TorchKernels
from ridge.layers.linear import Linear
from ridge.quantization.methods import UnquantizedLinearMethod

from . import cpu_cases

pytestmark = pytest.mark.skipif(not cpu_has_avx2(), reason="this CPU has no AVX2 + FMA + F16C")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    return Avx2Kernels(load_avx2_extension())


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's last place in got's dtype (bf16: 8 bits of mantissa)."""
    bits = 7 if got.dtype is torch.bfloat16 else 23
    want = want.float()
    ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 1 - bits).clamp_min(2.0**-126)
    return (got.float() - want).abs() / ulp


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: fp32 statistics, x * rsqrt rounded to x's dtype, times w."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2048), (5, 264), (2, 3, 100)])
def test_rms_norm_and_the_residual_add(kernels, dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    want = _hf_rms_norm(x, w, 1e-5)
    got = kernels.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    # the same roundings; the sum of squares in another order and 1 / sqrt for torch's rsqrt
    # move float32's last bits, and at most one of bf16's
    ulps = 1 if dtype is torch.bfloat16 else 4
    assert (_ulps(got, want) <= ulps).all()
    residual = torch.randn(shape, generator=gen).to(dtype)
    mine, theirs = residual.clone(), residual.clone()
    got = kernels.add_rms_norm(x, mine, w, 1e-5)
    theirs.add_(x)
    assert torch.equal(mine, theirs)  # one rounded add, as torch's
    assert (_ulps(got, _hf_rms_norm(theirs, w, 1e-5)) <= ulps).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(kernels, dtype):
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(3, 2 * 1000, generator=gen) * 4).to(dtype)  # 1000: a tail past the 8-lane runs
    got, want = kernels.silu_mul(gate_up), TorchKernels().silu_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    # exp's polynomial against torch's: within float32's rounding, then the same bf16 roundings
    assert (_ulps(got, want) <= (1 if dtype is torch.bfloat16 else 8)).all()


class _Rotary:
    def __init__(self, dim: int, positions: int = 300) -> None:
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(positions).float(), inv)
        emb = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def __call__(self, positions, dtype):
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48, 128])
def test_rope_rotates_a_view_into_qkv_as_torch_does(kernels, dtype, head_dim):
    rotary, positions = _Rotary(head_dim), torch.tensor([0, 7, 299, 31])
    qkv = torch.randn(4, 12 * head_dim, generator=torch.Generator().manual_seed(head_dim)).to(dtype)
    q = qkv[:, : 8 * head_dim].view(4, 8, head_dim)  # rows strided by the whole qkv row
    want = TorchKernels().rope(q.clone(), rotary(positions, dtype))
    untouched = qkv[:, 8 * head_dim :].clone()
    got = kernels.rope(q, kernels.rope_state(rotary, positions, dtype))
    assert torch.equal(got, want)  # the same ops in the same order, rounded alike
    assert torch.equal(qkv[:, : 8 * head_dim].view(4, 8, head_dim), want)  # in place
    assert torch.equal(qkv[:, 8 * head_dim :], untouched)


def test_rope_of_a_head_size_it_does_not_take_is_torchs(kernels):
    rotary, positions = _Rotary(40), torch.tensor([3, 4])
    x = torch.randn(2, 4, 40)
    want = TorchKernels().rope(x.clone(), rotary(positions, torch.float32))
    assert torch.equal(kernels.rope(x, kernels.rope_state(rotary, positions, torch.float32)), want)


def _rope_write_case(dtype, head_dim, heads=4, kv_heads=2, tokens=3):
    gen = torch.Generator().manual_seed(head_dim + tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    pools = [torch.randn(6, 4, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    meta = AttentionMetadata(slot_mapping=torch.tensor([5, 17, 9][:tokens]))
    return qkv, PagedKV(*pools), meta, torch.tensor([0, 7, 299][:tokens])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_rope_write_kv_is_rope_then_write_kv(kernels, dtype, head_dim):
    heads, kv_heads = 4, 2
    qkv, cache, meta, positions = _rope_write_case(dtype, head_dim, heads, kv_heads)
    rotary, ref = _Rotary(head_dim), TorchKernels()
    want_qkv, want_cache = qkv.clone(), PagedKV(cache.k.clone(), cache.v.clone())
    qk = want_qkv[:, : (heads + kv_heads) * head_dim].view(3, -1, head_dim)
    qk.copy_(ref.rope(qk.clone(), rotary(positions, dtype)))
    kv = want_qkv[:, (heads + kv_heads) * head_dim :].view(3, -1, head_dim)
    ref.write_kv(want_cache, qk[:, heads:], kv, meta.slot_mapping)
    state = kernels.rope_state(rotary, positions, dtype)
    assert kernels.rope_write_kv(qkv, heads, kv_heads, cache, meta, state)
    assert torch.equal(qkv, want_qkv)  # q and k rotated in place, v untouched
    assert torch.equal(cache.k, want_cache.k) and torch.equal(cache.v, want_cache.v)


def test_rope_write_kv_leaves_a_quantized_cache_and_odd_heads_to_the_separate_ops(kernels):
    qkv, cache, meta, positions = _rope_write_case(torch.float32, 64)
    state = kernels.rope_state(_Rotary(64), positions, torch.float32)
    before = qkv.clone()
    scales = torch.ones(6, 4, 2)
    assert not kernels.rope_write_kv(qkv, 4, 2, PagedKV(cache.k, cache.v, scales, scales, "int8"), meta, state)
    qkv40, cache40, meta40, positions40 = _rope_write_case(torch.float32, 40)  # rope_ takes D % 16 == 0
    state40 = kernels.rope_state(_Rotary(40), positions40, torch.float32)
    assert not kernels.rope_write_kv(qkv40, 4, 2, cache40, meta40, state40)
    assert torch.equal(qkv, before)  # nothing done


def test_rope_write_kv_refuses_a_slot_outside_the_pool(kernels):
    qkv, cache, _, positions = _rope_write_case(torch.float32, 64)
    state = kernels.rope_state(_Rotary(64), positions, torch.float32)
    with pytest.raises(RuntimeError, match="slot 24 is outside the pool"):
        kernels.rope_write_kv(qkv, 4, 2, cache, AttentionMetadata(slot_mapping=torch.tensor([0, 1, 24])), state)


def _attention_case(dtype, head_dim=64, heads=8, kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks, block_size = 24, 16
    k = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.tensor([[5, 2, 17, 0, 0], [9, 1, 3, 11, 23], [4, 0, 0, 0, 0]])
    lens = torch.tensor([37, 80, 1])  # a partial last block, a full table, a single token
    q = torch.randn(3, heads, head_dim, generator=gen).to(dtype)
    return q, PagedKV(k, v), tables, lens


def _meta(tables, lens):
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        num_decode_tokens=len(lens),
        decode_block_tables=tables,
        decode_context_lens=lens,
    )


@pytest.mark.parametrize("dtype", DTYPES)
# 10 query heads a KV head: a run of 8 heads, then 2 (score_heads / weigh_values take up to 8)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 40), (6, 1, 128), (20, 2, 64)])
def test_decode_attention_matches_torchs_path(kernels, dtype, heads, kv_heads, head_dim):
    q, cache, tables, lens = _attention_case(dtype, head_dim, heads, kv_heads)
    got = kernels.decode_attention(q, cache, _meta(tables, lens))
    want = TorchKernels().decode_attention(q, cache, _meta(tables, lens))
    assert got.shape == want.shape and got.dtype == dtype
    # the same roundings (scores and probabilities in bf16); sums over the head and the
    # context in another order
    tol = 2e-2 if dtype is torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    # a stale NaN past a context's end is never read
    nan_cache = PagedKV(cache.k.clone(), cache.v.clone())
    nan_cache.k[5, 5:] = float("nan")  # sequence 0's tokens 37.. (its third block is 17: untouched)
    nan_cache.v[17, 5:] = float("nan")
    assert torch.equal(kernels.decode_attention(q, nan_cache, _meta(tables, lens))[1:], got[1:])
    assert not kernels.decode_attention(q, nan_cache, _meta(tables, lens))[0].isnan().any()


def test_decode_attention_scale_value_dim_and_a_sliced_query(kernels):
    q, cache, tables, lens = _attention_case(torch.float32)
    wide = torch.randn(3, 8, 2 * 64)
    q = wide[..., :64]  # not contiguous
    got = kernels.decode_attention(q, cache, _meta(tables, lens), scale=0.3, value_dim=48)
    want = TorchKernels().decode_attention(q, cache, _meta(tables, lens), scale=0.3, value_dim=48)
    assert got.shape == (3, 8, 48)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", [None, "int8", "fp8"])
def test_one_sequence_on_one_latent_splits_its_heads_over_the_threads_bit_for_bit(kernels, kind):
    """MLA's decode shape (one sequence, 16 or 20 query heads on one KV head, K and V the one
    pool, the first rank dims the values): with fewer (sequence, KV head) jobs than threads the
    kernel splits the heads into runs of 8+ (decode_attention_jobs), where torch's path ran it
    before; each head's output is the same bits as on one thread, and torch's to rounding."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(24, 16, 1, 96, generator=gen).to(torch.bfloat16)
    cache = PagedKV(pool, pool)
    if kind is not None:
        codes, scales = quantize(pool, kind)
        cache = PagedKV(codes, codes, scales, scales, kind)
    tables, lens = torch.tensor([[5, 2, 17, 0, 0]]), torch.tensor([37])
    for heads in (16, 20):
        q = torch.randn(1, heads, 96, generator=gen).to(torch.bfloat16)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            assert kernels.ext.decode_attention_jobs(1, heads, 1) == 2  # two runs of 8+ heads
            split = kernels.decode_attention(q, cache, _meta(tables, lens), scale=0.2, value_dim=64)
            torch.set_num_threads(1)
            assert kernels.ext.decode_attention_jobs(1, heads, 1) == 1
            whole = kernels.decode_attention(q, cache, _meta(tables, lens), scale=0.2, value_dim=64)
        finally:
            torch.set_num_threads(threads)
        assert split.shape == (1, heads, 64) and torch.equal(split, whole)
        want = TorchKernels().decode_attention(q, cache, _meta(tables, lens), scale=0.2, value_dim=64)
        assert torch.allclose(split.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@cpu_cases.KV_KINDS
@cpu_cases.KV_GROUPS
def test_long_contexts_read_a_jobs_kv_heads_together_with_the_same_results(kernels, dtype, kind, heads, kv_heads, dim):
    """A job of several KV heads past a long mean context, in runs of 32 tokens (cpu_cases.py)."""
    cpu_cases.check_kv_heads_read_together(kernels, kind, heads, kv_heads, dim, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@cpu_cases.KV_KINDS
def test_the_kv_grouping_bound_is_a_setting_that_never_changes_a_result(kernels, dtype, kind):
    """set_kv_grouped_bytes through the AVX2 extension (cpu_cases.py)."""
    cpu_cases.check_kv_grouping_bound(kernels, kind, dtype)


def _quantized(cache, kind):
    k8, ks = quantize(cache.k, kind)
    v8, vs = quantize(cache.v, kind)
    return PagedKV(k8, v8, ks, vs, kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["fp8"])
# groups of 32 dims, one group a head (40), 8 query heads and then 2
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 40), (20, 2, 128)])
def test_decode_attention_reads_a_quantized_cache_as_its_dequantized_values(
    kernels, dtype, kind, heads, kv_heads, head_dim
):
    """Each K and V value of an e4m3 cache made in registers is dequantize's (codes times
    scale in float32, rounded to q's dtype): the kernel over the codes equals the kernel over
    the dequantized cache, bit for bit, and torch's path over the codes to float rounding. Its
    subnormal codes (small values of a group) decode exactly too."""
    q, cache, tables, lens = _attention_case(dtype, head_dim, heads, kv_heads)
    cache.k[5, :4] *= 1e-3  # a few values far under their group's amax: e4m3 subnormals
    qcache = _quantized(cache, kind)
    if kind == "fp8":
        assert (((qcache.k & 0x78) == 0) & ((qcache.k & 0x07) != 0)).any()  # exponent field 0, mantissa not
    got = kernels.decode_attention(q, qcache, _meta(tables, lens))
    dequantized = PagedKV(
        dequantize(qcache.k, qcache.k_scale, kind, dtype), dequantize(qcache.v, qcache.v_scale, kind, dtype)
    )
    assert torch.equal(got, kernels.decode_attention(q, dequantized, _meta(tables, lens)))
    want = TorchKernels().decode_attention(q, qcache, _meta(tables, lens))
    tol = 2e-2 if dtype is torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


def _int8_in_groups(x, groups):
    """kv/cache.py's int8 quantization with any number of groups a head (it makes 1 or D / 32):
    codes and fp16 scales (amax / 127)."""
    xf = x.float().unflatten(-1, (groups, -1))
    scale = (xf.abs().amax(-1) / 127).half()
    codes = (xf / scale.float().unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return codes.flatten(-2), scale


def _int8_query_attention(q, qcache, tables, lens, scale):
    """The AVX-512 kernel's int8 attention in float64 (decode_attention_quant.cpp): each group
    of the query quantized to int8 (scale amax / 127, rounded half to even, in float32), its
    integer dots with K's codes times both scales, softmax, then V's codes times their scales."""
    bs, groups = qcache.k.shape[1], qcache.k_scale.shape[-1]
    out = torch.empty(q.shape, dtype=torch.float64)
    heads, head_dim = q.shape[1:]
    per_kv = heads // qcache.k.shape[2]
    for b, length in enumerate(lens.tolist()):
        slots = torch.tensor([tables[b, t // bs].item() * bs + t % bs for t in range(length)])
        flat = (-1,) + qcache.k.shape[2:]
        k, v = qcache.k.reshape(flat)[slots].double(), qcache.v.reshape(flat)[slots].double()
        sflat = (-1,) + qcache.k_scale.shape[2:]
        ks, vs = qcache.k_scale.reshape(sflat)[slots].double(), qcache.v_scale.reshape(sflat)[slots].double()
        for h in range(heads):
            kv = h // per_kv
            x = q[b, h].float().view(groups, -1)
            amax = x.abs().amax(-1, keepdim=True)
            inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
            codes = (x * inv).round()
            qscale = (amax / 127.0 * scale).double()  # float32 ops, as the kernel's
            dots = (codes.double().view(1, groups, -1) * k[:, kv].view(length, groups, -1)).sum(-1)
            scores = (dots * ks[:, kv] * qscale.view(1, groups)).sum(-1)
            p = torch.softmax(scores, 0)
            values = (v[:, kv].view(length, groups, -1) * vs[:, kv].view(length, groups, 1)).view(length, head_dim)
            out[b, h] = p @ values
    return out


@pytest.mark.parametrize("dtype", DTYPES)
# groups of 32 dims, one group a head (40: padded to 64 for the transpose), groups of 8 dims
# (an 8-dim group is 2 quads), 8 query heads and then 2
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,groups", [(8, 2, 64, 2), (4, 4, 40, 1), (20, 2, 128, 4), (8, 2, 48, 6)]
)
def test_int8_cache_attention_is_the_avx512_kernels_formula(kernels, dtype, heads, kv_heads, head_dim, groups):
    """Over an int8 cache the query is quantized to int8 per group of the cache's scales too, as
    the AVX-512 kernel does (integer dot products, exact), and V is its codes times the scales
    in float32: within float rounding of that formula in float64. The query's quantization is
    seen: torch's float path is farther off than the tolerance (float32)."""
    q, cache, tables, lens = _attention_case(dtype, head_dim, heads, kv_heads)
    (k8, ks), (v8, vs) = _int8_in_groups(cache.k, groups), _int8_in_groups(cache.v, groups)
    qcache = PagedKV(k8, v8, ks, vs, "int8")
    got = kernels.decode_attention(q, qcache, _meta(tables, lens), scale=0.2)
    want = _int8_query_attention(q, qcache, tables, lens, 0.2)
    tol = 1e-2 if dtype is torch.bfloat16 else 2e-6
    assert got.dtype == dtype and (got.double() - want).abs().max().item() <= tol * want.abs().max().item()
    if dtype is torch.float32:
        float_query = TorchKernels().decode_attention(q, qcache, _meta(tables, lens), scale=0.2)
        assert (float_query.double() - want).abs().max().item() > 10 * tol * want.abs().max().item()


def test_a_quantized_cache_the_kernel_does_not_read_runs_torchs_path(kernels):
    q, cache, tables, lens = _attention_case(torch.float32)
    qcache = _quantized(cache, "int8")
    odd = PagedKV(qcache.k, qcache.v, qcache.k_scale.float(), qcache.v_scale.float(), "int8")  # float32 scales
    got = kernels.decode_attention(q, odd, _meta(tables, lens))
    assert torch.equal(got, TorchKernels().decode_attention(q, odd, _meta(tables, lens)))
    with pytest.raises(RuntimeError, match="fp16 .* scales expected"):
        kernels.ext.paged_decode_attention_quant(
            q, qcache.k, qcache.v, odd.k_scale, odd.v_scale, tables, lens, 0.125, False
        )


def test_decode_attention_refuses_what_does_not_fit(kernels):
    ext = kernels.ext
    q, cache, tables, lens = _attention_case(torch.float32)
    with pytest.raises(RuntimeError, match="block id outside the pool"):
        ext.paged_decode_attention(q, cache.k, cache.v, tables + 100, lens, 0.125)
    with pytest.raises(RuntimeError, match="does not fit its table"):
        ext.paged_decode_attention(q, cache.k, cache.v, tables, torch.tensor([37, 81, 1]), 0.125)
    with pytest.raises(RuntimeError, match="cache dtype differs"):
        ext.paged_decode_attention(q.bfloat16(), cache.k, cache.v, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ext.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)


def _dense_layer(n: int, k: int, bias: bool) -> Linear:
    gen = torch.Generator().manual_seed(n + k)
    layer = Linear(k, n, bias, UnquantizedLinearMethod())
    layer.weight.data = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16(), requires_grad=False)
    return layer


PREFILL_ROWS = 16  # csrc/avx2_dense.cpp: from these rows of x, tiles of 4 rows of x and 3 of W


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [2048, 100, 13])  # a multiple of 8, a tail of 4, under 8
def test_a_dense_bf16_prefill_runs_tiles_of_x_and_w(kernels, bias, k):
    """From PREFILL_ROWS rows a dense bf16 layer runs tiles of 4 rows of x and 3 of W (ragged
    edges: 37 rows of W, 150 rows of x past a block of 128): float32 products and sums within
    one bf16 rounding of float32's, and each row's output the same in any call of PREFILL_ROWS
    rows or more."""
    layer = _dense_layer(37, k, bias)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(150, k, generator=gen).bfloat16()
    got = kernels.linear(x, layer)
    want = x.float() @ layer.weight.float().T + (layer.bias.float() if bias else 0)
    assert got.dtype is torch.bfloat16 and got.shape == (150, 37)
    assert (_ulps(got, want.bfloat16()) <= 1).all()  # float32 sums in another order: one rounding apart
    for start, stop in [(0, PREFILL_ROWS), (3, 3 + PREFILL_ROWS + 1), (100, 150), (5, 140)]:
        assert torch.equal(kernels.linear(x[start:stop], layer), got[start:stop])
    assert torch.equal(kernels.linear(x.view(2, 75, k), layer), got.view(2, 75, 37))  # leading dims
    # and the matmul is timed as every other (the telemetry's matmul share)
    kernels.take_matmul_s()
    kernels.matmul(x, layer)
    assert kernels.take_matmul_s() > 0


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [2048, 100, 72, 13])  # multiples of 16 and of 8, a tail of 4, under 8
def test_a_dense_bf16_decode_streams_the_weight_once_for_its_rows(kernels, bias, k):
    """Below PREFILL_ROWS (decode) a dense bf16 layer streams the weight once a call: float32
    products and sums rounded to bf16 once, each row's output the same alone or in any batch."""
    layer = _dense_layer(37, k, bias)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(9, k, generator=gen).bfloat16()  # tiles of 4, 4 and 1
    got = kernels.linear(x, layer)
    want = x.float() @ layer.weight.float().T + (layer.bias.float() if bias else 0)
    assert got.dtype is torch.bfloat16 and got.shape == (9, 37)
    assert (_ulps(got, want.bfloat16()) <= 1).all()  # float32 sums in another order: one rounding apart
    for start, stop in [(0, 1), (3, 5), (4, 7), (8, 9), (2, 9)]:
        assert torch.equal(kernels.linear(x[start:stop], layer), got[start:stop])
    # leading dims, and one expert's rows of a stacked layer (no bias)
    assert torch.equal(kernels.linear(x.view(3, 3, k), layer), got.view(3, 3, 37))
    assert torch.equal(kernels.linear(x, layer, slice(8, 20)), kernels.ext.linear_bf16(x, layer.weight[8:20], None))
    if bias:
        assert torch.equal(kernels.linear(x, layer, slice(0, 37)), kernels.linear(x, _dense_layer(37, k, False)))


def test_the_dense_bf16_kernel_refuses_what_it_does_not_take(kernels):
    ext = kernels.ext
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="weight has 16 columns, x has K = 32"):
        ext.linear_bf16(torch.randn(2, 32).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="weight must be"):
        ext.linear_bf16(torch.randn(2, 16).bfloat16(), w.float(), None)
    with pytest.raises(RuntimeError, match="bias of 4 for N = 8"):
        ext.linear_bf16(torch.randn(2, 16).bfloat16(), w, torch.zeros(4))
    empty = ext.linear_bf16(torch.randn(0, 16).bfloat16(), w, None)
    assert empty.shape == (0, 8)
    # a float32 layer, or a bf16 one on float32 rows, stays torch's
    layer = _dense_layer(8, 16, False)
    x = torch.randn(2, 16)
    layer.weight.data = layer.weight.float()
    assert torch.equal(kernels.linear(x, layer), TorchKernels().linear(x, layer))


@cpu_cases.GREEDY
def test_greedy_routing_picks_what_torch_picks(kernels, softmax, norm_topk, scaling, k_width):
    cpu_cases.check_greedy(kernels, softmax, norm_topk, scaling, k_width)


@cpu_cases.GROUPED
def test_grouped_routing_picks_what_torch_picks(kernels, softmax, n_group, topk_group, biased):
    cpu_cases.check_grouped(kernels, softmax, n_group, topk_group, biased)


def test_routing_refuses_what_it_does_not_take_and_leaves_float32_to_torch(kernels):
    cpu_cases.check_refusals(kernels)


def test_a_bf16_router_routes_as_its_float32_copy(kernels):
    cpu_cases.check_bf16_router(kernels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32000, 37, 5, 1])  # a tail past whole 8-lane runs; under 16 (no lanes)
def test_argmax_is_torchs_argmax_first_of_ties_and_nans(kernels, dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    if vocab > 30:
        logits[1, [3, 17, vocab - 1]] = 9.0  # ties: the first wins (across lanes and runs)
        logits[2, [vocab - 1, 11]] = 9.0
        logits[3, [20, 4]] = float("nan")  # torch takes a NaN as the largest: the first NaN
        logits[4, :] = float("-inf")
    got = kernels.argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.float().argmax(dim=-1))
    assert torch.equal(kernels.argmax(logits[2:5]), got[2:5])  # a row's answer whatever the batch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [None, "int8"])
def test_prefill_attention_is_each_tokens_decode_whatever_the_chunking(kernels, dtype, kind):
    """Prefill runs each query as a decode over the context up to it (cpu_cases.py)."""
    cpu_cases.check_prefill_as_decodes(kernels, dtype, kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@cpu_cases.BITMASK
def test_token_bitmask_matches_llguidance_and_the_torch_path(kernels, dtype, vocab, words):
    cpu_cases.check_token_bitmask(kernels, dtype, vocab, words)
