"""The AVX2 kernels (``csrc/avx2_blocks.cpp``, ``Avx2Kernels``): every block format's matmul on
the GGUF bytes against a float32 matmul of the dequantized weights (x is quantized to int8 per
32 inside the kernel, as llama.cpp does, so the tolerance is an 8-bit activation's), a row's
output independent of its batch, and the kernels ridge picks on a CPU with AVX2 alone. Runs on
every x86 machine with AVX2 (the AVX-512 ones too)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ridge.layers import cpu_kernels
from ridge.layers.cpu_kernels import cpu_has_avx2, load_avx2_extension
from ridge.layers.kernels import AVX2_PACKED_FORMATS, Avx2Kernels
from ridge.layers.linear import Linear, PackedLinear
from ridge.quantization.formats import FORMATS, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0
from ridge.quantization.methods import BlockQuantLinearMethod, ShardedLinearMethod
from ridge.quantization.random_blocks import random_blocks

from .cpu_cases import asks_for_huge_pages, thp_mode

pytestmark = pytest.mark.skipif(not cpu_has_avx2(), reason="this CPU has no AVX2 + FMA + F16C")


@pytest.fixture(scope="module")
def ext():
    return load_avx2_extension()  # compiled once per machine (setup does it), then cached on disk


def _blocks(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    fmt = FORMATS[name]
    if fmt.quantizable:
        return fmt.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return random_blocks(fmt, n, k, seed)  # read from files only: random codes under realistic scales


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 4, 9, 64])
@pytest.mark.parametrize("n,k", [(37, 256), (16, 512), (21, 768)])
def test_matches_dequantized_fp32_reference(ext, name, m, n, k):
    fmt = FORMATS[name]
    blocks = _blocks(name, n, k, seed=m + n + k)
    w = fmt.dequantize(blocks, k)
    gen = torch.Generator().manual_seed(m)
    bias = torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for b in (bias, None):
            got = ext.linear_blocks(x, blocks, fmt.ggml_type, b)
            want = x.float() @ w.T + (b if b is not None else 0)
            assert got.dtype == dtype and got.shape == (m, n)
            # per element: int8 activations (|error| <= scale / 2 per x, a scale per 32 or per
            # super-block of 256) summed over k, plus the output's rounding to bf16
            g = fmt.block
            x_err = (x.float().reshape(m, -1, g).abs().amax(-1) / 127 / 2).repeat_interleave(g, -1)
            bound = x_err @ w.abs().T * 1.01 + want.abs() * (2**-8 if dtype is torch.bfloat16 else 1e-5) + 1e-5
            assert ((got.float() - want).abs() <= bound).all()


def _int8_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernel reads it: int8 codes per ``group`` (the format's block: 32, or 256 for
    the super-block formats as llama.cpp's Q8_K; scale amax / 127, ties to even), as floats."""
    groups = x.float().reshape(x.shape[0], -1, group)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(groups * inverse) * scale).reshape(x.shape)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_equals_the_dequantized_weights_times_int8_activations(ext, name):
    """Beyond the bound: the kernel computes exactly (to float rounding) the dequantized
    weights times x's int8 codes. Offsets and minimums included: a minimum taken against x
    itself instead of its codes was within the bound above and 0.5 nats off on a 2-layer model."""
    fmt, k = FORMATS[name], 768
    blocks = _blocks(name, 40, k, seed=5)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(6))
    want = _int8_activations(x, fmt.block).double() @ fmt.dequantize(blocks, k).double().T
    got = ext.linear_blocks(x, blocks, fmt.ggml_type, None).double()
    assert ((got - want).norm() / want.norm()).item() < 2e-6


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_layer_split_along_k_sums_to_the_unsplit_layers_outputs_exactly(ext, name):
    """Tensor parallelism's row-parallel layers: each rank's half of K, then the all-reduce's
    one float add, equal the whole layer bit for bit (the kernel sums over K as a tree)."""
    fmt = FORMATS[name]
    for k in (1024, 3072, 5632 // 256 * 256):
        blocks = _blocks(name, 24, k, seed=k)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(k))
        whole = ext.linear_blocks(x, blocks, fmt.ggml_type, None)
        for ranks in (2, 4):
            if (k // fmt.block) % ranks:
                continue
            cols, width = k // ranks, blocks.shape[1] // ranks
            parts = [
                ext.linear_blocks(
                    x[:, r * cols : (r + 1) * cols], blocks[:, r * width : (r + 1) * width], fmt.ggml_type, None
                )
                for r in range(ranks)
            ]
            total = parts[0] + parts[1] if ranks == 2 else (parts[0] + parts[1]) + (parts[2] + parts[3])
            assert torch.equal(total, whole), (k, ranks)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("m", [11, 40])
def test_a_rows_output_does_not_depend_on_its_batch(ext, name, m):
    """Also across the kernel's switches to packing W's rows as it goes (from 8 rows of x: both
    batches pack, their rows alone and the slice of 6 do not) and to decoding a format's codes
    once for all rows of x (all but Q8_0's, from 16 rows, and from 8 for Q5_K, Q6_K and Q3_K:
    the batch of 40 does, and the batch of 11 for those three)."""
    fmt, k = FORMATS[name], 512
    blocks = _blocks(name, 40, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    batch = ext.linear_blocks(x, blocks, fmt.ggml_type, None)
    for i in (0, 5, m - 1):
        assert torch.equal(ext.linear_blocks(x[i : i + 1], blocks, fmt.ggml_type, None)[0], batch[i])
    assert torch.equal(ext.linear_blocks(x[3:9], blocks, fmt.ggml_type, None), batch[3:9])


def test_the_formats_packed_at_load_have_rows_of_8():
    """Every format has rows of 8 (AVX2_PACKED_FORMATS at load; the others as the kernel
    goes, in calls of many rows)."""
    assert AVX2_PACKED_FORMATS < set(FORMATS)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_rows_of_8_keep_the_bytes_and_the_outputs_bit_for_bit(ext, name):
    """The packed layout: the same bytes in blocks of 8 rows (its inverse gives GGUF's back),
    and the same outputs as the GGUF layout for every tile height (m), every shape of a row's
    tree over its blocks (their count a power of 2, odd, or neither; up to 512 leaves), a
    format's codes decoded once for all rows (all but Q8_0's; m = 17 and 33: 16 rows or more;
    Q5_K's, Q6_K's and Q3_K's from 8, m = 9 too), and GGUF's layout packed as the kernel goes
    (m = 9, 17 and 33: 8 rows or more)."""
    fmt = FORMATS[name]
    for k in (32, 96, 256, 416, 768, 2048, 2816, 12288, 16384):
        if k % fmt.block:
            continue
        blocks = _blocks(name, 24, k, seed=k)
        packed = ext.repack_rows(blocks, fmt.ggml_type, True)
        assert packed.shape == (3, 8 * blocks.shape[1])
        assert torch.equal(ext.repack_rows(packed, fmt.ggml_type, False), blocks)
        assert not torch.equal(packed.view(-1), blocks.view(-1))
        for m in (1, 3, 4, 5, 9, 17, 33):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            gguf = ext.linear_blocks(x, blocks, fmt.ggml_type, None)
            torch.testing.assert_close(ext.linear_blocks_packed(x, packed, fmt.ggml_type, None), gguf, rtol=0, atol=0)
            if m in (9, 33):  # packed as it goes, against each row alone in GGUF's layout
                rows = torch.cat([ext.linear_blocks(x[i : i + 1], blocks, fmt.ggml_type, None) for i in range(m)])
                torch.testing.assert_close(gguf, rows, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="rows of 35 bytes are not whole blocks of 34"):
        ext.repack_rows(torch.zeros(8, 35, dtype=torch.uint8), FORMATS["int8"].ggml_type, True)
    k = 2 * fmt.block
    with pytest.raises(RuntimeError, match="repack_rows: 12 rows are not blocks of 8"):
        ext.repack_rows(_blocks(name, 12, k, seed=0), fmt.ggml_type, True)
    need = 8 * fmt.row_bytes(k)
    with pytest.raises(RuntimeError, match=f"blocks of 36 bytes a block of 8 rows, K = {k} needs {need}"):
        ext.linear_blocks_packed(torch.randn(1, k), torch.zeros(2, 36, dtype=torch.uint8), fmt.ggml_type, None)


@pytest.mark.parametrize("name", ["int8", "int4", "q4_k", "iq4_xs", "q5_k", "q6_k", "q3_k", "q2_k"])
def test_where_w_is_fetched_ahead_never_changes_an_output(ext, name):
    """The matmuls fetch W ahead into L1 on AMD (in rows of 8, once a line for 1-3 rows of x:
    fetch_w; while a block of 8 rows is decoded once for 8-15 rows, the thread's next block:
    NextBlock) and into L2 elsewhere (avx2_simd.h): both ways give the same outputs bit for bit,
    in either layout and at any height, and the default is the CPU vendor's."""
    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    assert ext.fetch_into_l2() is not amd
    fmt = FORMATS[name]
    k = 2048  # 40 rows: 70-140 KB, past both fetch distances
    blocks = _blocks(name, 40, k, seed=5)
    packed = ext.repack_rows(blocks, fmt.ggml_type, True)
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16() for m in (1, 2, 3, 4, 9, 12)]
    outputs = {}
    try:
        for into_l2 in (False, True):
            ext.set_fetch_into_l2(into_l2)
            assert ext.fetch_into_l2() is into_l2
            outputs[into_l2] = [
                run(x, w, fmt.ggml_type, None)
                for x in xs
                for run, w in ((ext.linear_blocks, blocks), (ext.linear_blocks_packed, packed))
            ]
    finally:
        ext.set_fetch_into_l2(not amd)
    for got, want in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_exact_on_exactly_representable_inputs(ext):
    # x already on an int8 grid per block and W's codes small: the integer path is exact (the
    # float sums of the blocks' products are not ordered as torch's)
    n, k = 16, 64
    gen = torch.Generator().manual_seed(0)
    blocks = FORMATS["int8"].quantize(torch.randint(-8, 8, (n, k), generator=gen).float())
    x = torch.randint(-127, 128, (3, k), generator=gen).float()
    x[:, ::32] = 127  # each block's scale is exactly 1
    want = x @ FORMATS["int8"].dequantize(blocks, k).T
    assert torch.allclose(ext.linear_blocks(x, blocks, FORMATS["int8"].ggml_type, None), want, rtol=1e-5)


def test_leading_dimensions_and_empty_batches(ext):
    blocks = _blocks("q4_k", 8, 256, seed=0)
    x = torch.randn(2, 3, 256)
    y = ext.linear_blocks(x, blocks, Q4_K.ggml_type, None)
    assert y.shape == (2, 3, 8)
    assert torch.equal(y.reshape(6, 8), ext.linear_blocks(x.reshape(6, 256), blocks, Q4_K.ggml_type, None))
    assert ext.linear_blocks(torch.empty(0, 256), blocks, Q4_K.ggml_type, None).shape == (0, 8)


def test_bad_input_is_a_clear_error(ext):
    blocks = _blocks("q4_k", 8, 256, seed=0)
    with pytest.raises(RuntimeError, match="GGUF type 99 has no AVX2 kernel"):
        ext.linear_blocks(torch.randn(1, 256), blocks, 99, None)
    with pytest.raises(RuntimeError, match="not a multiple of the format's block, 256"):
        ext.linear_blocks(torch.randn(1, 128), blocks[:, :72], Q4_K.ggml_type, None)
    with pytest.raises(RuntimeError, match="blocks of 144 bytes a row, K = 512 needs 288"):
        ext.linear_blocks(torch.randn(1, 512), blocks, Q4_K.ggml_type, None)
    with pytest.raises(RuntimeError, match="bf16 or f32 x"):
        ext.linear_blocks(torch.randn(1, 256, dtype=torch.float64), blocks, Q4_K.ggml_type, None)
    assert not ext.supports_format(99) and all(ext.supports_format(f.ggml_type) for f in FORMATS.values())


def test_ridge_picks_them_on_a_cpu_with_avx2_alone(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f"})
    kernels = cpu_kernels.select_kernels("auto", torch.device("cpu"), torch.float32)
    assert isinstance(kernels, Avx2Kernels)
    assert isinstance(cpu_kernels.select_kernels("ridge", torch.device("cpu"), torch.bfloat16), Avx2Kernels)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx", "sse4_2"})
    assert cpu_kernels.select_kernels("auto", torch.device("cpu"), torch.float32).name == "torch"
    with pytest.raises(ValueError, match="needs a CPU with AVX-512 BF16 or AVX2"):
        cpu_kernels.select_kernels("ridge", torch.device("cpu"), torch.float32)


def _layer(fmt, n: int, k: int, seed: int, bias: bool = False) -> Linear:
    layer = Linear(k, n, bias, BlockQuantLinearMethod(fmt))
    layer.method.load_blocks(layer, random_blocks(fmt, n, k, seed), None)
    if bias:
        layer.bias.data = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return layer


def test_the_kernels_read_a_layers_gguf_bytes_as_loaded(ext):
    """Q6_K keeps the file's bytes; the other formats (AVX2_PACKED_FORMATS, Q8_0 among them)
    the same bytes in blocks of 8 rows. Every way a model reaches a matmul: a plain layer with its
    bias, a layer held per shard in two formats (Q4_K_M's qkv), and one expert's rows of a
    stacked layer."""
    kernels = Avx2Kernels(ext)
    k = 512
    layer = _layer(Q6_K, 48, k, seed=1, bias=True)
    before = layer.blocks.clone()
    layer.method.process_weights_after_loading(layer, kernels)
    assert layer.packed is None and torch.equal(layer.blocks, before)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    want = x @ Q6_K.dequantize(before, k).T + layer.bias
    got = kernels.matmul(x, layer)
    assert torch.allclose(got, want, rtol=0.05, atol=0.02 * want.abs().max().item())
    assert torch.equal(got, ext.linear_blocks(x, before, Q6_K.ggml_type, layer.bias))
    assert torch.equal(
        kernels.matmul(x, layer, slice(16, 32)), ext.linear_blocks(x, before[16:32], Q6_K.ggml_type, None)
    )

    for fmt in (Q8_0, Q4_0, Q4_K, Q5_K, IQ4_XS, Q3_K, Q2_K):  # repacked, 8 rows at a time (expert rows slice)
        layer = _layer(fmt, 48, k, seed=3, bias=True)
        before = layer.blocks.clone()
        layer.method.process_weights_after_loading(layer, kernels)
        assert layer.packed is not None and layer.packed.numel() == before.numel() and layer.blocks.numel() == 0
        assert torch.equal(layer.method.blocks_of(layer), before)
        assert torch.equal(layer.method.dense_rows(layer, slice(5, 29)), fmt.dequantize(before[5:29], k))
        assert torch.equal(kernels.matmul(x, layer), ext.linear_blocks(x, before, fmt.ggml_type, layer.bias))
        assert torch.equal(
            kernels.matmul(x, layer, slice(16, 32)), ext.linear_blocks(x, before[16:32], fmt.ggml_type, None)
        )
        # rows off the blocks of 8: the rows unpacked (torch's matmul of them)
        want = x @ fmt.dequantize(before[4:12], k).T
        assert torch.allclose(kernels.matmul(x, layer, slice(4, 12)), want, rtol=1e-4, atol=1e-4)
        # a layer whose rows are not a multiple of 8 keeps GGUF's layout
        odd = _layer(fmt, 20, k, seed=5)
        odd.method.process_weights_after_loading(odd, kernels)
        assert odd.packed is None and odd.blocks.shape == (20, fmt.row_bytes(k))

    packed = PackedLinear(k, [32, 32, 32], False, ShardedLinearMethod((Q4_K, Q4_K, Q6_K)))
    parts = [random_blocks(f, 32, k, seed=s) for s, f in enumerate((Q4_K, Q4_K, Q6_K))]
    for shard, blocks in enumerate(parts):
        packed.method.load_blocks(packed, blocks, packed.shard_rows(shard))
    got = kernels.matmul(x, packed)
    for shard, (fmt, blocks) in enumerate(zip((Q4_K, Q4_K, Q6_K), parts, strict=True)):
        assert torch.equal(got[:, 32 * shard : 32 * shard + 32], ext.linear_blocks(x, blocks, fmt.ggml_type, None))


def test_weights_read_as_loaded_move_into_2mib_pages_with_their_values(ext):
    """A dense bf16 weight and Q6_K blocks (both read as loaded) are copied into memory that asks
    for 2 MiB pages at load, as the blocks of 8 rows are packed into it; the outputs do not
    change. A weight under 64 KiB stays where it is."""
    kernels = Avx2Kernels(ext)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4096, generator=gen).bfloat16()
    dense = Linear(4096, 1024, False)  # 8 MiB of bf16
    dense.weight.data = torch.randn(1024, 4096, generator=gen).bfloat16()
    q6 = _layer(Q6_K, 1024, 4096, seed=1)  # 6.6 MiB
    q4 = _layer(Q4_K, 1024, 4096, seed=2)  # packed
    small = Linear(512, 16, False)
    small.weight.data = torch.randn(16, 512, generator=gen).bfloat16()
    before = {
        "dense": (dense.weight.detach().clone(), dense.weight.data_ptr(), ext.linear_bf16(x, dense.weight, None)),
        "q6": (q6.blocks.clone(), q6.blocks.data_ptr(), ext.linear_blocks(x, q6.blocks, Q6_K.ggml_type, None)),
    }
    small_ptr = small.weight.data_ptr()
    for layer in (dense, q6, q4, small):
        layer.method.process_weights_after_loading(layer, kernels)
    for name, held in (("dense", dense.weight), ("q6", q6.blocks)):
        values, ptr, y = before[name]
        assert held.data_ptr() != ptr and held.is_contiguous() and torch.equal(held, values)
        assert torch.equal(kernels.matmul(x, dense if name == "dense" else q6), y)
    assert small.weight.data_ptr() == small_ptr
    if thp_mode() != "never":
        for held in (dense.weight, q6.blocks, q4.packed):
            assert asks_for_huge_pages(held)
    if thp_mode() == "madvise":  # torch's allocation does not ask
        assert not asks_for_huge_pages(before["dense"][0])


_FREED_SLAB = """
import ctypes, json
import torch
from ridge.layers.cpu_kernels import load_avx2_extension
from tests.layers.cpu_cases import asks_for_huge_pages

ext = load_avx2_extension()
ctypes.CDLL(None).mallopt(-3, 512 << 20)  # M_MMAP_THRESHOLD: malloc's heap serves all of it
weight = ext.huge_page_copy(torch.ones(1 << 20, dtype=torch.uint8))  # a new 64 MiB slab
guard = torch.ones(1 << 20, dtype=torch.uint8)  # above it, so the freed slab is not trimmed
slab_asks = asks_for_huge_pages(weight)
del weight  # the slab goes with its last weight
after = [torch.empty(8 << 20, dtype=torch.uint8) for _ in range(12)]  # where the slab was
print(json.dumps([slab_asks, [asks_for_huge_pages(t) for t in after]]))
"""


@pytest.mark.skipif(thp_mode() != "madvise", reason="where only memory that asks takes huge pages")
def test_a_freed_slab_leaves_no_memory_asking_for_huge_pages():
    """The weights' slabs are mapped from the system and unmapped when freed. Carved from
    malloc's heap (a large aligned request was, where enough freed memory lay there), a freed
    slab's pages kept asking for 2 MiB pages, and torch's next tensors there took them. In a
    process of its own: malloc's heap is made to serve every request."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", _FREED_SLAB], cwd=root, capture_output=True, text=True, timeout=300, check=True
    )
    slab_asks, after = json.loads(run.stdout.strip().splitlines()[-1])
    assert slab_asks and after and not any(after)
