"""An int8 / fp8 KV cache: codes and a scale per 32 values of a token's head; attention read from it against
a reference on the dequantized K/V; the engine with it (story, prefix caching, preemption,
pool size)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.kv import cache as kv_cache
from ridge.kv.cache import PagedKV
from ridge.layers.attention import AttentionMetadata, decode_valid_mask
from ridge.layers.cpu_kernels import cpu_has_avx512_bf16, select_kernels
from ridge.layers.kernels import TorchKernels

KINDS = ("int8", "fp8")


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_round_trip_is_within_half_a_step(kind):
    x = torch.randn(50, 4, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0] = 0  # an all-zero row: scale 0, codes 0
    codes, scale = kv_cache.quantize(x, kind)
    assert codes.dtype == (torch.int8 if kind == "int8" else torch.uint8) and scale.dtype == torch.float16
    assert scale.shape == (50, 4, 2)  # one per 32 values, llama.cpp's q8_0 cache granularity
    back = kv_cache.dequantize(codes, scale, kind, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(64))
    amax = x.unflatten(-1, (2, 32)).abs().amax(-1, keepdim=True).repeat_interleave(32, -1).flatten(-2)
    if kind == "int8":  # half a step of amax / 127, plus the scale's fp16 rounding
        bound = amax / 254 + amax * 2**-11
    else:  # e4m3: 3 mantissa bits, half an ulp relative (plus the smallest subnormal)
        bound = x.abs() * 2**-4 + amax / 448 * 2**-9 + amax * 2**-11
    assert ((back - x).abs() <= bound * 1.001).all()


def _cache_case(kind, dim, lens, kv_heads=2, block_size=4, num_blocks=80, seed=1):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    (kc, ks), (vc, vs) = kv_cache.quantize(k, kind), kv_cache.quantize(v, kind)
    shape = (num_blocks, block_size, kv_heads, dim)
    scales = (*shape[:-1], kv_cache.scale_groups(dim))
    cache = PagedKV(kc.view(shape), vc.view(shape), ks.view(scales), vs.view(scales), kind)
    width = max(-(-n // block_size) for n in lens)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    context = torch.tensor(lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        num_decode_tokens=len(lens),
        decode_block_tables=tables,
        decode_context_lens=context,
        decode_mask=decode_valid_mask(context, width * block_size),
    )
    return cache, meta, gen


def _dense_reference(q, cache, meta):
    """The gathered torch path over a dense cache holding the dequantized values."""
    k = kv_cache.dequantize(cache.k, cache.k_scale, cache.kind, torch.float32)
    v = kv_cache.dequantize(cache.v, cache.v_scale, cache.kind, torch.float32)
    return TorchKernels().decode_attention(q.float(), PagedKV(k, v), meta)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_decode_path_reads_the_dequantized_cache(kind):
    cache, meta, gen = _cache_case(kind, 16, [5, 40, 17])
    q = torch.randn(3, 6, 16, generator=gen)
    got = TorchKernels().decode_attention(q, cache, meta)
    assert torch.allclose(got, _dense_reference(q, cache, meta), atol=1e-6)


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim,heads", [(64, 8), (16, 2), (128, 6), (32, 16), (48, 4), (96, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [5, 40, 17], [130, 3]])
def test_cpu_kernel_reads_codes_and_scales_from_the_pool(kind, dim, heads, dtype, lens):
    cache, meta, gen = _cache_case(kind, dim, lens)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    got = select_kernels("ridge", torch.device("cpu"), dtype).decode_attention(q, cache, meta)
    want = _dense_reference(q, cache, meta)
    assert got.dtype == dtype
    # int8 K: the query is quantized to int8 per 32 too (outputs within 1%); V's weights (p times
    # the token's scale) are bf16 in the PV's dot products (a 2^-9 rounding each, fp8 too); bf16
    # output rounding
    tol = 0.02 if dtype is torch.bfloat16 else 0.01 if kind == "int8" else 0.004
    assert (got.float() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv_heads", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [2, 8])
def test_cpu_kernel_reads_whole_blocks_of_scales_as_it_gathers_them(kind, kv_heads, block_size, group):
    """Blocks of 16k tokens: a chunk of 16 tokens lies in one block and the kernel loads its
    scales as they lie (1, 2 or 4 KV heads; others gather them) and fetches the rows ahead by a
    stride. The same pool read as blocks half as long (each block two, the tables to match),
    where every chunk's scales are gathered, gives the same outputs bit for bit; contexts that
    end mid-chunk included. 8 query heads a KV head: int8's scores 8 heads a pass, the query's
    codes by quads of dims."""
    lens = [16, 40, 130, 3]
    cache, meta, gen = _cache_case(kind, 64, lens, kv_heads=kv_heads, block_size=block_size, num_blocks=40)
    q = torch.randn(len(lens), group * kv_heads, 64, generator=gen)
    kernels = select_kernels("ridge", torch.device("cpu"), torch.float32)
    got = kernels.decode_attention(q, cache, meta)

    def halves(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0] * 2, t.shape[1] // 2, *t.shape[2:])

    split = PagedKV(halves(cache.k), halves(cache.v), halves(cache.k_scale), halves(cache.v_scale), kind)
    tables = meta.decode_block_tables
    tables = torch.stack([2 * tables, 2 * tables + 1], dim=-1).reshape(tables.shape[0], -1)
    gathered = kernels.decode_attention(q, split, dataclasses.replace(meta, decode_block_tables=tables))
    assert torch.equal(got, gathered)
    want = _dense_reference(q, cache, meta)  # and both near the dequantized cache's attention
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [1, 5, 6])
@pytest.mark.parametrize("group", [2, 8])
def test_cpu_kernel_reads_blocks_of_odd_and_even_token_counts(kind, block_size, group):
    """The PV pass takes a token pair's second row a stride after the first where blocks hold an
    even count of tokens, and looks each row up where they hold an odd one (a pair across two
    blocks): both near the dequantized cache's attention, odd context lengths included."""
    lens = [1, 7, 40, 33]
    cache, meta, gen = _cache_case(kind, 64, lens, kv_heads=2, block_size=block_size, num_blocks=200)
    q = torch.randn(len(lens), group * 2, 64, generator=gen)
    got = select_kernels("ridge", torch.device("cpu"), torch.float32).decode_attention(q, cache, meta)
    want = _dense_reference(q, cache, meta)
    tol = 0.01 if kind == "int8" else 0.004
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()


def _shared_cache_case(kind, dim, lens, block_size=16, num_blocks=60, seed=2):
    """MLA's latent in int8/fp8: one KV head that is both K and V (``v is k``), as kv/cache.py
    allocates it for ``keys_only`` specs."""
    cache, meta, gen = _cache_case(kind, dim, lens, kv_heads=1, block_size=block_size, num_blocks=num_blocks, seed=seed)
    return PagedKV(cache.k, cache.k, cache.k_scale, cache.k_scale, kind), meta, gen


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens,heads,dim,value_dim,block_size",
    [
        ([1], 16, 288, 256, 16),
        ([5, 300, 17], 16, 48, 32, 16),  # 48 dims: one scale for the whole vector
        ([129, 2], 20, 80, 64, 16),  # 20 heads: a second vector of lanes, mostly empty
        ([700], 32, 576, 512, 16),
        ([130, 17], 16, 64, 32, 5),  # chunks of 128 tokens start inside a block
    ],
)
def test_shared_latent_kernel_computes_what_the_per_head_kernel_does(
    kind, dtype, lens, heads, dim, value_dim, block_size
):
    """16+ heads on one quantized KV head (MLA): heads in a vector's lanes and the context in
    chunks over the threads; the same scores as the per-(sequence, KV head) kernel (int8: the
    same integers and float ops), the same fp32 softmax and values, summed in another order;
    and within the per-head kernel's bounds of the dequantized reference."""
    cache, meta, gen = _shared_cache_case(kind, dim, lens, block_size=block_size)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    kernels = select_kernels("ridge", torch.device("cpu"), dtype)
    got = kernels.decode_attention(q, cache, meta, 0.2, value_dim)
    tables, context, fp8 = meta.decode_block_tables, meta.decode_context_lens, kind == "fp8"
    per_head = kernels.ext.paged_decode_attention_quant(
        q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables, context, 0.2, fp8
    )[..., :value_dim]
    assert got.shape == (len(lens), heads, value_dim) and got.dtype == dtype
    ext = kernels.ext
    shared = ext.paged_decode_attention_shared_quant(q, cache.k, cache.k_scale, tables, context, 0.2, value_dim, fp8)
    assert torch.equal(got, shared)  # the kernels route MLA's quantized latent there
    scale = per_head.float().abs().max().item()
    # float32: the per-head kernel's V weights in bf16 (pv_pairs_chunk: a 2^-9 rounding each)
    # and the order of fp32 sums; bf16: that, and so now and then the other side of a rounding
    tol = 2**-8 if dtype is torch.float32 else 2**-7
    assert (got.float() - per_head.float()).abs().max().item() <= tol * scale
    k = kv_cache.dequantize(cache.k, cache.k_scale, kind, torch.float32)
    want = TorchKernels().decode_attention(q.float(), PagedKV(k, k), meta, 0.2, value_dim)
    # the int8 query (per 32 dims, or per 48 where one scale covers the vector) moves outputs ~1%
    ref_tol = 0.02 if dtype is torch.bfloat16 or kind == "int8" else 1e-5
    assert (got.float() - want).abs().max().item() <= ref_tol * want.abs().max().item()


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
@pytest.mark.parametrize("kind", KINDS)
def test_shared_latent_kernel_is_batch_invariant_and_reads_only_the_context(kind):
    """A sequence alone gives the bytes it gives beside others, and NaN scales in every slot no
    sequence wrote change nothing (a NaN scale read would poison the sequence's output)."""
    lens, block_size, dim = [300, 7, 129], 16, 64
    cache, meta, gen = _shared_cache_case(kind, dim, lens, block_size=block_size)
    q = torch.randn(len(lens), 16, dim, generator=gen).to(torch.bfloat16)
    kernels = select_kernels("ridge", torch.device("cpu"), torch.bfloat16)
    whole = kernels.decode_attention(q, cache, meta, 0.2, 32)
    tables = meta.decode_block_tables
    for i in range(len(lens)):
        alone = AttentionMetadata(
            slot_mapping=meta.slot_mapping[[i]],
            num_decode_tokens=1,
            decode_block_tables=tables[[i]],
            decode_context_lens=meta.decode_context_lens[[i]],
        )
        assert torch.equal(kernels.decode_attention(q[[i]], cache, alone, 0.2, 32), whole[[i]])
    written = torch.zeros(cache.k.shape[0] * block_size, dtype=torch.bool)
    for row, n in zip(tables, lens):
        slots = row.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(tables.shape[1])
        written[slots[:n]] = True
    scales = cache.k_scale.clone()
    scales.view(-1, scales.shape[-1])[~written] = float("nan")
    poisoned = PagedKV(cache.k, cache.k, scales, scales, kind)
    assert torch.equal(kernels.decode_attention(q, poisoned, meta, 0.2, 32), whole)


def test_unknown_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8, got 'int4'"):
        LLM("random:tiny", kv_cache_dtype="int4")


def test_the_pool_holds_about_twice_the_tokens_in_the_same_memory():
    sizes = {
        kind: LLM("random:tiny", dtype="bfloat16", kv_cache_dtype=kind, kv_cache_memory=0.01)
        for kind in ("auto", "int8", "fp8")
    }
    blocks = {kind: llm.engine.num_kv_blocks for kind, llm in sizes.items()}
    # head_dim 16: 32 bytes in bf16 against 16 codes + a 2-byte scale
    assert blocks["int8"] == blocks["fp8"] and 32 / 18 - 0.01 <= blocks["int8"] / blocks["auto"] <= 32 / 18 + 0.01
    # head_dim 64 (TinyLlama): 128 bytes per token and head in bf16, 64 codes + 2 scales quantized: 1.88x
    assert kv_cache.bytes_per_token_head("auto", 64, torch.bfloat16) / kv_cache.bytes_per_token_head(
        "int8", 64, torch.bfloat16
    ) == pytest.approx(128 / 68)


@pytest.mark.parametrize("kind", KINDS)
def test_stories_still_tells_the_story_with_a_quantized_cache(stories_dir, kind):
    llm = LLM(str(stories_dir), kv_cache_dtype=kind, num_kv_blocks=64)
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert out[0].outputs[0].text.startswith(", there was a little girl named Lily. She loved to play outside")


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_caching_and_chunking_see_the_same_stored_values(stories_dir, kind):
    prompts = ["Once upon a time, there was a little girl named Lily. " + s for s in ("She", "One day", "Her mom")]
    params = SamplingParams(temperature=0, max_tokens=20)
    cached = LLM(str(stories_dir), kv_cache_dtype=kind, num_kv_blocks=64, block_size=4)
    first = cached.generate(prompts, params, use_tqdm=False)
    again = cached.generate(prompts, params, use_tqdm=False)  # now served from the prefix cache
    assert cached.engine.kv.prefix_hits > 0
    plain = LLM(str(stories_dir), kv_cache_dtype=kind, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    chunked = LLM(str(stories_dir), kv_cache_dtype=kind, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    texts = [o.outputs[0].text for o in first]
    assert texts == [o.outputs[0].text for o in again]
    assert texts == [o.outputs[0].text for o in plain.generate(prompts, params, use_tqdm=False)]
    assert texts == [o.outputs[0].text for o in chunked.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_with_a_quantized_cache_finishes_everything_and_frees_the_pool(stories_dir, kind):
    prompts = ["Once upon a time", "The cat", "Lily and Ben", "One day, a little dog", "The sun was", "Tom had"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(stories_dir), kv_cache_dtype=kind, num_kv_blocks=12, block_size=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.counts()["used"] == 0
