"""The architectures ridge runs: a Hugging Face ``architectures[0]`` name -> the class that runs
it, imported on first use. The loader, runner and engine know models only through this table
and the interface every class offers:

    cls(config: ModelConfig, max_positions: int, quant: QuantizationConfig)
    cls.packed_modules                    checkpoint module -> (packed module, shard)
    model.materialize(device)             rebuild what meta-device construction left empty
    model(input_ids, positions, kv_caches, meta) -> hidden states
    model.compute_logits(hidden), model.set_kernels(kernels), model.linear_layers()
    model.kv_cache_spec()                 what a token keeps in the KV cache per layer
"""

from __future__ import annotations

import importlib

# architecture -> "module:class"
_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "ridge.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "ridge.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "ridge.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "ridge.models.llama:LlamaForCausalLM",
    # mixture-of-experts feed-forwards (ridge/models/moe.py) in the same decoder
    "MixtralForCausalLM": "ridge.models.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "ridge.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "ridge.models.llama:LlamaForCausalLM",
    # latent attention + DeepSeek's MoE (ridge/models/deepseek.py)
    "DeepseekV2ForCausalLM": "ridge.models.deepseek:DeepseekForCausalLM",
    "DeepseekV3ForCausalLM": "ridge.models.deepseek:DeepseekForCausalLM",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_REGISTRY)


def model_class(architecture: str) -> type:
    """The class that runs ``architecture``; ValueError naming the supported ones otherwise."""
    target = _REGISTRY.get(architecture)
    if target is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; ridge supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
