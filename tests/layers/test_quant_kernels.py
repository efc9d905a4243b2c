"""ridge's quantized linear kernel (integer dot products on AVX-512 VNNI) against a float32
matmul of the dequantized weights. x is quantized to int8 per block of 32 (Q2_K, Q3_K: per
super-block of 256) inside the kernel (as llama.cpp does), so the tolerance is that of an
8-bit activation, not bf16's."""

from __future__ import annotations

import os
import time

import pytest
import torch

from ridge.layers.cpu_kernels import cpu_flags, cpu_has_avx512_bf16, load_extension
from ridge.layers.kernels import QUANT_KERNEL_CODES
from ridge.quantization.formats import FORMATS
from ridge.quantization.random_blocks import random_blocks

pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")


@pytest.fixture(scope="module")
def ext():
    return load_extension()


def _packed(ext, name: str, n: int, k: int, seed: int):
    fmt = FORMATS[name]
    if fmt.quantizable:
        blocks = fmt.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)
    else:  # read from files only: random codes under realistic scales
        blocks = random_blocks(fmt, n, k, seed)
    packed = ext.pack_quant(blocks, QUANT_KERNEL_CODES[name], n, k)
    return blocks, packed


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 8, 17, 64, 200])
@pytest.mark.parametrize("n,k", [(37, 64), (16, 32), (100, 256), (21, 768)])
def test_matches_dequantized_fp32_reference(ext, name, m, n, k):
    if k % FORMATS[name].block:
        pytest.skip(f"{name} takes K in multiples of {FORMATS[name].block}")
    blocks, packed = _packed(ext, name, n, k, seed=m + n + k)
    w = FORMATS[name].dequantize(blocks, k)
    gen = torch.Generator().manual_seed(m)
    bias = torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for b in (bias, None):
            got = ext.linear_quant(x, packed, QUANT_KERNEL_CODES[name], n, b)
            want = x.float() @ w.T + (b if b is not None else 0)
            assert got.dtype == dtype and got.shape == (m, n)
            # per element: int8 activations (|error| <= scale / 2 per x, a scale per
            # activation block) summed over k, plus the output's rounding to bf16
            span = FORMATS[name].activation_block
            x_err = (x.float().reshape(m, -1, span).abs().amax(-1) / 127 / 2).repeat_interleave(span, -1)
            bound = x_err @ w.abs().T * 1.01 + want.abs() * (2**-8 if dtype is torch.bfloat16 else 1e-6) + 1e-5
            assert ((got.float() - want).abs() <= bound).all()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_pack_round_trips_to_the_same_blocks(ext, name):
    k = 96 if FORMATS[name].block == 32 else 512
    blocks, packed = _packed(ext, name, 37, k, seed=1)
    assert torch.equal(ext.unpack_quant(packed, QUANT_KERNEL_CODES[name], 37, k), blocks)
    # the packed layer holds exactly the GGUF bytes of its rows, padded to 16-row blocks
    assert packed.numel() == 48 * blocks.shape[1]


def test_exact_on_exactly_representable_inputs(ext):
    # x already on an int8 grid per block and W's codes small: the integer path is exact
    n, k = 16, 64
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (n, k), generator=gen).float()
    blocks = FORMATS["int8"].quantize(codes)
    packed = ext.pack_quant(blocks, QUANT_KERNEL_CODES["int8"], n, k)
    x = torch.randint(-127, 128, (3, k), generator=gen).float()
    x[:, ::32] = 127  # each block's scale is exactly 1
    want = x @ FORMATS["int8"].dequantize(blocks, k).T
    assert torch.allclose(ext.linear_quant(x, packed, QUANT_KERNEL_CODES["int8"], n, None), want, rtol=1e-5)


def _quantized_x(x: torch.Tensor, span: int) -> torch.Tensor:
    """x as the kernel rounds it: int8 codes per ``span`` k, scale amax / 127 (float32 ops)."""
    blocks = x.reshape(x.shape[0], -1, span)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("m", [1, 5, 16])
def test_exactly_the_dequantized_product_of_x_as_the_format_rounds_it(ext, name, m):
    """x rounded to int8 per the format's activation block (per 32, or per super-block for
    Q2_K and Q3_K), times the dequantized weights: what is left is the float rounding of the
    scales and sums, far below one code's step (a wrong scale, minimum, offset, or x's block
    is not). x's blocks of 32 are scaled apart (1/100 to 1) so that rounding per 32 and per
    super-block give different answers."""
    n, k = 37, 512
    blocks, packed = _packed(ext, name, n, k, seed=m)
    w = FORMATS[name].dequantize(blocks, k).double()
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 0, k // 32).repeat_interleave(32)
    got = ext.linear_quant(x, packed, QUANT_KERNEL_CODES[name], n, None).double()
    xq = _quantized_x(x, FORMATS[name].activation_block).double()
    assert ((got - xq @ w.T).abs() <= (xq.abs() @ w.abs().T) * 1e-5 + 1e-30).all()
    other = _quantized_x(x, 256 if FORMATS[name].activation_block == 32 else 32).double()
    assert not ((got - other @ w.T).abs() <= (other.abs() @ w.abs().T) * 1e-5).all()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_rows_output_does_not_depend_on_its_batch(ext, name):
    """Also the AMX-INT8 path against the VNNI loop where the CPU has AMX (tiles of 12-16 rows
    take it, one row never): the same integers and the same float ops, so the same bits. K = 96
    gives the per-32 formats 3 groups (a partial chunk of tile products)."""
    k = 96 if FORMATS[name].block == 32 else 512
    blocks, packed = _packed(ext, name, 40, k, seed=5)
    code = QUANT_KERNEL_CODES[name]
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    alone = torch.cat([ext.linear_quant(x[i : i + 1], packed, code, 40, None) for i in range(300)])
    for m in (2, 3, 8, 12, 17, 64, 200, 300):  # streaming tiles, and slabs of 128 rows
        assert torch.equal(ext.linear_quant(x[:m], packed, code, 40, None), alone[:m])


def test_amx_int8_is_used_where_the_cpu_has_it(ext):
    assert ext.amx_int8_ready() == ("amx_int8" in cpu_flags() and os.environ.get("RIDGE_AMX") != "0")


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rows,heads,n", [(1, 16, 32), (3, 5, 16), (14, 3, 48), (130, 2, 16)])
def test_head_matmul_is_each_heads_linear(ext, name, rows, heads, n):
    """MLA's absorbed matrices in a block format: head h of a stacked (H N, K) weight on x[:, h]
    gives exactly linear_quant of that head's rows (the same integers and float ops, whatever
    the heads beside it and the rows' strides), and so the dequantized product within an int8
    activation's error. 130 rows: two slabs; 14: a tile of AMX rows where the CPU has AMX-INT8."""
    k = 64 if FORMATS[name].block == 32 else 256
    blocks, packed = _packed(ext, name, heads * n, k, seed=rows + heads + n)
    code = QUANT_KERNEL_CODES[name]
    gen = torch.Generator().manual_seed(rows)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(heads, rows, k + 8, generator=gen).to(dtype)[..., 4 : k + 4].transpose(0, 1)  # strided
        got = ext.head_matmul_quant(x, packed, code, n)
        assert got.dtype == dtype and got.shape == (rows, heads, n)
        for h in range(heads):
            head = packed[h * n // 16 : (h + 1) * n // 16]
            assert torch.equal(got[:, h], ext.linear_quant(x[:, h].contiguous(), head, code, n, None))
    w = FORMATS[name].dequantize(blocks, k).view(heads, n, k)
    want = torch.einsum("dhk,hnk->dhn", x.float(), w)
    assert (got.float() - want).abs().max().item() <= 0.05 * want.abs().max().item()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grouped_experts_are_each_experts_linear(ext, name):
    """An MoE's stacked experts in one call (every expert's blocks shared out over the threads
    together): each run of rows equals linear_quant of that expert's own rows of W, bit for bit,
    with experts of no rows, one row, an AMX-sized tile (14) and two slabs (130)."""
    k, n = (64 if FORMATS[name].block == 32 else 256), 32
    counts = [1, 0, 14, 3, 0, 130, 1]
    _, packed = _packed(ext, name, len(counts) * n, k, seed=len(name))
    code = QUANT_KERNEL_CODES[name]
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(sum(counts), k, generator=gen).to(dtype)
        got = ext.linear_quant_grouped(x, packed, code, n, counts)
        row = 0
        for e, c in enumerate(counts):
            expert = packed[e * n // 16 : (e + 1) * n // 16]
            if c:
                assert torch.equal(got[row : row + c], ext.linear_quant(x[row : row + c], expert, code, n, None))
            row += c
    with pytest.raises(RuntimeError, match="counts do not add up"):
        ext.linear_quant_grouped(x[:-1], packed, code, n, counts)


def test_grouped_bf16_experts_are_each_experts_linear(ext):
    """bf16 stacked experts in one call (the streaming kernel's experts in one pass of the
    threads, others one call each): each run of rows equals linear_bf16 on that expert's own
    packed rows, bit for bit; experts of no rows, one row, a few (AMX's on Intel) and 70 (the
    prefill kernel)."""
    k, n = 96, 48
    counts = [1, 0, 3, 1, 0, 70, 1, 2]
    gen = torch.Generator().manual_seed(5)
    packed = ext.pack_vnni((torch.randn(len(counts) * n, k, generator=gen) * 0.1).bfloat16())
    x = torch.randn(sum(counts), k, generator=gen).bfloat16()
    got = ext.linear_bf16_grouped(x, packed, n, counts)
    row = 0
    for e, c in enumerate(counts):
        if c:
            expert = packed[e * n // 16 : (e + 1) * n // 16]
            assert torch.equal(got[row : row + c], ext.linear_bf16(x[row : row + c], expert, n, None)), e
        row += c


def test_blocks_shared_out_by_stealing_give_the_same_bits(ext):
    """The threads share a matmul's blocks with work stealing (block_runs.h): whichever thread
    takes a block, and however the runs split, every block is computed once, as one thread
    computes it."""
    n, k = 1024, 256
    _, packed = _packed(ext, "int4", n, k, seed=9)
    code = QUANT_KERNEL_CODES["int4"]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(10)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = ext.linear_quant(x, packed, code, n, None)
        torch.set_num_threads(max(2, threads))
        for _ in range(200):
            assert torch.equal(ext.linear_quant(x, packed, code, n, None), want)
    finally:
        torch.set_num_threads(threads)


def test_a_matmul_times_its_setup_and_waiting_threads(ext):
    """step_parts.h: a block-format matmul adds what it did before its threads started (x
    quantized, the tiles set up) and its threads' time not computing within the region;
    take_step_parts returns every part in order and starts the count again."""
    _, packed = _packed(ext, "int4", 1024, 256, seed=3)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    ext.take_step_parts()
    start = time.perf_counter()
    ext.linear_quant(x, packed, QUANT_KERNEL_CODES["int4"], 1024, None)
    wall = time.perf_counter() - start
    parts = ext.take_step_parts()
    assert [name for name, _ in parts][-2:] == ["matmul_setup", "matmul_wait"]
    timed = dict(parts)
    assert timed["matmul_setup"] > 0.0 and timed["matmul_wait"] >= 0.0
    assert timed["matmul_setup"] + timed["matmul_wait"] < wall
    assert all(t == 0.0 for name, t in parts if not name.startswith("matmul_"))  # no plan ran
    assert all(t == 0.0 for _, t in ext.take_step_parts())


def test_head_matmul_checks_its_weight(ext):
    blocks, packed = _packed(ext, "int8", 32, 64, seed=0)
    with pytest.raises(RuntimeError, match="does not match"):
        ext.head_matmul_quant(torch.randn(1, 3, 64), packed, QUANT_KERNEL_CODES["int8"], 16)  # 3 heads, 2 held
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.head_matmul_quant(torch.randn(1, 4, 64), packed, QUANT_KERNEL_CODES["int8"], 8)
