"""The Llama family (Llama 2/3, TinyLlama, Mistral, Qwen2, Qwen3) as one module.

The differences are flags on ``ModelConfig``: q/k/v bias (Qwen2), q/k RMSNorm (Qwen3),
tied embeddings, GQA, RoPE scaling. Parameter names follow Hugging Face checkpoints except
for the packed projections, declared below as data for the loader.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.layers.attention import AttentionMetadata, paged_attention
from ridge.layers.linear import Linear, PackedLinear
from ridge.layers.norm import RMSNorm
from ridge.layers.rotary import RotaryEmbedding

# checkpoint module name -> (packed module name, shard index)
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary  # shared by all layers; not a submodule, so it is not saved or loaded

    def forward(self, positions, x, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = PackedLinear(cfg.hidden_size, [inter, inter], bias=cfg.mlp_bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions, h, kv_cache, meta):
        h = h + self.self_attn(positions, self.input_layernorm(h), kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(): hidden states of the step's flat tokens; compute_logits(): only where we sample."""

    packed_modules = PACKED_MODULES

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(positions, h, kv_cache, meta)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (R, hidden_size) rows that sample -> (R, vocab) logits."""
        return self.lm_head(self.model.norm(hidden))
