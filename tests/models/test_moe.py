"""The mixture-of-experts feed-forward: grouped execution against a per-token loop, the
edge where every token picks one expert, and experts no token picks are never run."""

from __future__ import annotations

import pytest
import torch

from ridge.config import ModelConfig
from ridge.layers.kernels import TorchKernels
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
            out[t] += weights[t, j] * moe.experts[int(ids[t, j])](x[t : t + 1], ops)[0]
    if moe.shared_expert is not None:
        out += torch.sigmoid(x @ moe.shared_expert_gate.weight.T) * moe.shared_expert(x, ops)
    return out


@pytest.mark.parametrize("variant", ["mixtral-moe", "qwen2-moe-shared", "qwen3-moe-dense-mixed"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_grouped_execution_equals_a_per_token_loop(variant, tokens):
    moe, cfg = make_moe(variant)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        torch.testing.assert_close(moe(x, TorchKernels()), per_token_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_every_token_picking_one_expert_and_the_others_never_run():
    moe, cfg = make_moe("mixtral-moe")
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[2, 0] = 50.0  # every token with x[0] > 0 routes to expert 2 first, then ties
        moe.gate.weight[1, 0] = 40.0
    ran = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda module, args, out, e=e: ran.append(e))
    x = torch.randn(9, cfg.hidden_size).abs()
    with torch.no_grad():
        out = moe(x, TorchKernels())
    assert sorted(ran) == [1, 2] and moe.experts_touched == 2  # experts 0 and 3 were never read
    torch.testing.assert_close(out, per_token_reference(moe, x), rtol=1e-5, atol=1e-6)


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


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"])
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


def test_a_moe_config_with_unsupported_routing_names_the_fields():
    from ridge.models.presets import get_preset

    hf = get_preset("tiny-qwen3-moe")
    hf.update(n_group=4, topk_group=2, scoring_func="sigmoid")
    with pytest.raises(ValueError, match="does not support: n_group=4, scoring_func='sigmoid', topk_group=2"):
        ModelConfig.from_hf_config(hf)
    hf = get_preset("tiny-qwen3-moe")
    hf.update(scoring_func="softmax", routed_scaling_factor=1.0)  # the defaults: accepted
    assert ModelConfig.from_hf_config(hf).moe.num_experts == 16
