"""Loading Hugging Face directories: shards, dtypes, and clear errors for what ridge refuses."""

from __future__ import annotations

import json

import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.config import ModelConfig
from ridge.models.loader import read_hf_config
from ridge.models.presets import get_preset

from .hf_tiny import build

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [5, 17, 99, 200, 3, 41, 8]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    build("llama-gqa", directory, seed=5)
    return directory


def test_sharded_checkpoint_loads_the_same_weights(llama_dir, tmp_path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    one = LLM(str(llama_dir), tokenizer="bytes", num_kv_blocks=16).generate([PROMPT], GREEDY, use_tqdm=False)
    many = LLM(str(sharded), tokenizer="bytes", num_kv_blocks=16).generate([PROMPT], GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == many[0].outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_run_close_to_float32(llama_dir, dtype):
    ref = LLM(str(llama_dir), tokenizer="bytes", dtype="float32", num_kv_blocks=16)
    half = LLM(str(llama_dir), tokenizer="bytes", dtype=dtype, num_kv_blocks=16)
    assert half.engine.dtype == getattr(torch, dtype)
    assert half.engine.executor.worker.kv_caches[0][0].dtype == getattr(torch, dtype)
    lp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    a = ref.generate([PROMPT], lp, use_tqdm=False)[0].outputs[0]
    b = half.generate([PROMPT], lp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    assert abs(a.cumulative_logprob - b.cumulative_logprob) < 0.1


def test_dtype_defaults_to_the_checkpoint(llama_dir, tmp_path):
    config = json.loads((llama_dir / "config.json").read_text())
    assert ModelConfig.from_hf_config(config).dtype == "float32"
    config["dtype"] = "bfloat16"
    assert ModelConfig.from_hf_config(config).dtype == "bfloat16"


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(
        ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        ModelConfig.from_hf_config({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})


def test_sliding_window_narrower_than_context_is_refused_wider_is_full_attention():
    mistral = {
        **get_preset("tiny"),
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "max_position_embeddings": 4096,
        "sliding_window": 1024,
    }
    with pytest.raises(ValueError, match="sliding-window attention .* not supported"):
        ModelConfig.from_hf_config(mistral)
    assert ModelConfig.from_hf_config(mistral, max_model_len=1024).max_position_embeddings == 4096
    mistral["sliding_window"] = 8192
    ModelConfig.from_hf_config(mistral)  # wider than the context: plain full attention


def test_qwen2_sliding_window_only_counts_when_enabled():
    qwen = {
        **get_preset("tiny"),
        "architectures": ["Qwen2ForCausalLM"],
        "sliding_window": 16,
        "use_sliding_window": False,
    }
    assert ModelConfig.from_hf_config(qwen).qkv_bias


def test_missing_directory_and_missing_config(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_hf_config(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="no config.json"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_hf_config(str(tmp_path))


def test_corrupt_or_missing_weights(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(broken), tokenizer="bytes")
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="not a safetensors file"):
        LLM(str(broken), tokenizer="bytes")


def test_missing_tensor_is_reported(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((llama_dir / "config.json").read_text())
    tensors = load_file(llama_dir / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(tensors, partial / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights: model.layers.1.self_attn.qkv_proj.weight#1"):
        LLM(str(partial), tokenizer="bytes")


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="unknown model preset 'nope'.*tiny"):
        LLM("random:nope")


def test_random_preset_is_reproducible_for_a_seed():
    a = LLM("random:tiny", seed=3, num_kv_blocks=8).generate([PROMPT], GREEDY, use_tqdm=False)
    b = LLM("random:tiny", seed=3, num_kv_blocks=8).generate([PROMPT], GREEDY, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
