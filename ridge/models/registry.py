"""The architectures ridge runs: one row per Hugging Face ``architectures[0]`` name, with the
class that runs it (imported on first use) and what its family's configs mean that a
Llama config does not say. ``ModelConfig.from_hf_config`` reads a config through its row;
the loader, runner and engine know models only through this table and the interface every
class offers:

    cls(config: ModelConfig, max_positions: int, quant: QuantizationConfig)
    cls.packed_modules                    checkpoint module -> (packed module, shard)
    model.materialize(device)             rebuild what meta-device construction left empty
    model(input_ids, positions, kv_caches, meta) -> hidden states
    model.compute_logits(hidden), model.set_kernels(kernels), model.linear_layers()
    model.kv_cache_spec()                 what a token keeps in the KV cache per layer
    model.decode_greedy(input_ids, positions, kv_caches, meta, steps) -> (T, steps) tokens or None
                                          several greedy decode passes in one call, where it can
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ridge.models.deepseek_config import MLAConfig, read_deepseek_mla, read_deepseek_moe
from ridge.models.moe_config import MoEConfig, read_mixtral_moe, read_qwen_moe

# (arch, hf config, layers, lenient, notes) -> the sparse layers' MoE, or None
MoEReader = Callable[[str, dict[str, Any], int, bool, list[str]], MoEConfig | None]


@dataclass(frozen=True)
class Architecture:
    """One family's row.

    model: ``"module:class"`` of the model that runs it.
    model_type: the ``model_type`` its configs carry (a config without ``architectures``,
        or the analyzer's reading of an unknown one, goes by it).
    qkv_bias: q/k/v always carry a bias (Qwen2).
    attention_bias: the config's ``attention_bias`` puts a bias on q, k, v and o (Llama,
        Qwen3); Mistral's and Mixtral's attention never has one.
    qk_norm: an RMSNorm over head_dim on q and k before RoPE (Qwen3).
    ffn_name: the checkpoint's name of a layer's feed-forward.
    sliding_window_by_default: a config's ``sliding_window`` applies unless
        ``use_sliding_window`` says otherwise (Qwen's configs carry one they leave off).
    read_moe: the family's reading of its experts (None: dense).
    read_mla: the family's reading of its latent attention (None: multi-head attention).
    gguf: llama.cpp's name of the family (a GGUF file's ``general.architecture``).
    """

    model: str
    model_type: str
    gguf: str
    qkv_bias: bool = False
    attention_bias: bool = True
    qk_norm: bool = False
    ffn_name: str = "mlp"
    sliding_window_by_default: bool = True
    read_moe: MoEReader | None = None
    read_mla: Callable[[str, dict[str, Any]], MLAConfig] | None = None


_LLAMA = "ridge.models.llama:LlamaForCausalLM"
# mixture-of-experts feed-forwards (ridge/models/moe.py) run in the same decoder as Llama;
# latent attention + DeepSeek's MoE in ridge/models/deepseek.py
_DEEPSEEK = "ridge.models.deepseek:DeepseekForCausalLM"
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(_LLAMA, "llama", "llama"),
    "MistralForCausalLM": Architecture(_LLAMA, "mistral", "llama", attention_bias=False),
    "Qwen2ForCausalLM": Architecture(_LLAMA, "qwen2", "qwen2", qkv_bias=True, sliding_window_by_default=False),
    "Qwen3ForCausalLM": Architecture(_LLAMA, "qwen3", "qwen3", qk_norm=True, sliding_window_by_default=False),
    "MixtralForCausalLM": Architecture(
        _LLAMA, "mixtral", "llama", attention_bias=False, ffn_name="block_sparse_moe", read_moe=read_mixtral_moe
    ),
    "Qwen2MoeForCausalLM": Architecture(
        _LLAMA, "qwen2_moe", "qwen2moe", qkv_bias=True, sliding_window_by_default=False, read_moe=read_qwen_moe
    ),
    "Qwen3MoeForCausalLM": Architecture(
        _LLAMA, "qwen3_moe", "qwen3moe", qk_norm=True, sliding_window_by_default=False, read_moe=read_qwen_moe
    ),
    "DeepseekV2ForCausalLM": Architecture(
        _DEEPSEEK, "deepseek_v2", "deepseek2", read_moe=read_deepseek_moe, read_mla=read_deepseek_mla
    ),
    "DeepseekV3ForCausalLM": Architecture(
        _DEEPSEEK, "deepseek_v3", "deepseek2", read_moe=read_deepseek_moe, read_mla=read_deepseek_mla
    ),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)
# model_type -> the architecture its configs name
MODEL_TYPES: dict[str, str] = {a.model_type: name for name, a in ARCHITECTURES.items()}
# a GGUF file's architecture -> the one ridge reads it as: the first row of that name (llama:
# Llama, as llama.cpp writes Mistral's too; deepseek2: V2, the GGUF reader tells V3 by its router)
GGUF_ARCHITECTURES: dict[str, str] = {
    gguf: next(name for name, a in ARCHITECTURES.items() if a.gguf == gguf)
    for gguf in dict.fromkeys(a.gguf for a in ARCHITECTURES.values())
}


def architecture(name: str) -> Architecture:
    """``name``'s row; ValueError naming the supported ones otherwise."""
    row = ARCHITECTURES.get(name)
    if row is None:
        raise ValueError(f"unsupported architecture {name!r}; ridge supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    return row


def model_class(name: str) -> type:
    """The class that runs architecture ``name``; ValueError naming the supported ones otherwise."""
    module, _, cls = architecture(name).model.partition(":")
    return getattr(importlib.import_module(module), cls)
