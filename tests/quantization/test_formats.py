"""ridge's block formats against llama.cpp's own Python reference (``gguf.quants``): the same
bytes (they are the on-disk GGUF block bytes), the same dequantized values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ridge.quantization.formats import FORMATS, QUANTIZATION_FORMATS, get_format
from ridge.quantization.random_blocks import random_blocks

gguf = pytest.importorskip("gguf")
quants = pytest.importorskip("gguf.quants")
# the formats gguf.quants quantizes too (bit for bit); Q4_K and Q6_K are tested on their own below
PER_32 = [name for name in QUANTIZATION_FORMATS if FORMATS[name].block == 32]


def _weights(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=gen) * 0.05
    w[0, :32] = 0  # an all-zero block: scale 0
    if rows > 2:
        w[1, 3] = 5.0  # an outlier
        w[2, 5], w[2, 6] = -5.0, 5.0  # equal magnitudes, opposite signs: Q4_0 takes the first
    return w


@pytest.mark.parametrize("name", PER_32)
@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (33, 256)])
def test_quantize_is_bit_exact_with_gguf(name, shape):
    fmt = FORMATS[name]
    w = _weights(*shape, seed=shape[0])
    ref = quants.quantize(w.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    got = fmt.quantize(w)
    assert got.dtype == torch.uint8 and tuple(got.shape) == ref.shape == (shape[0], fmt.row_bytes(shape[1]))
    assert np.array_equal(got.numpy(), ref)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_is_bit_exact_with_gguf(name):
    fmt = FORMATS[name]
    blocks = fmt.quantize(_weights(9, 256, seed=3)) if fmt.quantizable else random_blocks(fmt, 9, 256, seed=3)
    ref = quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    assert np.array_equal(fmt.dequantize(blocks, 256).numpy(), ref)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(PER_32),
    values=st.lists(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), min_size=64, max_size=64),
)
def test_any_values_quantize_as_gguf_does(name, values):
    fmt = FORMATS[name]
    w = torch.tensor(values, dtype=torch.float32).reshape(2, 32)
    ref = quants.quantize(w.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    assert np.array_equal(fmt.quantize(w).numpy(), ref)


def test_sizes_are_llama_cpps():
    assert {n: (f.type_size, f.bits_per_weight) for n, f in FORMATS.items()} == {
        "int8": (34, 8.5),
        "int4": (18, 4.5),
        "int4_asym": (20, 5.0),
        "iq4_nl": (18, 4.5),
        "q4_k": (144, 4.5),
        "iq4_xs": (136, 4.25),
        "q5_k": (176, 5.5),
        "q6_k": (210, 6.5625),
        "q3_k": (110, 3.4375),
        "q2_k": (84, 2.625),
    }
    for fmt in FORMATS.values():
        assert quants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt.ggml_type)] == (fmt.block, fmt.type_size)


def test_names_and_errors():
    assert get_format("Q8_0").name == "int8" and get_format("q4_1").name == "int4_asym"
    with pytest.raises(ValueError, match="unknown quantization 'int3'; choose one of int8, int4"):
        get_format("int3")
    with pytest.raises(ValueError, match="K a multiple of 32"):
        FORMATS["int8"].quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="unknown quantization 'iq4_nl'"):  # read from files, never produced
        get_format("iq4_nl")
    with pytest.raises(ValueError, match="IQ4_NL is read from GGUF files only"):
        FORMATS["iq4_nl"].quantize(torch.zeros(4, 32))


def test_k_quant_quantizers_search_scales_as_llama_cpp_does():
    """Q4_K and Q6_K at load (llama.cpp's reference quantizers): the bytes decode to valid
    super-blocks, the error is below what the per-32 formats of as many bits reach, and a
    weight that already is a Q4_K / Q6_K tensor comes back (almost) as it was."""
    torch.manual_seed(0)
    w = torch.randn(64, 512) * torch.rand(64, 1)  # rows of different magnitude
    w[3] = 0.0  # an all-zero row: zero blocks, no NaN
    errors = {}
    for name in ("int4_asym", "q4_k", "q6_k", "int8"):
        fmt = FORMATS[name]
        blocks = fmt.quantize(w)
        assert blocks.shape == (64, fmt.row_bytes(512)) and blocks.dtype == torch.uint8
        back = fmt.dequantize(blocks, 512)
        assert torch.isfinite(back).all() and (back[3] == 0).all()
        errors[name] = (back - w).square().mean().sqrt().item()
    # 4.5 bits with searched scales beat Q4_1's 5 bits with min/max; 6.56 bits land between
    assert errors["q4_k"] < errors["int4_asym"]
    assert errors["int8"] < errors["q6_k"] < errors["q4_k"] / 3
    for name in ("q4_k", "q6_k"):
        fmt = FORMATS[name]
        once = fmt.dequantize(fmt.quantize(w), 512)
        twice = fmt.dequantize(fmt.quantize(once), 512)
        assert (twice - once).abs().max().item() <= 0.02 * once.abs().max().item()


def test_k_quants_need_k_in_256s():
    with pytest.raises(ValueError, match="Q4_K needs K a multiple of 256"):
        FORMATS["q4_k"].quantize(torch.randn(4, 96))
