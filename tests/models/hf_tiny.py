"""Tiny random Hugging Face models of each supported architecture, saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(
    vocab_size=300,  # >= 259, so the byte tokenizer can drive them
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)

VARIANTS = {
    "llama-gqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=False)),
    # one KV head: fewer than the ranks of tensor parallelism, so each rank keeps a copy
    "llama-mqa": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=False, num_key_value_heads=1),
    ),
    "llama-tied-llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=4,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None, head_dim=16)),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3-qknorm": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=16, tie_word_embeddings=False),
    ),
    # mixture-of-experts: softmax routers, top-k renormalized or not, a shared expert, dense layers mixed in
    "mixtral-moe": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, tie_word_embeddings=False),
    ),
    "qwen2-moe-shared": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-moe-dense-mixed": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            head_dim=16,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-moe-top1-raw": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            norm_topk_prob=False,  # top-1 weighted by its raw softmax probability
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
    # DeepSeek: latent attention (with and without q_lora_rank), grouped routers, shared experts, dense first layers
    "deepseek-v2-lite": (
        transformers.DeepseekV2Config,
        transformers.DeepseekV2ForCausalLM,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            tie_word_embeddings=False,
        ),
    ),
    "deepseek-v3-yarn": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            tie_word_embeddings=False,
        ),
    ),
}


def build(variant: str, directory: Path, seed: int = 0):
    """Save a random model of ``variant`` in ``directory``; return the HF model (float32, eval)."""
    config_cls, model_cls, extra = VARIANTS[variant]
    return save_spread(model_cls, config_cls(**{**COMMON, **extra}), directory, seed, jitter_norms=True)


def save_spread(model_cls, config, directory: Path, seed: int = 0, jitter_norms: bool = False):
    """A random ``model_cls(config)`` with weights drawn N(0, 0.08) (norms as initialised, or
    jittered), saved in ``directory``; returns the HF model (float32, eval)."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger-than-default weights make logits spread, so argmax ties are unlikely
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            elif jitter_norms and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return model
