"""The ops a step is made of, behind one object the model receives at load time.

``TorchKernels`` is the reference: plain torch, any dtype and device (the parity tests run
it in float32 against Hugging Face). ``CpuKernels`` runs the same arithmetic with
ridge's AVX-512 extension on CPU: in bfloat16 the streaming GEMM for decode and fused
small ops (norms, RoPE, SiLU-gating), rounding where the torch path rounds; in bfloat16 and
float32 the paged decode attention, read from the pool without a gathered copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridge.layers.attention import AttentionMetadata, decode_valid_mask, gather_context
from ridge.layers.linear import Linear, dense_linear
from ridge.layers.rotary import RotaryEmbedding, rotate_half


class TorchKernels:
    name = "torch"

    def matmul(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        return dense_linear(x, layer)

    def prepare(self, model: torch.nn.Module) -> None:
        """Called once with the loaded model (weights may be repacked here)."""

    def rope_state(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
        """Per-step RoPE inputs, shared by every layer: the gathered (cos, sin) rows."""
        return rotary(positions, dtype)

    def rope(self, x: torch.Tensor, state) -> torch.Tensor:
        """x: (T, H, D) -> rotated (may be x itself, rotated in place)."""
        cos, sin = state
        return x * cos + rotate_half(x) * sin

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place); return rms_norm(residual)."""
        residual.add_(x)
        return F.rms_norm(residual, weight.shape, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def decode_attention(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q: (D, Hq, Dh), one query per sequence over its paged context -> (D, Hq, Dh)."""
        num_seqs, num_heads, head_dim = q.shape
        keys = gather_context(k_cache, meta.decode_block_tables)  # (D, L, Hkv, Dh)
        values = gather_context(v_cache, meta.decode_block_tables)
        num_kv_heads = keys.shape[2]
        # GQA without copying K/V: the G query heads of a group share one K/V head.
        #   q (D, Hkv, G, Dh) @ K^T (D, Hkv, Dh, L) -> scores (D, Hkv, G, L)
        qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * head_dim**-0.5
        if meta.decode_mask is None:  # built by the first layer, shared by the rest of the step
            meta.decode_mask = decode_valid_mask(meta.decode_context_lens, keys.shape[1])
        scores.masked_fill_(~meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        # Slots past a context were never written (the pool is not zero-filled): a weight of 0
        # times a stale NaN would still be NaN, so the gathered copy is zeroed there.
        values.masked_fill_(~meta.decode_mask.view(num_seqs, -1, 1, 1), 0)
        out = torch.matmul(probs, values.transpose(1, 2))  # (D, Hkv, G, Dh)
        return out.reshape(num_seqs, num_heads, head_dim)


class CpuKernels(TorchKernels):
    """ridge's extension on AVX-512 BF16 CPUs: bf16 throughout, float32 decode attention;
    anything else falls back to torch."""

    name = "ridge-cpu"

    def __init__(self, ext) -> None:
        self.ext = ext

    def matmul(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        if layer.packed is None or x.dtype is not torch.bfloat16:
            return dense_linear(x, layer)
        return self.ext.linear_bf16(x, layer.packed, layer.out_features, layer.bias)

    def prepare(self, model: torch.nn.Module) -> None:
        """Repack every bf16 CPU linear weight into the kernel's blocks and free the dense copy,
        unless another module shares it (a tied lm_head keeps the embedding's)."""
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        owners: dict[int, int] = {}
        for module in model.modules():
            for param in module.parameters(recurse=False):
                owners[param.data_ptr()] = owners.get(param.data_ptr(), 0) + 1
        for layer in linears:
            weight = layer.weight
            if weight.dtype is not torch.bfloat16 or weight.device.type != "cpu" or weight.numel() == 0:
                continue
            layer.packed = self.ext.pack_vnni(weight.detach())
            layer.unpack = self.ext.unpack_vnni
            if owners[weight.data_ptr()] == 1:
                layer.weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def rope_state(self, rotary, positions, dtype):
        return positions, rotary.cos, rotary.sin

    def rope(self, x, state):
        positions, cos, sin = state
        if x.dtype is not torch.bfloat16 or x.stride(-1) != 1 or x.stride(1) != x.shape[2]:
            return super().rope(x, (cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)))
        self.ext.rope_bf16_(x, positions, cos, sin)
        return x

    def rms_norm(self, x, weight, eps):
        if x.dtype is not torch.bfloat16:
            return super().rms_norm(x, weight, eps)
        return self.ext.rms_norm_bf16(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.dtype is not torch.bfloat16 or not residual.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        return self.ext.add_rms_norm_bf16(x, residual, weight, eps)

    def silu_mul(self, gate_up):
        if gate_up.dtype is not torch.bfloat16:
            return super().silu_mul(gate_up)
        return self.ext.silu_mul_bf16(gate_up)

    def decode_attention(self, q, k_cache, v_cache, meta):
        head_dim = q.shape[-1]
        args = (q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, head_dim**-0.5)
        if q.dtype is torch.bfloat16 and head_dim % 16 == 0 and head_dim <= 256 and k_cache.numel() < 2**32:
            return self.ext.paged_decode_attention_bf16(*args)  # AVX-512, 16 lanes of a head at a time
        if q.dtype in (torch.bfloat16, torch.float32):
            return self.ext.paged_decode_attention(*args)
        return super().decode_attention(q, k_cache, v_cache, meta)
