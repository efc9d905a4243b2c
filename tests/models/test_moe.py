"""The mixture-of-experts feed-forward: grouped execution against a per-token loop, the
edge where every token picks one expert, and experts no token picks are never run."""

from __future__ import annotations

import pytest
import torch

from ridge.config import ModelConfig
from ridge.layers.kernels import TorchKernels
from ridge.layers.linear import ExpertLinear
from ridge.models.moe import SparseMoE
from ridge.quantization.config import QuantizationConfig

from .hf_tiny import COMMON, VARIANTS


def make_moe(variant: str, seed: int = 0) -> tuple[SparseMoE, ModelConfig]:
    config_cls, model_cls, extra = VARIANTS[variant]
    hf = config_cls(**{**COMMON, **extra}).to_dict()
    hf["architectures"] = [model_cls.__name__]
    cfg = ModelConfig.from_hf_config(hf)
    torch.manual_seed(seed)
    moe = SparseMoE(cfg, QuantizationConfig(), "model.layers.1.mlp")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    return moe.eval(), cfg


def per_token_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    ops = TorchKernels()
    ids, weights = moe.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            out[t] += weights[t, j] * moe.experts.forward_expert(x[t : t + 1], int(ids[t, j]), ops)[0]
    if moe.shared_mlp is not None:
        shared = moe.shared_mlp(x, ops)
        if moe.shared_expert_gate is not None:
            shared = torch.sigmoid(x @ moe.shared_expert_gate.weight.T) * shared
        out += shared
    return out


@pytest.mark.parametrize(
    "variant", ["mixtral-moe", "qwen2-moe-shared", "qwen3-moe-dense-mixed", "deepseek-v2-lite", "deepseek-v3-yarn"]
)
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_grouped_execution_equals_a_per_token_loop(variant, tokens):
    moe, cfg = make_moe(variant)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        torch.testing.assert_close(moe(x, TorchKernels()), per_token_reference(moe, x), rtol=1e-5, atol=1e-6)


class ExpertProbe(TorchKernels):
    """Records which expert rows each stacked-expert matmul asks for."""

    def __init__(self) -> None:
        self.experts_read: list[int] = []

    def linear(self, x, layer, rows=None):
        if isinstance(layer, ExpertLinear):
            assert rows is not None and rows.stop - rows.start == layer.rows_per_expert  # one expert's rows, no more
            self.experts_read.append(rows.start // layer.rows_per_expert)
        return super().linear(x, layer, rows)


def test_every_token_picking_one_expert_and_the_others_never_run():
    moe, cfg = make_moe("mixtral-moe")
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[2, 0] = 50.0  # every token with x[0] > 0 routes to expert 2 first, then ties
        moe.gate.weight[1, 0] = 40.0
    reference_out = None
    x = torch.randn(9, cfg.hidden_size).abs()
    with torch.no_grad():
        reference_out = per_token_reference(moe, x)
        # poison the experts no token picks: a read of any of their weights would show as NaN
        for layer in (moe.experts.gate_up_proj, moe.experts.down_proj):
            for expert in (0, 3):
                layer.weight[layer.expert_rows(expert)] = float("nan")
        probe = ExpertProbe()
        out = moe(x, probe)
    assert sorted(set(probe.experts_read)) == [1, 2] and moe.experts_touched == 2
    assert len(probe.experts_read) == 4  # gate_up and down of each, once for all its tokens
    torch.testing.assert_close(out, reference_out, rtol=1e-5, atol=1e-6)


def test_a_top1_step_where_every_token_picks_the_same_expert_runs_only_it():
    moe, cfg = make_moe("qwen3-moe-top1-raw")  # 4 experts, top-1
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[3, 0] = 50.0
        x = torch.randn(12, cfg.hidden_size).abs()
        reference = per_token_reference(moe, x)
        probe = ExpertProbe()
        out = moe(x, probe)
    assert probe.experts_read == [3, 3] and moe.experts_touched == 1  # one run of 12 rows per projection
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)


def test_stacked_experts_read_only_their_rows_through_the_cpu_kernels():
    """The packed stacked tensor sliced per expert (ridge's kernel) equals each expert's own matmul."""
    from ridge.layers.cpu_kernels import select_kernels

    kernels = select_kernels("auto", torch.device("cpu"), torch.bfloat16)
    if type(kernels).__name__ != "CpuKernels":
        pytest.skip("ridge's AVX-512 kernels (which pack stacked experts) are not available here")
    layer = ExpertLinear(4, 64, [32, 32])
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
    layer.to(torch.bfloat16)
    dense = layer.weight.detach().clone()
    layer.method.process_weights_after_loading(layer, kernels)
    assert layer.packed is not None and layer.weight.numel() == 0
    x = torch.randn(5, 64).bfloat16()
    for expert in range(4):
        rows = layer.expert_rows(expert)
        got = kernels.matmul(x, layer, rows)
        torch.testing.assert_close(got.float(), (x @ dense[rows].T).float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(layer.method.dense_rows(layer, rows), dense[rows])


@pytest.mark.parametrize("fmt", [None, "int8", "int4", "int4_asym"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_grouped_cpu_kernel_equals_one_matmul_per_expert(fmt, x_dtype):
    """One C++ call for all experts of a stacked layer (rows sorted by expert, some experts
    with none) against the torch reference on each expert's own rows of W."""
    from ridge.layers.cpu_kernels import select_kernels

    kernels = select_kernels("auto", torch.device("cpu"), torch.bfloat16)
    if type(kernels).__name__ != "CpuKernels":
        pytest.skip("ridge's AVX-512 kernels (which pack stacked experts) are not available here")
    if fmt is None and x_dtype is torch.float32:
        pytest.skip("the bf16 kernel takes bf16 activations")
    layer = ExpertLinear(5, 64, [32, 32], method=QuantizationConfig.from_name(fmt).method_for("e.gate_up_proj", 64))
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(layer.out_features, 64, generator=gen) * 0.1
    if fmt is None:
        layer.weight.data = dense.bfloat16()
    else:
        layer.method.load_weight(layer, dense, None)
    reference_kernels = TorchKernels()
    counts = [3, 0, 17, 1, 0]  # experts 1 and 4 picked by no row
    x = torch.randn(sum(counts), 64, generator=gen).to(x_dtype)
    expected = reference_kernels.grouped_matmul(x, layer, counts).float()
    layer.method.process_weights_after_loading(layer, kernels)
    assert layer.packed is not None
    got = kernels.grouped_matmul(x, layer, counts).float()
    assert got.shape == (21, 64)
    # bf16 rounding, and per-32 int8 activations in the block formats
    assert ((got - expected).norm() / expected.norm()).item() < (0.01 if fmt is None else 0.03)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_match_their_dequantized_reference(fmt):
    """Experts in a block format through the engine's kernels (ridge's integer kernel where the
    CPU has it) against the torch reference on the dequantized weights."""
    from ridge.layers.cpu_kernels import select_kernels
    from ridge.layers.linear import Linear

    config_cls, model_cls, extra = VARIANTS["qwen3-moe-dense-mixed"]
    hf = config_cls(**{**COMMON, **extra, "hidden_size": 128}).to_dict()
    hf["architectures"] = [model_cls.__name__]
    cfg = ModelConfig.from_hf_config(hf)
    moe = SparseMoE(cfg, QuantizationConfig.from_name(fmt), "model.layers.1.mlp").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.1, generator=gen)
        for layer in moe.modules():
            if isinstance(layer, Linear):
                assert layer.method.format is not None  # every expert projection is quantized
                layer.method.load_weight(layer, torch.randn(layer.out_features, layer.in_features, generator=gen), None)
    moe.to(torch.bfloat16)
    x = torch.randn(13, cfg.hidden_size, generator=gen).bfloat16()
    with torch.no_grad():
        reference = per_token_reference(moe, x).float()
        kernels = select_kernels("auto", torch.device("cpu"), torch.bfloat16)
        for layer in moe.modules():
            if isinstance(layer, Linear):
                layer.method.process_weights_after_loading(layer, kernels)
        out = moe(x, kernels).float()
    # int8 activations (per 32) and bf16 rounding on the kernel side
    assert ((out - reference).norm() / reference.norm()).item() < 0.02


@pytest.mark.parametrize(
    "preset", ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v3"]
)
def test_random_moe_presets_run_and_the_analyzer_reads_them(preset):
    from ridge import LLM, SamplingParams
    from ridge.models.presets import get_preset
    from ridge.roofline.shapes import ModelShape

    llm = LLM(f"random:{preset}", device="cpu", num_kv_blocks=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    shape = ModelShape.from_hf_config(get_preset(preset))
    assert shape.moe is not None and shape.moe.num_experts == llm.engine.model_config.moe.num_experts


def test_telemetry_prices_the_experts_a_step_touched():
    from ridge import LLM, SamplingParams

    llm = LLM("random:tiny-qwen3-moe", device="cpu", num_kv_blocks=64)  # 16 experts, top 4
    telemetry = llm.engine.telemetry
    telemetry.reset()
    llm.generate(
        [[5, 6, 7, 8, 9, 10, 11, 12]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    prefill, *decodes = list(telemetry.recent)
    assert all(r.experts_touched == 4 for r in decodes)  # one token: exactly its 4 experts
    assert 4 <= prefill.experts_touched <= 16
    cost = telemetry.price(decodes[0])
    experts = [op for op in cost.ops if op.name.startswith("experts_")]
    assert experts and all(op.count == 4 for op in experts)


def test_telemetry_prices_the_router_as_held():
    """bf16 weights, a float32 router (torch's kernels keep it so): the router's reads are
    priced at 4 bytes a weight, the rest at 2."""
    from ridge import LLM, SamplingParams

    llm = LLM("random:tiny-qwen3-moe", device="cpu", num_kv_blocks=64, dtype="bfloat16", kernels="torch")
    telemetry = llm.engine.telemetry
    assert telemetry.pricing.router_bytes == 4 and telemetry.pricing.weight_bytes == pytest.approx(2)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    cost, shape = telemetry.price(telemetry.recent[-1]), telemetry.pricing.model
    assert cost.op("router").weight_bytes == shape.moe.num_experts * shape.hidden_size * 4 * shape.moe_layers
    assert cost.op("o_proj").weight_bytes == shape.hidden_size * shape.num_heads * shape.head_dim * 2 * shape.num_layers


def test_a_moe_config_with_unsupported_routing_names_the_fields():
    from ridge.models.presets import get_preset

    hf = get_preset("tiny-qwen3-moe")
    hf.update(n_group=4, topk_group=2, scoring_func="sigmoid")
    with pytest.raises(ValueError, match="does not support: n_group=4, scoring_func='sigmoid', topk_group=2"):
        ModelConfig.from_hf_config(hf)
    hf = get_preset("tiny-qwen3-moe")
    hf.update(scoring_func="softmax", routed_scaling_factor=1.0)  # the defaults: accepted
    assert ModelConfig.from_hf_config(hf).moe.num_experts == 16


ROUTER_CASES = {
    # name: (HF config class name, router class, config overrides)
    "v2-greedy": ("DeepseekV2Config", "DeepseekV2TopkRouter", dict(topk_method="greedy", routed_scaling_factor=1.5)),
    "v2-group-limited": (
        "DeepseekV2Config",
        "DeepseekV2TopkRouter",
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    "v3-noaux-tc": (
        "DeepseekV3Config",
        "DeepseekV3TopkRouter",
        dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
    "v3-one-group-unnormalized": (
        "DeepseekV3Config",
        "DeepseekV3TopkRouter",
        dict(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0),
    ),
}


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
def test_deepseek_routers_choose_and_weigh_as_transformers(case):
    import transformers

    config_name, router_name, overrides = ROUTER_CASES[case]
    hf_config = getattr(transformers, config_name)(
        hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, **overrides
    )
    module = __import__(type(hf_config).__module__.replace("configuration", "modeling"), fromlist=[router_name])
    hf_router = getattr(module, router_name)(hf_config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.5, generator=gen)
        if hasattr(hf_router, "e_score_correction_bias"):
            hf_router.e_score_correction_bias.normal_(0, 0.3, generator=gen)
    hf = hf_config.to_dict()
    hf.update(
        architectures=[config_name.replace("Config", "ForCausalLM")], num_hidden_layers=2, first_k_dense_replace=0
    )
    moe = SparseMoE(ModelConfig.from_hf_config(hf), QuantizationConfig(), "model.layers.0.mlp")
    with torch.no_grad():
        moe.gate.weight.copy_(hf_router.weight)
        if hasattr(hf_router, "e_score_correction_bias"):
            moe.gate.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
        x = torch.randn(40, 64, generator=gen)
        _, ref_weights, ref_ids = hf_router(x)
        ids, weights = moe.route(x)
    # the same experts with the same weights (the order within a token's k does not matter)
    ref_order, order = ref_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ref_ids.gather(1, ref_order), ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("arch", "fields", "message"),
    [
        ("DeepseekV3ForCausalLM", dict(scoring_func="softmax"), "sigmoid scores and noaux_tc"),
        ("DeepseekV2ForCausalLM", dict(norm_topk_prob=True), "norm_topk_prob=true"),
        ("DeepseekV2ForCausalLM", dict(topk_method="noaux_tc"), "V3's router"),
        ("DeepseekV3ForCausalLM", dict(moe_layer_freq=2), "moe_layer_freq=2"),
        ("DeepseekV3ForCausalLM", dict(n_group=3), "n_group .3. must divide"),
        ("DeepseekV3ForCausalLM", dict(attention_bias=True), "attention_bias"),
    ],
)
def test_deepseek_configs_ridge_does_not_run_are_refused_by_name(arch, fields, message):
    from ridge.models.presets import get_preset

    hf = get_preset("tiny-deepseek-v3" if "V3" in arch else "tiny-deepseek-v2")
    hf.update(fields)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(hf)
