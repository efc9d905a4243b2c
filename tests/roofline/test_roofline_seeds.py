"""Acceptance: the worked numbers of the seed articles (/work/shared/seeds/), reproduced.

Each test names the seed and the convention under which its number holds; where a seed rounds
(7B for 6.74B parameters, "14 GB"), the test says so and uses a matching tolerance.
"""

import pytest

from ridge.roofline.analyze import Conventions, Workload, analyze
from ridge.roofline.hardware import HARDWARE_PRESETS, resolve_hardware
from ridge.roofline.ops import CostConventions, Precision, kv_bytes_per_token, matmul_compute_bound_rows, matmul_cost
from ridge.roofline.shapes import ModelShape

H100 = HARDWARE_PRESETS["h100-sxm"]
# Seed convention for decode floors: every weight is read once per token (the whole embedding
# table included), fp16 weights, nothing else counted.
EVERY_WEIGHT = Conventions(CostConventions(embedding="full"))


def decode_floor(preset: str, hardware=H100) -> float:
    analysis = analyze(ModelShape.from_preset(preset), hardware, Workload(batches=(1,)), EVERY_WEIGHT)
    return analysis.decode_floor_s


# ---- seed 000: matmul intensity, counting every operand once in fp32 -----------------------
def test_prefill_matmul_intensity_fp32():
    """(100, 4096) x (4096, 4096), fp32, minimum bytes = 4 (MK + KN + MN): 47.7 FLOP/byte.
    Seed 000 prints ~49 for the same formula (its rounding); the exact value is 47.67."""
    op = matmul_cost(100, 4096, 4096, "fp32")
    assert op.flops == 2 * 100 * 4096 * 4096
    assert op.bytes == 4 * (100 * 4096 + 4096 * 4096 + 100 * 4096)
    assert op.intensity == pytest.approx(47.67, abs=0.01)
    assert op.intensity == pytest.approx(49, rel=0.03)


@pytest.mark.parametrize("dtype, expected", [("fp32", 0.5), ("fp16", 1.0)])
def test_decode_gemv_intensity(dtype, expected):
    """(1, 4096) x (4096, 4096), every operand once: ~0.5 FLOP/byte in fp32, ~1.0 in fp16."""
    assert matmul_cost(1, 4096, 4096, dtype).intensity == pytest.approx(expected, rel=0.002)


@pytest.mark.parametrize("batch, expected", [(16, 8), (64, 32)])
def test_batched_decode_rows_of_the_table(batch, expected):
    """Seed 000's table, fp32, every operand once: batch 16 -> ~8, batch 64 -> ~32 FLOP/byte."""
    assert matmul_cost(batch, 4096, 4096, "fp32").intensity == pytest.approx(expected, rel=0.04)


# ---- seeds 001/002/004: ridge points ------------------------------------------------------
def test_h100_sxm_ridge_point():
    """989 TFLOP/s dense bf16 / 3.35 TB/s = ~295 FLOP/byte (dense peak, no sparsity)."""
    assert H100.ridge_point("bf16") == pytest.approx(295, rel=0.002)
    assert H100.ridge_point("fp32") == pytest.approx(20, rel=0.01)  # seed 000: "around 20"


def test_a100_ridge_points():
    """Seed 002: A100 ~13 FLOP/byte for fp32 (19.5 TFLOP/s / 1.5 TB/s), ~200 for fp16 tensor
    cores; seed 003: ~156 on the 2 TB/s A100 (312 TFLOP/s / 2.039 TB/s = 153)."""
    a100_40 = HARDWARE_PRESETS["a100-40gb"]
    assert a100_40.ridge_point("fp32") == pytest.approx(13, rel=0.05)
    assert a100_40.ridge_point("fp16") == pytest.approx(200, rel=0.01)
    assert HARDWARE_PRESETS["a100-80gb"].ridge_point("bf16") == pytest.approx(156, rel=0.03)


# ---- decode floors: weight bytes / bandwidth ----------------------------------------------
def test_7b_fp16_floor_on_h100():
    """Seed 000/004: 7B fp16 (~14 GB) on H100 -> ~4.2 ms/token. Llama-2-7B has 6.74B parameters
    (13.5 GB), so the exact floor is 4.02 ms: within 5% of the seed's rounded 4.2."""
    model = ModelShape.from_preset("llama-2-7b")
    analysis = analyze(model, H100, Workload(batches=(1,)), EVERY_WEIGHT)
    assert analysis.weight_bytes == pytest.approx(14e9, rel=0.04)
    assert analysis.decode_floor_s == pytest.approx(analysis.weight_bytes / 3.35e12)
    assert analysis.decode_floor_s == pytest.approx(4.2e-3, rel=0.05)


def test_70b_fp16_ceiling_on_h100():
    """Seed 001: 70B fp16 (~140 GB) on 3.35 TB/s caps at ~24 tokens/s."""
    assert 1 / decode_floor("llama-2-70b") == pytest.approx(24, rel=0.03)


def test_13b_fp16_floor_on_h100():
    """Seed 002: 13B fp16 (~26 GB) / 3.35 TB/s = ~7.8 ms per token."""
    assert decode_floor("llama-2-13b") == pytest.approx(7.8e-3, rel=0.01)


def test_8b_at_16gb_on_2tbs():
    """Seed 003: Llama 3.1 8B, 16 GB of fp16 weights, 2 TB/s -> ~8 ms, ~125 tokens/s."""
    two_tbs = resolve_hardware("custom", peak_tflops=312, bandwidth_gbs=2000)
    floor = decode_floor("llama-3.1-8b", two_tbs)
    assert floor == pytest.approx(8e-3, rel=0.01)
    assert 1 / floor == pytest.approx(125, rel=0.01)


# ---- KV cache -----------------------------------------------------------------------------
def test_kv_cache_of_one_long_sequence():
    """Seed 002: 32 layers, d = 4096, S = 8192, batch 1, fp16, no GQA: 4 * L * S * d = ~4.3 GB
    (Llama-2-7B is exactly that shape)."""
    model = ModelShape.from_preset("llama-2-7b")
    assert kv_bytes_per_token(model, 2) * 8192 == 4 * 32 * 8192 * 4096
    assert kv_bytes_per_token(model, 2) * 8192 == pytest.approx(4.3e9, rel=0.01)


@pytest.mark.parametrize("preset, expected", [("llama-2-7b", 524_288), ("llama-3.1-8b", 131_072)])
def test_exact_kv_bytes_per_token(preset, expected):
    """2 (K, V) x layers x kv_heads x head_dim x 2 bytes (fp16): GQA shrinks Llama-3.1-8B 4x."""
    assert kv_bytes_per_token(ModelShape.from_preset(preset), 2) == expected


# ---- batched decode walks up the roofline -------------------------------------------------
def test_intensity_grows_linearly_with_batch_until_the_ridge():
    """Seeds 002/004: a 4096 x 4096 bf16 layer has intensity ~B at batch B (weights dominate),
    every operand counted once."""
    for batch in (1, 2, 4, 8, 16, 32, 64):
        assert matmul_cost(batch, 4096, 4096, "bf16").intensity == pytest.approx(batch, rel=0.04)


def test_compute_bound_batch_of_a_4096_layer_on_h100():
    """Seed 004: batch 'roughly 256 to 300' crosses the ~295 ridge; counting the activations
    too, the exact crossing of a 4096 x 4096 bf16 layer is in the low 300s."""
    rows = matmul_compute_bound_rows(4096, 4096, "bf16", H100.ridge_point("bf16"))
    assert 300 <= rows <= 350
    assert matmul_cost(rows, 4096, 4096, "bf16").intensity >= H100.ridge_point("bf16")
    assert matmul_cost(rows - 1, 4096, 4096, "bf16").intensity < H100.ridge_point("bf16")


def test_model_linear_layers_turn_compute_bound_in_the_low_300s():
    """The same crossing for a whole model's weight matmuls (Llama-3.1-8B decode, bf16, H100);
    the whole step never crosses at long context because KV reads grow with the batch (seed 001)."""
    analysis = analyze(ModelShape.from_preset("llama-3.1-8b"), H100, Workload(batches=(1,)))
    assert 290 <= analysis.compute_bound_batch_linear <= 360
    assert analysis.compute_bound_batch is None


def test_decode_at_batch_one_has_intensity_about_one():
    """Seeds 001/004: single-token decode of fp16 weights does ~1 FLOP per byte."""
    analysis = analyze(ModelShape.from_preset("llama-2-7b"), H100, Workload(batches=(1,), prompt_len=128))
    assert analysis.decode[0].intensity == pytest.approx(1.0, rel=0.05)
    assert analysis.decode[0].bound == "memory"


def test_prefill_of_a_long_prompt_is_compute_bound_and_fast():
    """Seed 001: a 70B fp16 model chews a 4,000-token prompt on an H100 in a few hundred ms,
    compute-bound (2 x 69e9 x 4000 FLOPs / 989 TFLOP/s = ~0.56 s plus attention)."""
    workload = Workload(prompt_len=4000, output_len=2, batches=(1,))
    analysis = analyze(ModelShape.from_preset("llama-2-70b"), H100, workload)
    assert analysis.prefill.bound == "compute"
    assert 0.3 < analysis.prefill.time_s < 1.0


def test_llama_8b_prefill_of_1000_tokens_on_a100():
    """Seed 003: a 1000-token prompt on an A100 (312 TFLOP/s) takes ~50 ms, compute-bound."""
    workload = Workload(prompt_len=1000, output_len=100, batches=(1,), precision=Precision())
    analysis = analyze(ModelShape.from_preset("llama-3.1-8b"), HARDWARE_PRESETS["a100-80gb"], workload)
    assert analysis.prefill.time_s == pytest.approx(50e-3, rel=0.1)
    assert analysis.prefill.bound == "compute"
