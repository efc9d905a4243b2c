"""DeepSeek-V2 and V3: the Llama-family decoder with multi-head latent attention (MLA,
``layers/mla.py``) and a mixture-of-experts feed-forward after the first
``first_k_dense_replace`` dense layers (``models/moe.py``: softmax or sigmoid router, grouped
top-k, shared experts, routed scaling).

The KV cache holds one latent per token and layer (``kv_cache_spec``); decode reads only the
latents (absorbed form), prefill expands them.

Packing, declared as data for the loader: x's two projections (q, or q's low-rank
a-projection, and the latent + rotary key) are one matmul.

    fused_qkv_a_proj rows: [ q_a_proj (q_lora_rank) or q_proj (H (nope + p)) | kv_a_proj_with_mqa (r + p) ]
"""

from __future__ import annotations

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.distributed.parallel import Shard, TensorParallel
from ridge.kv.cache import KVCacheSpec, PagedKV
from ridge.layers.attention import AttentionMetadata
from ridge.layers.kernels import SHARED_KV_MIN_HEADS
from ridge.layers.linear import Linear, PackedLinear
from ridge.layers.mla import mla_attention
from ridge.layers.norm import RMSNorm
from ridge.layers.rotary import yarn_mscale
from ridge.models.llama import LlamaForCausalLM, StepInputs, rows_of
from ridge.quantization.config import QuantizationConfig

PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_a_proj": ("fused_qkv_a_proj", 0),
    "q_proj": ("fused_qkv_a_proj", 0),
    "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: DeepSeek's default, not rms_norm_eps


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) squared when set."""
    scale = cfg.mla.qk_head_dim**-0.5
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


class DeepseekAttention(nn.Module):
    """Under tensor parallelism a rank holds its heads: q (q_b_proj, or q_proj's rows) and
    kv_b_proj column-parallel, o row-parallel; the latent projection and the latent cache
    are replicated (every head reads the same latent)."""

    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig, prefix: str, tp: TensorParallel) -> None:
        super().__init__()
        mla, d = cfg.mla, cfg.hidden_size
        heads = tp.split(cfg.num_heads, "the attention heads")
        self.mla, self.num_heads = mla, heads.length
        split = tp.enabled
        full_q = cfg.num_heads * mla.qk_head_dim
        q_rows = rows_of(heads, mla.qk_head_dim)
        q_width = mla.q_lora_rank or q_rows.length
        a_rows = [Shard(0, mla.q_lora_rank) if mla.q_lora_rank else q_rows, Shard(0, mla.cache_dim)]
        self.fused_qkv_a_proj = PackedLinear(
            d,
            [q_width, mla.cache_dim],
            bias=False,
            method=quant.method_for(f"{prefix}.fused_qkv_a_proj", d),
            tp_rows=a_rows if split else None,
            full=([mla.q_lora_rank or full_q, mla.cache_dim], d) if split else None,
        )
        if mla.q_lora_rank:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(
                mla.q_lora_rank,
                q_rows.length,
                bias=False,
                method=quant.method_for(f"{prefix}.q_b_proj", mla.q_lora_rank),
                tp_rows=[q_rows] if split else None,
                full=([full_q], mla.q_lora_rank) if split else None,
            )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        kv_width = mla.qk_nope_head_dim + mla.v_head_dim
        self.kv_b_proj = Linear(
            mla.kv_lora_rank,
            heads.length * kv_width,
            bias=False,
            method=quant.method_for(f"{prefix}.kv_b_proj", mla.kv_lora_rank),
            tp_rows=[rows_of(heads, kv_width)] if split else None,
            full=([cfg.num_heads * kv_width], mla.kv_lora_rank) if split else None,
        )
        o_cols = rows_of(heads, mla.v_head_dim)
        self.o_proj = Linear(
            o_cols.length,
            d,
            bias=False,
            method=quant.method_for(f"{prefix}.o_proj", o_cols.length),
            tp_cols=o_cols if split else None,
            full=([d], cfg.num_heads * mla.v_head_dim) if split else None,
        )
        self.scale = mla_softmax_scale(cfg)
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the first forward (absorb())
        self.absorb_decode = True  # False: decode expanded too (benchmarks/mla_decode.py compares)

    def absorb(self) -> None:
        """kv_b_proj's weight split per head for the absorbed decode: W_uk (H, nope, r) and
        W_uv^T (H, r, v), dense in the model's dtype (whatever format kv_b_proj holds), each
        the (K, N) operand of a per-head matmul (``head_matmul``)."""
        mla = self.mla
        dtype = self.kv_a_layernorm.weight.dtype  # the model's (a packed or quantized weight unpacks to float32)
        w = self.kv_b_proj.dense_weight().to(dtype).view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
        nope = mla.qk_nope_head_dim
        self.absorbed = (w[:, :nope].contiguous(), w[:, nope:].transpose(1, 2).contiguous())

    def add_to_plan(self, plan, norm, post_norm, cache: PagedKV, ops) -> bool:
        """This layer into the kernels' decode plan (``csrc/decode_layers.cpp``), absorbed as
        forward() decodes, through the same kernels: False where forward() would take another
        path (fewer than 16 heads, widths the shared-KV kernels and head_matmul do not take, a
        cache they do not read)."""
        mla = self.mla
        if self.absorbed is None:
            self.absorb()
        w_uk, w_uv_t = self.absorbed
        k = cache.k
        one_vector = k.dim() == 4 and k.shape[2] == 1 and k.is_contiguous() and cache.v.data_ptr() == k.data_ptr()
        widths = mla.kv_lora_rank % 16 == 0 and mla.v_head_dim % 16 == 0 and w_uk.dtype is torch.bfloat16
        if not one_vector or not widths or self.num_heads < SHARED_KV_MIN_HEADS:
            return False
        if cache.quantized and mla.cache_dim % 16 or not cache.quantized and k.dtype is not torch.bfloat16:
            return False
        qkv_a, o = ops.plan_linear(self.fused_qkv_a_proj), ops.plan_linear(self.o_proj)
        q_b = ops.plan_linear(self.q_b_proj) if mla.q_lora_rank else ([], None)
        if qkv_a is None or o is None or q_b is None or any(p[1] is not None for p in (qkv_a, o, q_b)):
            return False
        q_norm = self.q_a_layernorm if mla.q_lora_rank else None
        if q_norm is not None and q_norm.eps != self.kv_a_layernorm.eps:
            return False
        plan.add_mla_layer(
            norm.weight,
            post_norm.weight,
            norm.eps,
            qkv_a[0],
            self.fused_qkv_a_proj.output_sizes[0],
            None if q_norm is None else q_norm.weight,
            q_b[0],
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps,
            o[0],
            self.num_heads,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.kv_lora_rank,
            mla.rope_interleave,
            w_uk,
            w_uv_t,
            self.scale,
            k,
            cache.k_scale,
            cache.kind == "fp8",
        )
        return True

    def forward(self, x, kv_cache: PagedKV, meta: AttentionMetadata, step: StepInputs):
        ops, mla = step.kernels, self.mla
        tokens, rope = x.shape[0], mla.qk_rope_head_dim
        q, kv_a = ops.matmul(x, self.fused_qkv_a_proj).split(self.fused_qkv_a_proj.output_sizes, dim=-1)
        if self.absorbed is None:
            self.absorb()
        if mla.q_lora_rank:
            q = ops.rms_norm(q.contiguous(), self.q_a_layernorm.weight, self.q_a_layernorm.eps)
            q = ops.matmul(q, self.q_b_proj)
        q = q.reshape(tokens, self.num_heads, mla.qk_head_dim)
        latent = kv_a[:, : mla.kv_lora_rank].contiguous()
        latent = ops.rms_norm(latent, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
        # q's rotary part of every head and the shared rotary key, rotated in one call
        qk_rope = torch.cat((q[..., mla.qk_nope_head_dim :], kv_a[:, None, mla.kv_lora_rank :]), dim=1)
        if mla.rope_interleave:
            # pairs (x0, x1), (x2, x3) .. -> halves [x0 x2 .. | x1 x3 ..]: rotate-half then turns
            # each pair by its frequency. q and k move alike, so their dot products do not change.
            qk_rope = qk_rope.unflatten(-1, (rope // 2, 2)).transpose(-1, -2).flatten(-2).contiguous()
        qk_rope = ops.rope(qk_rope, step.rope)
        entry = torch.cat((latent, qk_rope[:, -1]), dim=-1).unsqueeze(1)  # (T, 1, r + p): what the cache keeps
        out = mla_attention(
            q[..., : mla.qk_nope_head_dim],
            qk_rope[:, :-1],
            entry,
            kv_cache,
            meta,
            self.absorbed,
            self.kv_b_proj,
            self.scale,
            ops,
            self.absorb_decode,
        )
        return ops.matmul(out.flatten(1), self.o_proj)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (the differences are in ModelConfig)."""

    packed_modules = PACKED_MODULES
    attention_cls = DeepseekAttention

    def decode_plan(self, kv_caches, dtype):
        """The plan decodes absorbed: none while a layer decodes expanded (``absorb_decode``
        False, which benchmarks/mla_decode.py sets to compare)."""
        if not all(layer.self_attn.absorb_decode for layer in self.model.layers):
            return None
        return super().decode_plan(kv_caches, dtype)

    def kv_cache_spec(self) -> KVCacheSpec:
        """One latent + rotary key per token and layer, shared by all heads."""
        return KVCacheSpec(self.config.num_layers, 1, self.config.mla.cache_dim, keys_only=True)
