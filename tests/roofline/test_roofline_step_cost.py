"""``ops.step_cost``: the per-step cost the engine's telemetry will call, and its conventions.

Unless a test says otherwise: causal attention, gathered embedding rows, fused projections,
fp16 weights/activations/KV (2 bytes each), one GPU.
"""

import pytest

from ridge.roofline.analyze import Analyzer, Conventions, Roof, Workload
from ridge.roofline.ops import (
    CostConventions,
    attended_pairs,
    keys_read,
    parameter_inventory,
    step_cost,
    weight_bytes,
)
from ridge.roofline.shapes import ModelShape

LLAMA = ModelShape.from_preset("llama-3.1-8b")


DEFAULT_CONVENTIONS = CostConventions()


def cost(model=LLAMA, prefill=(), decode=(), conventions=DEFAULT_CONVENTIONS, **kwargs):
    return step_cost(model, list(prefill), list(decode), 2, 2, 2, conventions=conventions, **kwargs)


def test_linear_layers_read_weights_once_per_step_attention_is_per_sequence():
    """Mixed step = one prefill chunk + two decodes: linear FLOPs add up, weights are read once,
    attention FLOPs and KV reads are the sum over sequences."""
    mixed = cost(prefill=[(512, 512)], decode=[1000, 3000])
    parts = [cost(prefill=[(512, 512)]), cost(decode=[1000]), cost(decode=[3000])]
    assert mixed.tokens == 514 and mixed.sequences == 3
    assert mixed.flops == pytest.approx(sum(p.flops for p in parts))
    assert mixed.op("gate_up_proj").weight_bytes == parts[0].op("gate_up_proj").weight_bytes
    assert mixed.weight_bytes < sum(p.weight_bytes for p in parts)
    for name in ("attn_scores", "attn_weighted_sum"):
        assert mixed.op(name).kv_read_bytes == pytest.approx(sum(p.op(name).kv_read_bytes for p in parts))


def test_cost_components_are_reported_separately():
    step = cost(decode=[2048])
    kv_per_layer_token = 8 * 128 * 2  # one of K or V, 8 KV heads x 128 dims x 2 bytes
    assert step.kv_read_bytes == 2 * 2048 * kv_per_layer_token * 32
    assert step.kv_write_bytes == 2 * kv_per_layer_token * 32  # one new token's K and V
    assert step.weight_bytes == pytest.approx(weight_bytes(LLAMA, 2) - (128256 - 1) * 4096 * 2)
    assert step.bytes == pytest.approx(
        step.weight_bytes + step.activation_bytes + step.kv_read_bytes + step.kv_write_bytes
    )


def test_logits_only_for_sampled_rows():
    """Prefill computes logits for the sampled position only, unless told otherwise."""
    assert cost(prefill=[(100, 100)]).op("lm_head").m == 1
    assert cost(prefill=[(5, 105)], logit_rows=5).op("lm_head").m == 5
    with pytest.raises(ValueError):
        cost(prefill=[(5, 105)], logit_rows=6)


def test_causal_and_full_attention_conventions():
    """Causal: the query at position p sees p keys (prefill of S: S(S+1)/2 pairs); full: S^2."""
    causal = cost(prefill=[(2048, 2048)]).op("attn_scores")
    full = cost(prefill=[(2048, 2048)], conventions=CostConventions(attention="full")).op("attn_scores")
    per_pair = 2 * 32 * 128 * 32  # 2 FLOPs x heads x head_dim x layers
    assert causal.flops == per_pair * 2048 * 2049 // 2
    assert full.flops == per_pair * 2048 * 2048
    # Decode is one query: both conventions agree.
    assert cost(decode=[777]).flops == cost(decode=[777], conventions=CostConventions(attention="full")).flops


def test_attended_pairs_with_a_sliding_window():
    assert attended_pairs(1, 10_000, True, window=4096) == 4096
    assert attended_pairs(3, 3, True) == 6
    assert attended_pairs(4, 10, True, window=8) == 7 + 8 + 8 + 8
    assert keys_read(1, 10_000, window=4096) == 4096
    mistral = ModelShape.from_preset("mistral-7b")
    near, far = cost(mistral, decode=[4096]), cost(mistral, decode=[20_000])
    assert near.flops == far.flops and near.kv_read_bytes == far.kv_read_bytes


def test_embedding_convention():
    gathered = cost(decode=[10]).op("embedding")
    full = cost(decode=[10], conventions=CostConventions(embedding="full")).op("embedding")
    assert gathered.weight_bytes == 4096 * 2
    assert full.weight_bytes == 128256 * 4096 * 2
    assert gathered.flops == 0


def test_fused_and_unfused_projections_do_the_same_math():
    fused = cost(prefill=[(64, 64)])
    split = cost(prefill=[(64, 64)], conventions=CostConventions(fused_projections=False))
    assert fused.flops == split.flops
    assert fused.weight_bytes == split.weight_bytes
    assert split.activation_bytes > fused.activation_bytes  # the input is read per projection
    assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} <= {op.name for op in split.ops}


def test_tensor_parallel_costs_are_per_gpu():
    one = cost(decode=[1000] * 8)
    four = cost(decode=[1000] * 8, conventions=CostConventions(tensor_parallel=4))
    assert four.op("gate_up_proj").weight_bytes == one.op("gate_up_proj").weight_bytes / 4
    assert four.op("attn_scores").kv_read_bytes == one.op("attn_scores").kv_read_bytes / 4
    assert four.op("input_norm").flops == one.op("input_norm").flops  # norms are replicated
    with pytest.raises(ValueError, match="does not divide"):
        cost(decode=[10], conventions=CostConventions(tensor_parallel=3))
    per_gpu = sum(g.total for g in parameter_inventory(LLAMA, 4))
    assert per_gpu == pytest.approx(sum(g.total for g in parameter_inventory(LLAMA)) / 4, rel=0.001)


def test_moe_reads_only_the_experts_it_touches():
    mixtral = ModelShape.from_preset("mixtral-8x7b")
    one = cost(mixtral, decode=[100]).op("experts_gate_up_proj")
    many = cost(mixtral, decode=[100] * 64).op("experts_gate_up_proj")
    per_expert = 4096 * 2 * 14336 * 2 * 32  # gate+up weights of one expert, all MoE layers
    assert one.count == pytest.approx(2) and one.weight_bytes == pytest.approx(2 * per_expert)
    assert many.count == pytest.approx(8, rel=1e-6)
    assert many.flops == pytest.approx(64 * one.flops)


def test_an_moe_router_is_read_at_its_own_precision_not_the_weights():
    """ridge holds routers in float32 (bf16 where the CPU kernels read one): a 4-bit model's
    router still costs 4 bytes a weight, and DeepSeek-V3's correction bias stays float32
    whatever the router's; the engine passes what it holds."""
    ds = ModelShape.from_preset("deepseek-v3")
    router_params = 256 * 7168 * ds.moe_layers
    bias = 256 * ds.moe_layers

    def router(weight_bytes, **kw):
        return step_cost(ds, [], [100], weight_bytes, 2, 2, **kw).op("router").weight_bytes

    assert router(0.5625) == router(2) == 4 * (router_params + bias)
    assert router(0.5625, router_bytes_per_param=2) == 2 * router_params + 4 * bias
    # the model's bytes: the routers' part moves with their precision alone
    low, high = weight_bytes(ds, 0.5625, router_bytes_per_param=2), weight_bytes(ds, 0.5625)
    assert high - low == pytest.approx(2 * router_params)
    assert weight_bytes(LLAMA, 2, router_bytes_per_param=1) == weight_bytes(LLAMA, 2)  # no router
    with pytest.raises(ValueError, match="router_bytes_per_param must be positive"):
        router(2, router_bytes_per_param=0)


def test_mla_decodes_in_latent_space_and_prefill_decompresses():
    """DeepSeek-V3: decodes read the 576-wide latent once per token and layer; a long prefill
    takes the decompressing path (fewer FLOPs there)."""
    ds = ModelShape.from_preset("deepseek-v3")
    decode = cost(ds, decode=[4096])
    names = {op.name for op in decode.ops}
    assert {"q_absorb", "attn_scores_latent", "v_unabsorb"} <= names and "kv_b_proj" not in names
    assert decode.kv_read_bytes == 4096 * 576 * 2 * 61
    prefill = cost(ds, prefill=[(2048, 2048)])
    assert "kv_b_proj" in {op.name for op in prefill.ops}
    assert prefill.kv_write_bytes == 2048 * 576 * 2 * 61


def test_qwen3_k_reaches_the_cache_through_qk_norm():
    qwen = ModelShape.from_preset("qwen3-30b-a3b")
    step = cost(qwen, decode=[10])
    assert step.op("qk_norm").kv_write_bytes > 0
    assert step.kv_write_bytes == 2 * 4 * 128 * 2 * 48


def test_invalid_steps_are_rejected():
    with pytest.raises(ValueError, match="at least one"):
        cost()
    with pytest.raises(ValueError, match="num_query_tokens"):
        cost(prefill=[(10, 5)])
    with pytest.raises(ValueError, match="positive"):
        step_cost(LLAMA, [], [10], 0, 2, 2)
    with pytest.raises(ValueError):
        CostConventions(attention="sideways")


def test_analyzer_phases_come_from_step_cost():
    """One source of truth: the analyzer's decode phase is exactly step_cost's numbers."""
    roof = Roof("bf16", 989.4e12, 3.35e12)
    analyzer = Analyzer(LLAMA, roof, Workload(), Conventions())
    phase = analyzer.decode(8, 3000)
    direct = cost(decode=[3000] * 8)
    assert phase.cost == direct
    assert phase.time_s == direct.time_s(roof.peak_flops, roof.bandwidth)
    prefill = analyzer.prefill(2)
    assert prefill.cost == cost(prefill=[(2048, 2048)] * 2)


def test_tensor_parallel_communication_two_all_reduces_per_layer_and_a_logits_gather():
    from ridge.roofline.ops import LINK_PRESETS, comm_cost

    assert cost(decode=[100]).comm.collectives == 0  # one rank: nothing to send
    tp2 = cost(decode=[100] * 4, conventions=CostConventions(tensor_parallel=2))
    d, layers, vocab = LLAMA.hidden_size, LLAMA.num_layers, LLAMA.vocab_size
    hidden = 4 * d * 2  # 4 tokens of the hidden state, 2 bytes each
    logits = 4 * vocab * 2
    assert tp2.comm.collectives == 2 * layers + 1
    assert tp2.comm.payload_bytes == pytest.approx(2 * layers * hidden + logits)
    # a ring all-reduce over 2 ranks sends half its payload twice; rank 0 receives half the logits
    assert tp2.comm.link_bytes == pytest.approx(2 * layers * hidden + logits / 2)
    tp4 = comm_cost(LLAMA, 4, 4, 2, 4)
    assert tp4.link_bytes == pytest.approx(2 * layers * hidden * 2 * 3 / 4 + logits * 3 / 4)
    link = LINK_PRESETS["nvlink4"]
    assert link.time_s(tp2.comm) == pytest.approx(
        tp2.comm.collectives * link.latency_s + tp2.comm.link_bytes / link.bandwidth_bytes_per_s
    )


def test_the_analyzer_adds_the_collectives_to_a_tensor_parallel_step():
    from ridge.roofline.ops import Link

    link = Link("test", 10e9, 50e-6)
    conventions = Conventions(cost=CostConventions(tensor_parallel=2))
    plain = Analyzer(LLAMA, Roof("bf16", 1e15, 3e12), Workload(), conventions).decode(1, 1000)
    linked = Analyzer(LLAMA, Roof("bf16", 1e15, 3e12, link), Workload(), conventions).decode(1, 1000)
    assert plain.comm_s == 0
    assert linked.comm_s == pytest.approx(link.time_s(linked.cost.comm))
    assert linked.time_s == pytest.approx(plain.time_s + linked.comm_s)


def test_a_weight_mix_averages_the_stored_bits_and_takes_the_main_formats_arithmetic():
    from ridge.quantization.formats import FORMATS
    from ridge.roofline.ops import Precision

    mix = Precision.for_weight_mix({"q6_k": 1, "q4_k": 3}, activation_bits=16, kv_bits=8)
    assert mix.weight_mix == (("q4_k", 0.75), ("q6_k", 0.25))
    assert mix.weight_bits == FORMATS["q4_k"].arithmetic_bits and mix.kv_bits == 8
    assert mix.weight_storage_bits == pytest.approx(0.75 * 4.5 + 0.25 * 6.5625)
    # a step that reads every matrix once reads the file's bytes: 4 weights cost their parts' bytes
    parts = 3 * Precision.for_weight_format("q4_k").weight_bytes + Precision.for_weight_format("q6_k").weight_bytes
    assert 4 * mix.weight_bytes == pytest.approx(parts)
    assert Precision.for_weight_mix({"bf16": 5}).weight_storage_bits == 16
    with pytest.raises(ValueError, match="unknown weight formats"):
        Precision.for_weight_mix({"q4_k": 1, "q9_z": 1})
    with pytest.raises(ValueError, match="at least one weight"):
        Precision.for_weight_mix({})
