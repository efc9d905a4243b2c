"""What the tests of the two CPU decode plans check alike (test_decode_plan.py: the AVX-512
plan, csrc/decode_layers.cpp; test_avx2_decode_plan.py: the AVX2 one, csrc/avx2_plan.cpp)."""

from __future__ import annotations

import pytest
import torch

from .hf_tiny import COMMON, VARIANTS, build, save_spread


def save_latent_model(variant: str, path) -> None:
    """A tiny DeepSeek (``variant``) of widths both plans' latent attention takes: 16 heads (the
    AVX-512 shared-KV decode kernels' minimum) and nope 32 (W_uk^T in Q8_0 blocks where
    kv_b_proj is quantized), its norms jittered."""
    config_cls, model_cls, extra = VARIANTS[variant]
    widths = {"num_attention_heads": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "qk_rope_head_dim": 16}
    save_spread(model_cls, config_cls(**{**COMMON, **extra, **widths}), path, jitter_norms=True)


def assert_bf16_router_routes_as_float32(path, variant: str, generate, kernels_cls, monkeypatch) -> None:
    """A router whose values are all bf16 (a bf16 checkpoint's) is held in bf16 on the CPU
    kernels (Router.for_kernels: half the bytes a step), planned and op by op, with the tokens
    and logprobs of the float32 router (``kernels_cls.reads_bf16_router`` off); a router that is
    not bf16-exact stays float32. ``generate(path, **options)`` -> (outputs, model)."""
    from ridge.models.moe import Router

    def routers(model) -> list:
        return [m for m in model.modules() if isinstance(m, Router)]

    hf = build(variant, path)
    with torch.no_grad():
        for module in hf.modules():
            gate = getattr(module, "gate", None)
            if isinstance(getattr(gate, "weight", None), torch.Tensor) and gate.weight.dim() == 2:
                gate.weight.copy_(gate.weight.bfloat16().float())
    hf.save_pretrained(path)
    planned, model = generate(path)
    assert routers(model) and all(r.weight.dtype is torch.bfloat16 for r in routers(model))
    assert model.router_bytes_per_param() == 2  # what the telemetry prices a router's weights at
    assert model._plan is not None
    eager, _ = generate(path, enforce_eager=True)
    with monkeypatch.context() as patch:
        patch.setattr(kernels_cls, "reads_bf16_router", False)
        kept, model32 = generate(path)
    assert all(r.weight.dtype is torch.float32 for r in routers(model32))
    assert model32.router_bytes_per_param() == 4
    assert planned == eager == kept
    build(variant, path)  # random float32 values
    _, model = generate(path)
    assert all(r.weight.dtype is torch.float32 for r in routers(model))


def assert_refuses_bad_indices(plan, rotary, hidden: int, name: str) -> None:
    """A step whose slot, block id, context length or position lies outside what the plan
    holds is one clear error naming the plan (``name``), raised before any layer runs: h is
    untouched (the plan's kernels index without checks)."""
    h = torch.ones(1, hidden, dtype=torch.bfloat16)
    one, table = torch.ones(1, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
    far = torch.tensor([100000])
    cases = {  # the error, and the step's (slots, block tables, context lengths, positions)
        "slot 100000 is outside the pool": (far, table, one, one),
        "block id outside the pool": (one, table + 1000, one, one),
        "context length 100000 does not fit its table": (one, table, far, one),
        "position 100000 is outside the tables": (one, table, one, far),
    }
    for message, step in cases.items():
        with pytest.raises(RuntimeError, match=f"^{name}: {message}"):
            plan.run(h, *step, rotary.cos, rotary.sin)
    assert torch.equal(h, torch.ones_like(h))


STEP_PARTS = ("attention", "norms", "rope_kv", "activation", "routing", "combine")


def assert_step_parts_timed(llm, matmul_parts: bool) -> None:
    """After an MoE model's planned decode (dense and sparse layers): every decode step's
    telemetry names the seconds its ops took by kind (csrc/step_parts.h), each of the plan's
    kinds above nothing, the ones outside the matmuls within the step's time outside them and
    the matmuls' own (setup, wait) within theirs, above nothing where the block formats'
    AVX-512 kernel ran (``matmul_parts``); the report lists them."""
    decodes = [r for r in llm.engine.telemetry.recent if r.phase == "decode"]
    assert decodes
    for record in decodes:
        parts = record.step_parts
        assert parts is not None and min(parts.values()) >= 0.0
        assert all(parts[part] > 0.0 for part in STEP_PARTS), parts
        outside = sum(t for part, t in parts.items() if not part.startswith("matmul_"))
        assert outside < record.wall_s - record.matmul_s
        assert parts["matmul_setup"] + parts["matmul_wait"] <= record.matmul_s
        assert (parts["matmul_setup"] > 0.0) == matmul_parts
    text = llm.engine.telemetry.format()
    assert all(f"{part} " in text for part in STEP_PARTS)
    assert ("in matmuls setup" in text) == matmul_parts
