"""The architecture table: the one place that names model classes."""

from __future__ import annotations

import pytest

from ridge.models import registry
from ridge.models.registry import SUPPORTED_ARCHITECTURES


def test_every_architecture_resolves_to_a_class_with_the_interface():
    for arch in SUPPORTED_ARCHITECTURES:
        cls = registry.model_class(arch)
        assert isinstance(cls.packed_modules, dict)
        for method in ("materialize", "forward", "compute_logits", "set_kernels", "linear_layers", "kv_cache_spec"):
            assert callable(getattr(cls, method)), (arch, method)


def test_an_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture .GPT2LMHeadModel.*DeepseekV3ForCausalLM"):
        registry.model_class("GPT2LMHeadModel")


# a config of each architecture (shapes from the presets; transformers builds it on meta)
_CONFIGS = {
    "LlamaForCausalLM": ("tiny", {}),
    "MistralForCausalLM": ("tiny", {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}),
    "Qwen2ForCausalLM": ("tiny", {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}),
    "Qwen3ForCausalLM": ("tiny", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16}),
    "MixtralForCausalLM": ("tiny-mixtral", {}),
    "Qwen2MoeForCausalLM": ("tiny-qwen2-moe", {}),
    "Qwen3MoeForCausalLM": ("tiny-qwen3-moe", {}),
    "DeepseekV2ForCausalLM": ("tiny-deepseek-v2", {}),
    "DeepseekV3ForCausalLM": ("tiny-deepseek-v3", {}),
}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
@pytest.mark.parametrize("attention_bias", [False, True])
def test_each_row_reads_its_family_as_transformers_builds_it(arch, attention_bias):
    """What the registry's row makes of a config (biases, q/k norms, experts, shared experts,
    latent attention) is what transformers builds from the same config."""
    import torch
    import transformers

    from ridge.config import ModelConfig
    from ridge.models.presets import PRESETS

    preset, changes = _CONFIGS[arch]
    hf = {**PRESETS[preset], **changes}
    if attention_bias:
        if registry.architecture(arch).read_mla:
            with pytest.raises(ValueError, match="attention_bias"):
                ModelConfig.from_hf_config({**hf, "attention_bias": True})
            return
        hf["attention_bias"] = True
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.architecture == arch
    kwargs = {k: v for k, v in hf.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(hf["model_type"], **kwargs)
        )
    for i, layer in enumerate(model.model.layers):
        attn, ffn = layer.self_attn, layer.mlp
        assert (cfg.mla is not None) == hasattr(attn, "kv_a_proj_with_mqa")
        if cfg.mla is None:
            assert (attn.q_proj.bias is not None) == cfg.qkv_bias, (arch, attention_bias)
        else:
            assert isinstance(getattr(attn, "q_a_proj", None), torch.nn.Linear) == (cfg.mla.q_lora_rank is not None)
        assert (attn.o_proj.bias is not None) == cfg.o_bias
        assert hasattr(attn, "q_norm") == cfg.qk_norm
        sparse = cfg.moe is not None and i in cfg.moe.sparse_layers
        assert hasattr(ffn, "experts") == sparse, (arch, i)
        if sparse:
            assert ffn.gate.weight.shape[0] == cfg.moe.num_experts
            shared = getattr(ffn, cfg.moe.shared_name, None)
            assert (shared is not None) == (cfg.moe.shared_intermediate_size > 0)
            if shared is not None:
                assert shared.down_proj.weight.shape[1] == cfg.moe.shared_intermediate_size
            assert hasattr(ffn, "shared_expert_gate") == cfg.moe.shared_expert_gate


def test_gguf_names_are_llama_cpps_and_each_reads_back_as_its_family():
    import gguf

    from ridge.models.export import GGUF_ARCHITECTURES as WRITES
    from ridge.models.registry import GGUF_ARCHITECTURES as READS

    for name, row in registry.ARCHITECTURES.items():
        assert row.gguf in gguf.MODEL_ARCH_NAMES.values(), name
        assert registry.ARCHITECTURES[READS[row.gguf]].gguf == row.gguf
    assert READS["llama"] == "LlamaForCausalLM" and READS["deepseek2"] == "DeepseekV2ForCausalLM"
    for name, arch in WRITES.items():  # what write_gguf writes is read back as a model of the same kind
        assert registry.architecture(READS[arch]).model == registry.architecture(name).model
