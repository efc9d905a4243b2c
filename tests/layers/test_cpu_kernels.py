"""ridge's AVX-512 BF16 linear kernel against an fp32 reference (skipped without AVX-512 BF16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ridge.layers.cpu_kernels import MAX_KERNEL_ROWS, CpuLinear, build_linear_bf16, cpu_has_avx512_bf16, select_matmul

pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16")


@pytest.fixture(scope="module")
def kernel():
    return build_linear_bf16()  # compiled once per machine, then cached on disk


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 64])
@pytest.mark.parametrize("k,n", [(64, 112), (100, 37), (2048, 96), (31, 8)])
def test_matches_fp32_reference_within_one_bf16_rounding(kernel, m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    for bias in (b, None):
        got = kernel.linear_bf16(x, w, bias)
        want = ref if bias is not None else F.linear(x.float(), w.float())
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # one rounding of the fp32 sum to bf16: relative error <= 2^-8
        assert torch.allclose(got.float(), want, rtol=2**-8, atol=1e-3 * want.abs().max().item())


def test_keeps_leading_dimensions(kernel):
    x = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    assert kernel.linear_bf16(x, w, None).shape == (2, 3, 16)


def test_dispatch_uses_f_linear_for_large_m_and_other_dtypes(kernel):
    fn = CpuLinear(kernel)
    w = torch.randn(8, 32).bfloat16()
    big = torch.randn(MAX_KERNEL_ROWS + 1, 32).bfloat16()
    assert torch.equal(fn(big, w, None), F.linear(big, w))
    x32 = torch.randn(2, 32)
    assert torch.equal(fn(x32, w.float(), None), F.linear(x32, w.float()))


def test_select_matmul_choices():
    cpu = torch.device("cpu")
    assert select_matmul("torch", cpu, torch.bfloat16) is F.linear
    assert select_matmul("auto", cpu, torch.float32) is F.linear
    assert isinstance(select_matmul("auto", cpu, torch.bfloat16), CpuLinear)
