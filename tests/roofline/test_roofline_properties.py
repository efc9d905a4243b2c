"""Properties that hold for every model and workload (hypothesis).

Conventions: the defaults (causal attention, gathered embedding rows, fused projections);
bytes per element drawn from the precisions the CLI offers.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from ridge.roofline.hardware import HARDWARE_PRESETS
from ridge.roofline.ops import CostConventions, step_cost
from ridge.roofline.shapes import ModelShape

MODELS = {
    name: ModelShape.from_preset(name)
    for name in (
        "tiny",
        "llama-3.1-8b",
        "mistral-7b",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
        "deepseek-v3",
        "qwen2.5-7b",
    )
}
models = st.sampled_from(sorted(MODELS)).map(MODELS.get)
batches = st.integers(1, 512)
contexts = st.integers(1, 32_768)
byte_widths = st.sampled_from([0.5, 1.0, 2.0, 4.0])
attention = st.sampled_from(["causal", "full"])
FAST = settings(max_examples=60, deadline=None)


DEFAULT_CONVENTIONS = CostConventions()


def decode(model, batch, context, wb=2.0, kvb=2.0, ab=2.0, conventions=DEFAULT_CONVENTIONS):
    return step_cost(model, [], [context] * batch, wb, kvb, ab, conventions=conventions)


@FAST
@given(models, batches, st.integers(1, 64), contexts, byte_widths, byte_widths, attention)
def test_flops_and_bytes_are_monotone_in_batch(model, batch, more, context, wb, kvb, attn):
    conv = CostConventions(attention=attn)
    small = decode(model, batch, context, wb, kvb, conventions=conv)
    large = decode(model, batch + more, context, wb, kvb, conventions=conv)
    assert large.flops >= small.flops
    assert large.bytes >= small.bytes


@FAST
@given(models, batches, contexts, st.integers(1, 4096), byte_widths, attention)
def test_flops_and_bytes_are_monotone_in_context(model, batch, context, more, kvb, attn):
    conv = CostConventions(attention=attn)
    short = decode(model, batch, context, kvb=kvb, conventions=conv)
    long = decode(model, batch, context + more, kvb=kvb, conventions=conv)
    assert long.flops >= short.flops
    assert long.bytes >= short.bytes


@FAST
@given(models, st.integers(1, 2048), st.integers(0, 2048))
def test_prefill_is_monotone_in_prompt_length(model, prompt, extra):
    short = step_cost(model, [(prompt, prompt)], [], 2, 2, 2)
    long = step_cost(model, [(prompt + extra, prompt + extra)], [], 2, 2, 2)
    assert long.flops >= short.flops and long.bytes >= short.bytes


@FAST
@given(models, batches, contexts)
def test_int4_weights_move_a_quarter_of_fp16_weight_bytes(model, batch, context):
    """Matrices at 4 bits vs 16; norm weights and biases stay 16-bit, so slightly above 1/4."""
    fp16 = decode(model, batch, context, wb=2.0)
    int4 = decode(model, batch, context, wb=0.5)
    ratio = int4.weight_bytes / fp16.weight_bytes
    assert 0.25 <= ratio < 0.26
    assert int4.flops == fp16.flops


@FAST
@given(models, batches, contexts, st.sampled_from(sorted(HARDWARE_PRESETS)), st.sampled_from(["bf16", "fp32"]))
def test_time_is_never_below_either_bound(model, batch, context, hw_name, dtype):
    hw = HARDWARE_PRESETS[hw_name]
    peak, bandwidth = hw.peak(dtype), hw.bandwidth_bytes_per_s
    step = decode(model, batch, context)
    time_s = step.time_s(peak, bandwidth)
    assert time_s >= step.flops / peak * (1 - 1e-12)
    assert time_s >= step.bytes / bandwidth * (1 - 1e-12)
    for op in step.ops:
        assert op.time_s(peak, bandwidth) >= max(op.flops / peak, op.bytes / bandwidth)


@FAST
@given(
    models,
    st.lists(st.tuples(st.integers(1, 512), st.integers(0, 2048)), min_size=1, max_size=4),
    st.lists(contexts, max_size=8),
)
def test_mixed_steps_share_weights_and_add_flops(model, chunks, decodes):
    """Splitting a step into per-sequence steps never reads fewer weights, and FLOPs add up
    (every operator is linear in tokens or in (query, key) pairs)."""
    prefill = [(q, q + past) for q, past in chunks]
    whole = step_cost(model, prefill, decodes, 2, 2, 2)
    parts = [step_cost(model, [chunk], [], 2, 2, 2) for chunk in prefill]
    parts += [step_cost(model, [], [c], 2, 2, 2) for c in decodes]
    assert whole.weight_bytes <= sum(p.weight_bytes for p in parts) * (1 + 1e-9)
    if model.mla is None:  # MLA picks its form per sequence, identically in both cases
        assert abs(whole.flops - sum(p.flops for p in parts)) <= 1e-6 * whole.flops
