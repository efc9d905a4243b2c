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
from ridge.layers.linear import ExpertLinear, Linear, PackedLinear
from ridge.layers.mla import mla_attention
from ridge.layers.norm import RMSNorm
from ridge.layers.rotary import yarn_mscale
from ridge.models.llama import LlamaForCausalLM, StepInputs, rows_of
from ridge.quantization.config import QuantizationConfig
from ridge.quantization.formats import Q8_0
from ridge.quantization.methods import PACKED_ROW_BLOCK, BlockQuantLinearMethod

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
        # The absorbed decode's per-head matrices as a deepseek2 file holds them (attn_k_b:
        # W_uk^T, r x nope per head; attn_v_b: W_uv, v x r), in the file's own blocks; a rank
        # holds its heads' matrices
        self.k_b_proj = self.v_b_proj = None
        if f"{prefix}.k_b_proj" in quant.file_formats:
            nope, rank, v = mla.qk_nope_head_dim, mla.kv_lora_rank, mla.v_head_dim
            self.k_b_proj = _head_stack(f"{prefix}.k_b_proj", nope, rank, heads, cfg.num_heads, quant, split)
            self.v_b_proj = _head_stack(f"{prefix}.v_b_proj", rank, v, heads, cfg.num_heads, quant, split)
        self.scale = mla_softmax_scale(cfg)
        # (W_uk^T, W_uv) as head_matmul takes them, for the kernels that absorb() ran with
        self.absorbed: tuple[torch.Tensor | ExpertLinear, torch.Tensor | ExpertLinear] | None = None
        self.absorb_decode = True  # False: decode expanded too (benchmarks/mla_decode.py compares)

    def prefill_only(self) -> tuple[Linear, ...]:
        """With the file's per-head matrices, decode never reads kv_b_proj (the same
        parameters, joined dense for prefill): the weight pricing counts them once, as decode
        reads them."""
        return (self.kv_b_proj,) if self.k_b_proj is not None else ()

    def absorb(self, ops) -> None:
        """The absorbed decode's per-head matrices, W_uk^T (r x nope a head: q_nope into the
        latent space) and W_uv (v x r: the attended latent out to the head's values), each as
        ``head_matmul`` takes it: a stacked per-head layer in a block format that ``ops``
        packed, or dense (H, K, N) in the model's dtype.

        - A deepseek2 file's attn_k_b and attn_v_b (k_b_proj, v_b_proj): the file's blocks.
        - kv_b_proj in a block format: W_uv is its own rows' blocks (the same bytes). W_uk^T
          runs along nope where kv_b_proj's blocks run along r, so it is requantized to int8
          (Q8_0) from kv_b_proj's values, adding at most 1/254 of each block's largest value.
        - Otherwise (or where ``ops`` does not pack blocks): dense, from kv_b_proj's values, in
          the form ``ops.absorbed_heads`` gives (the AVX2 kernels: bf16 rows a head).
        """
        mla, heads = self.mla, self.num_heads
        nope, v, rank = mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank
        dtype = self.kv_a_layernorm.weight.dtype  # the model's (a packed or quantized weight unpacks to float32)
        device = self.kv_a_layernorm.weight.device
        kv_b = self.kv_b_proj
        if self.k_b_proj is not None:
            self.absorbed = (
                _per_head(self.k_b_proj, heads, dtype, ops, device),
                _per_head(self.v_b_proj, heads, dtype, ops, device),
            )
            return
        fmt = kv_b.method.format
        if fmt is not None and kv_b.packed is not None and nope % PACKED_ROW_BLOCK == 0 and v % PACKED_ROW_BLOCK == 0:
            blocks = kv_b.method.blocks_of(kv_b).view(heads, nope + v, -1)
            w_uv = ExpertLinear(heads, rank, [v], method=BlockQuantLinearMethod(fmt))
            w_uv.method.load_blocks(w_uv, blocks[:, nope:].reshape(heads * v, -1), None)
            w_uv.method.process_weights_after_loading(w_uv, ops)
            w_uk = kv_b.dense_weight().float().view(heads, nope + v, rank)[:, :nope]  # (H, nope, r)
            if nope % Q8_0.block == 0:
                k_b = ExpertLinear(heads, nope, [rank], method=BlockQuantLinearMethod(Q8_0))
                k_b.method.load_weight(k_b, w_uk.transpose(1, 2).reshape(heads * rank, nope), None)
                k_b.method.process_weights_after_loading(k_b, ops)
                w_uk = k_b
            self.absorbed = (_per_head(w_uk, heads, dtype, ops, device), _per_head(w_uv, heads, dtype, ops, device))
            return
        w = kv_b.dense_weight().to(device=device, dtype=dtype).view(heads, nope + v, -1)
        self.absorbed = (
            ops.absorbed_heads(w[:, :nope].contiguous()),
            ops.absorbed_heads(w[:, nope:].transpose(1, 2).contiguous()),
        )

    def add_to_plan(self, plan, norm, post_norm, cache: PagedKV, ops) -> bool:
        """This layer into the kernels' decode plan (``csrc/decode_layers.cpp``, or the AVX2
        kernels' ``csrc/avx2_plan.cpp``), absorbed as forward() decodes, through the same
        kernels: False where forward() would take another path (fewer than 16 heads, widths the
        shared-KV kernels and head_matmul do not take, a cache they do not read)."""
        mla = self.mla
        if self.absorbed is None:
            self.absorb(ops)
        w_uk, w_uv_t = ops.plan_heads(self.absorbed[0]), ops.plan_heads(self.absorbed[1])
        k = cache.k
        one_vector = k.dim() == 4 and k.shape[2] == 1 and k.is_contiguous() and cache.v.data_ptr() == k.data_ptr()
        widths = mla.kv_lora_rank % 16 == 0 and mla.v_head_dim % 16 == 0 and w_uk is not None and w_uv_t is not None
        if not one_vector or not widths or self.num_heads < SHARED_KV_MIN_HEADS:
            return False
        if cache.quantized and mla.cache_dim % 16 or not cache.quantized and k.dtype is not torch.bfloat16:
            return False
        if not ops.plan_takes_latent_cache(cache):
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
            self.absorb(ops)
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


def _head_stack(name: str, k: int, n: int, heads: Shard, num_heads: int, quant, split: bool) -> ExpertLinear:
    """Per-head matrices of n rows over k, stacked (H n, k) as a file holds them: this rank's
    heads, a contiguous run of the file's rows, under tensor parallelism."""
    layer = ExpertLinear(heads.length, k, [n], method=quant.method_for(name, k))
    if split:
        layer.tp_rows, layer.full = [rows_of(heads, n)], ([num_heads * n], k)
    return layer


def _per_head(
    w: torch.Tensor | ExpertLinear, heads: int, dtype: torch.dtype, ops, device: torch.device
) -> torch.Tensor | ExpertLinear:
    """Per-head matrices as head_matmul takes them: a stacked layer (H matrices of N rows
    over K) in a block format as it is where ``ops`` runs it in one call (``plan_heads``),
    else dense (H, K, N) in ``dtype`` on the model's ``device`` (from the layer's values, which
    a block format dequantizes on the host, or ``w`` already (H, K, N)), in the form ``ops``
    runs dense heads in (``absorbed_heads``)."""
    if isinstance(w, torch.Tensor):
        return ops.absorbed_heads(w.to(device=device, dtype=dtype).contiguous())
    if w.method.format is not None and ops.plan_heads(w) is not None:
        return w
    dense = w.dense_weight().to(device=device, dtype=dtype)
    return ops.absorbed_heads(dense.view(heads, w.rows_per_expert, w.in_features).transpose(1, 2).contiguous())


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (the differences are in ModelConfig)."""

    packed_modules = PACKED_MODULES
    attention_cls = DeepseekAttention
    # a deepseek2 file's per-head copies of kv_b_proj's rows (attn_k_b, attn_v_b), which Hugging
    # Face checkpoints do not hold: hf_state_dict leaves them out (kv_b_proj holds the same values)
    file_copies = ("k_b_proj", "v_b_proj")

    def __init__(self, cfg: ModelConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        # q's a-projection is q_a_proj (with q_lora_rank) or q_proj, never both: the map back to
        # checkpoint names (export.hf_state_dict) names the one this model has
        other = "q_proj" if cfg.mla.q_lora_rank else "q_a_proj"
        self.packed_modules = {name: where for name, where in PACKED_MODULES.items() if name != other}

    def decode_plan(self, kv_caches, dtype):
        """The plan decodes absorbed: none while a layer decodes expanded (``absorb_decode``
        False, which benchmarks/mla_decode.py sets to compare)."""
        if not all(layer.self_attn.absorb_decode for layer in self.model.layers):
            return None
        return super().decode_plan(kv_caches, dtype)

    def set_kernels(self, kernels) -> None:
        """As the Llama models', and each attention's absorbed matrices are made again for the
        new kernels (a block format only where these kernels packed it)."""
        super().set_kernels(kernels)
        for layer in self.model.layers:
            layer.self_attn.absorbed = None

    def kv_cache_spec(self) -> KVCacheSpec:
        """One latent + rotary key per token and layer, shared by all heads."""
        return KVCacheSpec(self.config.num_layers, 1, self.config.mla.cache_dim, keys_only=True)
