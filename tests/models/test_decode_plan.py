"""The decode plan (``DecodePlanRun`` in models/llama.py, ``csrc/decode_layers.cpp``): a bf16
decode step's layers in one call of the CPU kernels computes what the model's op-by-op forward
computes, bit for bit, on every model shape it covers; what it does not cover runs op by op."""

from __future__ import annotations

import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.layers.cpu_kernels import cpu_has_avx512_bf16

from .hf_tiny import COMMON, build
from .plan_cases import (
    assert_bf16_router_routes_as_float32,
    assert_refuses_bad_indices,
    assert_step_parts_timed,
    save_latent_model,
)

pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="ridge's CPU kernels need AVX-512 BF16")

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [3]]


def _generate(path, **options):
    """Greedy tokens and their top-3 logprobs for a batch of three (decode steps of 3, then 1
    row, with a prompt longer than a KV block); and the model."""
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, seed=0, device="cpu", tokenizer="bytes", **options)
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
    outs = llm.generate(PROMPTS, [params, params, SamplingParams(max_tokens=3, temperature=0.0, logprobs=3)])
    got = [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs
    ]
    return got, llm.engine.executor.worker.model


@pytest.mark.parametrize(
    "variant", ["llama-gqa", "qwen2-bias", "qwen3-qknorm", "mixtral-moe", "qwen2-moe-shared", "qwen3-moe-dense-mixed"]
)
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_plan_computes_what_the_op_by_op_forward_computes(tmp_path, variant, quantization):
    """Plain Llama, q/k/v biases, q/k norms, MoEs (softmax top-k, a sigmoid-gated shared expert,
    dense layers between sparse ones), bf16 and int4 weights: the same tokens and logprobs."""
    build(variant, tmp_path)
    planned, model = _generate(tmp_path, quantization=quantization)
    assert model._plan is not None and model._plan.plan.num_layers() == len(model.model.layers)
    # every variant's layers run on raw rows (run_rows: no allocation or dispatcher between the
    # attention's and dense MLPs' matmuls; an MoE's routing and experts on tensors in between)
    assert model._plan.plan.runs_on_rows()
    eager, eager_model = _generate(tmp_path, quantization=quantization, enforce_eager=True)
    assert eager_model._plan is None  # --enforce-eager: never a plan
    assert planned == eager


def test_a_file_whose_qkv_keeps_two_formats_plans_each_part(tmp_path):
    """A Q4_K_M-style layer: q/k in Q4_K and v in Q6_K, one packed part each, joined as the
    Python forward joins them (batches of 3 rows and 1: each part's columns of a wider output)."""
    from .gguf_files import q4_k_m_style_llama

    path = q4_k_m_style_llama(tmp_path)
    planned, model = _generate(path)
    assert len(model.model.layers[0].self_attn.qkv_proj.parts) == 2
    assert model._plan is not None
    assert model._plan.plan.runs_on_rows()  # each part writes its columns of the step's qkv rows
    eager, _ = _generate(path, enforce_eager=True)
    assert planned == eager


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_the_quantized_kv_write_is_the_torch_write(kind, head_dim):
    """write_kv_quant_ (the plan's write into an int8/fp8 pool) stores the codes and scales
    kv/cache.py's quantize and index_copy_ store: groups of 32 (one group where the head is not
    a multiple), rows strided as views into qkv are, a zero group, values far apart."""
    from ridge.kv.cache import KVCacheSpec, allocate
    from ridge.layers.attention import write_slots
    from ridge.layers.cpu_kernels import load_extension

    ext = load_extension()
    torch.manual_seed(0)
    heads, tokens = 3, 5
    wide = torch.randn(tokens, 2 * heads * head_dim) * torch.logspace(-3, 2, tokens).unsqueeze(1)
    wide[1, : head_dim // 2] = 0.0  # a zero group (its scale 0, its codes 0)
    x = wide.bfloat16()[:, heads * head_dim :].view(tokens, heads, head_dim)  # strided rows
    slots = torch.tensor([7, 0, 12, 3, 31])
    spec = KVCacheSpec(1, heads, head_dim)
    (want,) = allocate(spec, 2, 16, torch.bfloat16, torch.device("cpu"), kind)
    (got,) = allocate(spec, 2, 16, torch.bfloat16, torch.device("cpu"), kind)
    write_slots(want.k, want.k_scale, x, slots, kind)
    ext.write_kv_quant_(got.k, got.k_scale, x, slots, kind == "fp8")
    codes = lambda cache: cache.k.view(-1, heads, head_dim).view(torch.uint8)[slots]  # noqa: E731
    scales = lambda cache: cache.k_scale.view(-1, heads, cache.k_scale.shape[-1])[slots]  # noqa: E731
    assert torch.equal(codes(got), codes(want))
    assert torch.equal(scales(got).view(torch.int16), scales(want).view(torch.int16))


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-moe-shared"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_plan_writes_and_reads_a_quantized_kv_cache_as_op_by_op_does(tmp_path, variant, kind):
    build(variant, tmp_path)
    planned, model = _generate(tmp_path, kv_cache_dtype=kind)
    assert model._plan is not None
    assert model._plan.plan.runs_on_rows()  # raw rows over the 1-byte pools too
    eager, _ = _generate(tmp_path, kv_cache_dtype=kind, enforce_eager=True)
    assert planned == eager


@pytest.mark.parametrize("variant", ["mixtral-moe", "qwen2-moe-shared"])
def test_a_bf16_exact_router_is_held_in_bf16_and_routes_as_in_float32(tmp_path, variant, monkeypatch):
    from ridge.layers.kernels import CpuKernels

    assert_bf16_router_routes_as_float32(tmp_path, variant, _generate, CpuKernels, monkeypatch)


def test_an_moe_router_of_another_width_is_refused(tmp_path):
    """set_moe checks the router's type and width against the layer before it keeps it."""
    build("mixtral-moe", tmp_path)
    _, model = _generate(tmp_path)
    plan, ops = model._plan.plan, model.kernels
    moe = model.model.layers[0].block_sparse_moe
    gate_up, down = ops.plan_experts(moe.experts.gate_up_proj), ops.plan_experts(moe.experts.down_proj)
    for router in (moe.gate.weight[:, :16].contiguous(), moe.gate.weight.half()):
        with pytest.raises(RuntimeError, match="float32 or bf16 \\(experts, hidden\\) router"):
            plan.set_moe(router, *moe.gate.route_args(), gate_up, down)


@pytest.mark.parametrize(
    "options",
    [{"kernels": "torch"}, {"dtype": "float32"}],
    ids=["torch-kernels", "float32"],
)
def test_what_the_plan_does_not_cover_runs_op_by_op(tmp_path, options):
    build("llama-gqa", tmp_path)
    llm = LLM(
        str(tmp_path), **{"dtype": "bfloat16", "num_kv_blocks": 64, "device": "cpu", "tokenizer": "bytes", **options}
    )
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    model = llm.engine.executor.worker.model
    assert model._plan_key is not None and model._plan is None  # asked for, and declined


def test_the_telemetry_times_the_matmuls_of_planned_and_eager_steps(tmp_path):
    """On CPU each step records its matmul seconds; the report says what the steps spent
    outside them."""
    build("llama-gqa", tmp_path)
    for eager in (False, True):
        llm = LLM(
            str(tmp_path), dtype="bfloat16", num_kv_blocks=64, device="cpu", tokenizer="bytes", enforce_eager=eager
        )
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
        records = list(llm.engine.telemetry.recent)
        assert records and all(r.matmul_s is not None and 0 < r.matmul_s < r.wall_s for r in records)
        decode = llm.engine.telemetry.report()["phases"]["decode"]
        assert decode["matmul_steps"] == decode["steps"] == 5
        assert "outside matmuls" in llm.engine.telemetry.format()


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_telemetry_times_a_planned_steps_ops_by_kind(tmp_path, quantization):
    """The plan times its ops by kind and the block formats' matmul its setup and waiting
    threads: each decode step's telemetry holds them (bf16 weights: no block-format matmul)."""
    build("qwen3-moe-dense-mixed", tmp_path)
    llm = LLM(
        str(tmp_path), dtype="bfloat16", num_kv_blocks=64, device="cpu", tokenizer="bytes", quantization=quantization
    )
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.executor.worker.model._plan is not None
    assert_step_parts_timed(llm, matmul_parts=quantization is not None)


@pytest.mark.parametrize("variant", ["deepseek-v2-lite", "deepseek-v3-yarn"])
@pytest.mark.parametrize("quantization,kv", [(None, "auto"), ("int4", "auto"), (None, "int8"), (None, "fp8")])
def test_deepseek_latent_attention_and_grouped_routers_plan_as_they_run(tmp_path, variant, quantization, kv):
    """DeepSeek's layers in the plan, on raw rows: latent attention absorbed (16 heads: the shared-KV decode
    kernels; with and without q_lora_rank; rotary pairs interleaved, YaRN), a bf16, int8 or fp8
    latent cache, group-limited (V2, softmax) and noaux_tc (V3, sigmoid + bias) routers, shared
    experts and a dense first layer: the same tokens and logprobs as op by op. int4 weights
    absorb W_uk and W_uv in block formats (head_matmul_quant)."""
    save_latent_model(variant, tmp_path)
    options = dict(quantization=quantization, kv_cache_dtype=kv)
    planned, model = _generate(tmp_path, **options)
    assert model._plan is not None and model._plan.plan.num_layers() == len(model.model.layers)
    assert model._plan.plan.runs_on_rows()  # latent attention and grouped routing on raw rows too
    absorbed = model.model.layers[0].self_attn.absorbed
    assert all(isinstance(w, torch.Tensor) != (quantization == "int4") for w in absorbed)
    eager, _ = _generate(tmp_path, enforce_eager=True, **options)
    assert planned == eager


def test_deepseek_with_fewer_than_16_heads_runs_op_by_op(tmp_path):
    """4 heads: forward() takes the per-head decode path, which the plan does not hold."""
    build("deepseek-v2-lite", tmp_path)
    _, model = _generate(tmp_path)
    assert model._plan is None


def test_the_plan_refuses_an_index_outside_the_pools_before_touching_anything(tmp_path):
    """Checked before any layer runs (plan_shared.h's check_step, as the AVX2 plan's);
    rope_bf16_ checks its positions alike."""
    from ridge.layers.cpu_kernels import load_extension

    build("llama-gqa", tmp_path)
    _, model = _generate(tmp_path)
    rotary = model.model.rotary
    assert_refuses_bad_indices(model._plan.plan, rotary, COMMON["hidden_size"], "decode plan")
    x = torch.ones(1, 2, rotary.cos.shape[1], dtype=torch.bfloat16)
    end = rotary.cos.shape[0]
    with pytest.raises(RuntimeError, match=f"rope: position {end} is outside the tables"):
        load_extension().rope_bf16_(x, torch.tensor([end]), rotary.cos, rotary.sin)
    assert torch.equal(x, torch.ones_like(x))
