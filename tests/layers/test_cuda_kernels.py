"""``CudaKernels`` (layers/cuda_kernels.py): which ops take the Triton kernels, and what a
kernel that fails to compile on the GPU leaves behind."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, in its interpreter (tests/conftest.py sets it)

from triton.runtime.errors import OutOfResources

from ridge.layers.cuda_kernels import CudaKernels
from ridge.layers.kernels import TorchKernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter needs CPU tensors


def test_a_kernel_that_fails_to_compile_warns_once_and_is_not_tried_again():
    kernels = CudaKernels(torch.device("cpu"))
    calls = []

    def broken(*args):
        calls.append(args)
        raise OutOfResources(300000, 232448, "shared memory")

    with pytest.warns(UserWarning, match="block_matmul failed on this GPU"):
        assert kernels._guarded("block_matmul", broken, 1) is None
    assert kernels._guarded("block_matmul", broken, 2) is None  # the reference from now on
    assert len(calls) == 1
    assert kernels._guarded("other", lambda x: x + 1, 1) == 2


def test_a_graphs_rope_that_fails_to_compile_falls_back_to_torchs(monkeypatch):
    from ridge.layers import triton_kernels as tk
    from ridge.layers.rotary import RotaryEmbedding

    def broken(*args):
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(tk, "rope_", broken)
    kernels = CudaKernels(torch.device("cpu"))
    kernels.graph_mode = True
    rotary = RotaryEmbedding(16, 32, 10000.0, None)
    positions = torch.tensor([3, 7])
    x = torch.randn(2, 3, 16)
    want = TorchKernels().rope(x.clone(), rotary(positions, x.dtype))
    with pytest.warns(UserWarning, match="rope failed on this GPU"):
        got = kernels.rope(x, kernels.rope_state(rotary, positions, x.dtype))
    assert torch.allclose(got, want, atol=1e-6)


def test_small_ops_are_fused_only_inside_a_graphs_forward():
    kernels = CudaKernels(DEVICE)
    gate_up = torch.randn(3, 8, device=DEVICE)
    reference = torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:]
    assert torch.equal(kernels.silu_mul(gate_up), reference)  # eager: torch's ops, bit for bit
    kernels.graph_mode = True
    fused = kernels.silu_mul(gate_up)
    assert torch.allclose(fused, reference, atol=1e-6)
