"""Model shapes and parameter counts from presets and real config.json files."""

import copy
import json

import pytest

from ridge.models.presets import PRESETS, get_preset
from ridge.roofline.ops import kv_bytes_per_token, params_active, params_total, weight_bytes
from ridge.roofline.shapes import ModelShape, load_model_shape

ISSUE_PRESETS = (
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.2-1b",
    "tinyllama-1.1b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen2.5-7b",
    "qwen3-30b-a3b",
    "deepseek-v3",
)

# Parameter counts of the Hugging Face models built from these configs (transformers, meta
# device, sum of parameters().numel()). DeepSeek-V3: HF keeps the 58 x 256 router
# score-correction biases as buffers; the checkpoint stores them, so ridge counts them.
HF_PARAMS = {
    "tinyllama-1.1b": 1_100_048_384,
    "llama-3.2-1b": 1_235_814_400,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-30b-a3b": 30_532_122_624,
    "deepseek-v3": 671_026_404_352 + 58 * 256,
}


@pytest.mark.parametrize("preset", ISSUE_PRESETS)
def test_every_issue_preset_exists_and_parses(preset):
    assert preset in PRESETS
    config = PRESETS[preset]
    assert {"architectures", "model_type", "hidden_size", "num_hidden_layers"} <= set(config)
    shape = ModelShape.from_preset(preset)
    assert shape.name == preset
    assert params_total(shape) == HF_PARAMS[preset]


def test_presets_are_returned_as_copies():
    config = get_preset("llama-3.1-8b")
    config["hidden_size"] = 1
    assert PRESETS["llama-3.1-8b"]["hidden_size"] == 4096


@pytest.mark.parametrize(
    "preset, active_billions",
    [("mixtral-8x7b", 12.9), ("qwen3-30b-a3b", 3.3), ("deepseek-v3", 37.5)],
)
def test_moe_active_parameters_match_the_published_figures(preset, active_billions):
    """Active = all parameters minus the routed experts a token does not use (uniform top-k)."""
    assert params_active(ModelShape.from_preset(preset)) / 1e9 == pytest.approx(active_billions, abs=0.1)


def test_dense_models_are_fully_active():
    shape = ModelShape.from_preset("llama-3.1-8b")
    assert params_active(shape) == params_total(shape)


def test_mla_kv_cache_is_latent_plus_rope():
    """DeepSeek-V3: (kv_lora_rank 512 + qk_rope_head_dim 64) x 61 layers x 2 bytes per token."""
    shape = ModelShape.from_preset("deepseek-v3")
    assert shape.mla.cache_dim == 576
    assert kv_bytes_per_token(shape, 2) == 576 * 61 * 2
    assert (shape.dense_layers, shape.moe_layers) == (3, 58)
    assert shape.moe.shared_intermediate_size == 2048 and shape.moe.router_bias


def test_moe_spellings():
    mixtral = ModelShape.from_preset("mixtral-8x7b").moe
    qwen = ModelShape.from_preset("qwen3-30b-a3b").moe
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (8, 2, 14336)
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_intermediate_size) == (128, 8, 768)
    assert qwen.shared_intermediate_size == 0


def test_family_details():
    assert ModelShape.from_preset("qwen2.5-7b").qkv_bias  # Qwen2 hard-codes q/k/v biases
    assert ModelShape.from_preset("qwen2.5-7b").sliding_window is None  # use_sliding_window false
    assert ModelShape.from_preset("qwen3-30b-a3b").qk_norm
    assert ModelShape.from_preset("mistral-7b").sliding_window == 4096
    assert ModelShape.from_preset("llama-3.2-1b").tie_word_embeddings


def test_mistral_sliding_window_caps_the_cache():
    shape = ModelShape.from_preset("mistral-7b")
    assert shape.cached_tokens(10_000) == 4096
    assert shape.cached_tokens(100) == 100


def test_expected_experts_touched_under_uniform_routing():
    moe = ModelShape.from_preset("mixtral-8x7b").moe
    assert moe.expected_experts_touched(1) == pytest.approx(2)
    assert moe.expected_experts_touched(2) == pytest.approx(8 * (1 - 0.75**2))
    assert moe.expected_experts_touched(1000) == pytest.approx(8)


def test_weight_bytes_scale_with_bits():
    shape = ModelShape.from_preset("llama-2-7b")
    assert weight_bytes(shape, 2) == pytest.approx(2 * params_total(shape))
    # int4: matrices at half a byte; norm weights stay 16-bit, a rounding error here
    assert weight_bytes(shape, 0.5) / weight_bytes(shape, 2) == pytest.approx(0.25, abs=0.001)


def test_config_json_path_and_model_directory(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(PRESETS["qwen2.5-7b"]))
    by_dir = load_model_shape(str(model_dir))
    by_file = load_model_shape(str(model_dir / "config.json"))
    assert by_dir == by_file
    assert by_dir.name == "my-model"
    assert params_total(by_dir) == HF_PARAMS["qwen2.5-7b"]


def test_nested_text_config_is_read():
    config = {"architectures": ["SomethingForConditionalGeneration"], "text_config": get_preset("llama-3.1-8b")}
    assert params_total(ModelShape.from_hf_config(config)) == HF_PARAMS["llama-3.1-8b"]


def test_unknown_model_type_is_read_llama_style_with_a_note():
    config = get_preset("llama-3.1-8b")
    config["model_type"] = "brand_new"
    shape = ModelShape.from_hf_config(config)
    assert any("brand_new" in note for note in shape.notes)
    assert params_total(shape) == HF_PARAMS["llama-3.1-8b"]


def test_bad_inputs_raise_value_errors(tmp_path):
    config = get_preset("llama-3.1-8b")
    del config["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config(config)
    with pytest.raises(ValueError, match="neither a preset"):
        load_model_shape("no-such-model")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_shape(str(bad))
    odd = get_preset("llama-3.1-8b")
    odd["num_key_value_heads"] = 5
    with pytest.raises(ValueError, match="multiple"):
        ModelShape.from_hf_config(odd)


@pytest.mark.parametrize("preset", ["qwen2.5-7b", "qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
def test_parameter_formula_matches_transformers_on_a_shrunk_model(preset):
    """Cross-check against the real HF module tree (meta device, no memory), with the layer
    count cut to 4 so it is quick; DeepSeek keeps 3 dense layers + 1 MoE layer."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = copy.deepcopy(PRESETS[preset])
    config["num_hidden_layers"] = 4
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}
    hf_config = CONFIG_MAPPING[config["model_type"]](**kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf_params = sum(p.numel() for p in model.parameters())
    ours = params_total(ModelShape.from_hf_config(config))
    router_bias_buffers = 256 if preset == "deepseek-v3" else 0  # one MoE layer
    assert ours == hf_params + router_bias_buffers


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_analyzer_reads_each_config_through_the_engine_parser(preset):
    """One reader of config.json: the analyzer's shape is the engine's ModelConfig, seen by
    the roofline. Where the engine would run the config, both readings agree exactly."""
    from ridge.config import ModelConfig

    shape = ModelShape.from_preset(preset)
    lenient = ModelConfig.from_hf_config(get_preset(preset), lenient=True)
    assert shape == ModelShape.from_model_config(lenient, preset)
    if shape.sliding_window is None:  # the engine refuses a narrow window; otherwise it reads the same
        assert ModelConfig.from_hf_config(get_preset(preset)) == lenient


def test_a_narrow_window_is_kept_by_the_analyzer_and_refused_by_the_engine():
    from ridge.config import ModelConfig

    assert ModelShape.from_preset("mistral-7b").sliding_window == 4096
    with pytest.raises(ValueError, match="sliding-window attention"):
        ModelConfig.from_hf_config(get_preset("mistral-7b"))
