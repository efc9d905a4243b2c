"""``QuantizationConfig``: the method each linear layer gets, and the start-up log's summary."""

from ridge.quantization.config import QuantizationConfig
from ridge.quantization.formats import get_format
from ridge.quantization.methods import BlockQuantLinearMethod, UnquantizedLinearMethod


def test_a_kind_of_layer_in_two_formats_is_summarized_with_each_ones_layers():
    """A Q4_K_M file keeps ffn_down in Q6_K in some layers and Q4_K in the others: the log
    says both, not the last layer's alone."""
    q4_k, q6_k = get_format("q4_k"), get_format("q6_k")
    down = ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj")
    config = QuantizationConfig(
        None, file_formats={down[0]: q6_k, down[1]: q4_k, down[2]: q6_k, "model.layers.0.self_attn.o_proj": q4_k}
    )
    methods = [config.method_for(name, 256) for name in (*down, "model.layers.0.self_attn.o_proj")]
    assert [m.format.name for m in methods] == ["q6_k", "q4_k", "q6_k", "q4_k"]
    assert all(isinstance(m, BlockQuantLinearMethod) for m in methods)
    assert config.summary() == [
        "model.layers.*.mlp.down_proj: q6_k (Q6_K, 6.5625 bits, from the file) in 2 layers; "
        "q4_k (Q4_K, 4.5 bits, from the file) in 1 layer",
        "model.layers.*.self_attn.o_proj: q4_k (Q4_K, 4.5 bits, from the file)",
    ]


def test_a_policy_says_why_a_layer_stays_unquantized():
    config = QuantizationConfig.from_name("int4")
    assert isinstance(config.method_for("model.layers.0.mlp.down_proj", 172), UnquantizedLinearMethod)
    assert isinstance(config.method_for("model.layers.1.mlp.down_proj", 256), BlockQuantLinearMethod)
    assert isinstance(config.method_for("lm_head", 256, tied=True), UnquantizedLinearMethod)
    assert config.summary() == [
        "model.layers.*.mlp.down_proj: unquantized (K = 172 is not a multiple of 32) in 1 layer; "
        "int4 (Q4_0, 4.5 bits) in 1 layer",
        "lm_head: unquantized (tied to the embedding, which stays as loaded)",
    ]
