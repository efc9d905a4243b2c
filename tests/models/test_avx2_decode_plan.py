"""The AVX2 decode plan (``csrc/avx2_plan.cpp``, ``Avx2Kernels.decode_plan``): a bf16 decode
step's Llama layers, dense or MoE, and DeepSeek's latent attention (its per-head matrices in a
block format or bf16 rows) in one call computes what the op-by-op forward on the same kernels
computes, bit for bit (bf16, int8 and fp8 KV caches); what it does not cover (latent attention
with fewer than 16 heads, float32) runs op by op, and a step the Python path would send
elsewhere is declined and runs op by op.

The AVX2 kernels run on every x86 CPU with AVX2 (an AVX-512 one too): each test here picks
them as a CPU without AVX-512 would."""

from __future__ import annotations

import pytest
import torch
import transformers

from ridge import LLM, SamplingParams
from ridge.layers import cpu_kernels
from ridge.layers.kernels import Avx2Kernels
from ridge.layers.linear import Linear
from ridge.models import llama

from .hf_tiny import COMMON, build
from .plan_cases import (
    assert_bf16_router_routes_as_float32,
    assert_refuses_bad_indices,
    assert_step_parts_timed,
    save_latent_model,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_has_avx2(), reason="this CPU has no AVX2 + FMA + F16C")

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [3]]


@pytest.fixture(autouse=True)
def avx2_alone(monkeypatch):
    """ridge's kernel choice as on a CPU with AVX2 and no AVX-512 BF16."""
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c"})


@pytest.fixture
def plan_runs(monkeypatch):
    """What each DecodePlanRun.run returned (True: the plan ran the step; False: declined)."""
    runs = []
    run = llama.DecodePlanRun.run

    def recorded(self, *args):
        runs.append(run(self, *args))
        return runs[-1]

    monkeypatch.setattr(llama.DecodePlanRun, "run", recorded)
    return runs


def _generate(path, prompts=PROMPTS, **options):
    """Greedy tokens and their top-3 logprobs for a batch of three (decode steps of 3, then 2
    rows, with a prompt longer than a KV block), or of ``prompts``; and the model."""
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, seed=0, device="cpu", tokenizer="bytes", **options)
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
    last = SamplingParams(max_tokens=3, temperature=0.0, logprobs=3)
    outs = llm.generate(prompts, [params] * (len(prompts) - 1) + [last], use_tqdm=False)
    got = [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs
    ]
    model = llm.engine.executor.worker.model
    assert isinstance(model.kernels, Avx2Kernels)
    return got, model


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("quantization", [None, "int4", "q4_k", "q6_k", "int8"])
def test_the_plan_computes_what_the_op_by_op_forward_computes(tmp_path, variant, quantization, plan_runs):
    """Plain Llama, q/k/v biases, q/k norms; dense bf16 weights, blocks of 8 rows (Q4_0, Q4_K)
    and GGUF rows (Q6_K, Q8_0): the same tokens and logprobs."""
    build(variant, tmp_path)
    planned, model = _generate(tmp_path, quantization=quantization)
    assert model._plan is not None and model._plan.plan.num_layers() == len(model.model.layers)
    assert plan_runs and all(plan_runs)  # every decode step through the plan
    eager, eager_model = _generate(tmp_path, quantization=quantization, enforce_eager=True)
    assert eager_model._plan is None
    assert planned == eager


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-qknorm"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_plan_writes_and_reads_a_quantized_kv_cache_as_op_by_op_does(tmp_path, variant, kind, plan_runs):
    """The plan quantizes each step's K/V into the pools as kv/cache.py's write does and reads
    the codes with the kernel decode_attention runs: the same tokens and logprobs."""
    build(variant, tmp_path)
    planned, model = _generate(tmp_path, quantization="int4", kv_cache_dtype=kind)
    assert model._plan is not None and plan_runs and all(plan_runs)
    eager, _ = _generate(tmp_path, quantization="int4", kv_cache_dtype=kind, enforce_eager=True)
    assert planned == eager


def test_a_file_whose_qkv_keeps_two_formats_plans_each_part(tmp_path, plan_runs):
    """A Q4_K_M-style layer: q/k in Q4_K (blocks of 8 rows) and v in Q6_K (GGUF rows), each part
    into its columns of the step's qkv rows, joined as the Python forward joins them."""
    from .gguf_files import q4_k_m_style_llama

    path = q4_k_m_style_llama(tmp_path)
    planned, model = _generate(path)
    assert len(model.model.layers[0].self_attn.qkv_proj.parts) == 2
    assert model._plan is not None and plan_runs and all(plan_runs)
    eager, _ = _generate(path, enforce_eager=True)
    assert planned == eager


def test_a_step_the_python_path_sends_to_torch_is_declined(tmp_path, plan_runs):
    """Eight query heads on one KV head: with fewer (sequence, KV head) jobs than threads,
    Avx2Kernels.decode_attention gives way to torch's GEMMs, so the plan declines those steps
    (one sequence on 2 threads) and runs the others (2 or 3); the tokens are op by op's."""
    config = transformers.LlamaConfig(
        **{**COMMON, "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 1}
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # decode_attention and the plan both ask this
    try:
        planned, model = _generate(tmp_path, quantization="int4")
        assert model._plan is not None and plan_runs and all(plan_runs)
        plan_runs.clear()
        alone, model = _generate(tmp_path, [PROMPTS[1]], quantization="int4")
        assert model._plan is not None and plan_runs and not any(plan_runs)
        # a greedy run of such rows is declined too, before anything moves
        plan, rotary = model._plan.plan, model.model.rotary
        h = torch.ones(1, 128, dtype=torch.bfloat16)
        slots, table, lens, positions = (
            torch.tensor([5]),
            torch.zeros(1, 4, dtype=torch.long),
            torch.tensor([6]),
            torch.tensor([5]),
        )
        assert plan.has_head() and plan.run_greedy(h, slots, table, lens, positions, rotary.cos, rotary.sin, 4) is None
        assert slots.tolist() == [5] and lens.tolist() == [6] and positions.tolist() == [5]
        eager, _ = _generate(tmp_path, quantization="int4", enforce_eager=True)
        eager_alone, _ = _generate(tmp_path, [PROMPTS[1]], quantization="int4", enforce_eager=True)
    finally:
        torch.set_num_threads(threads)
    assert planned == eager and alone == eager_alone


@pytest.mark.parametrize("variant", ["mixtral-moe", "qwen2-moe-shared", "qwen3-moe-dense-mixed"])
@pytest.mark.parametrize("quantization", [None, "int4", "q4_k", "q6_k"])
def test_the_plan_runs_moe_layers_as_the_op_by_op_forward_does(tmp_path, variant, quantization, plan_runs):
    """Mixtral's experts, Qwen2-MoE's sigmoid-gated shared expert, Qwen3-MoE with dense layers
    among the sparse ones; dense bf16 experts, blocks of 8 rows (Q4_0, Q4_K) and GGUF rows
    (Q6_K): the router kernel, each expert's rows through its slices and the weighted sum, in
    one call, with the same tokens, logprobs and experts read as op by op."""
    build(variant, tmp_path)
    planned, model = _generate(tmp_path, quantization=quantization)
    assert model._plan is not None and plan_runs and all(plan_runs)
    moes = [m for m in model._plan.moes if m is not None]
    assert moes and all(m.experts_touched > 0 for m in moes)
    touched = [m.experts_touched for m in moes]
    eager, eager_model = _generate(tmp_path, quantization=quantization, enforce_eager=True)
    assert eager_model._plan is None
    assert planned == eager
    eager_moes = [getattr(layer, layer.ffn_name) for layer in eager_model.model.layers]
    assert touched == [m.experts_touched for m in eager_moes if hasattr(m, "experts_touched")]


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_telemetry_times_a_planned_steps_ops_by_kind(tmp_path, quantization, plan_runs):
    """The AVX2 plan times its ops by kind as the AVX-512 one does (its matmuls have no
    setup or wait parts): each decode step's telemetry holds them."""
    build("qwen3-moe-dense-mixed", tmp_path)
    llm = LLM(
        str(tmp_path), dtype="bfloat16", num_kv_blocks=64, device="cpu", tokenizer="bytes", quantization=quantization
    )
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert plan_runs and all(plan_runs)
    assert_step_parts_timed(llm, matmul_parts=False)


@pytest.mark.parametrize("variant", ["deepseek-v2-lite", "deepseek-v3-yarn"])
@pytest.mark.parametrize("quantization,kv", [(None, "auto"), ("int4", "auto"), ("int4", "int8"), (None, "fp8")])
def test_deepseek_latent_attention_plans_as_it_runs(tmp_path, variant, quantization, kv, plan_runs):
    """DeepSeek's layers in the plan: latent attention with and without q_lora_rank, rotary
    pairs interleaved, YaRN, a bf16, int8 or fp8 latent cache, 16 heads on the one latent (the
    kernel splits them over the threads at one sequence), the routers and shared experts; the
    per-head matrices stacked, each head's rows through them as grouped_linear runs them (bf16
    rows, or at int4 W_uk^T in Q8_0 rows and W_uv in blocks of 8 rows): the same tokens and
    logprobs as op by op."""
    save_latent_model(variant, tmp_path)
    options = dict(quantization=quantization, kv_cache_dtype=kv)
    planned, model = _generate(tmp_path, **options)
    assert model._plan is not None and model._plan.plan.num_layers() == len(model.model.layers)
    assert plan_runs and all(plan_runs)
    absorbed = model.model.layers[0].self_attn.absorbed
    assert all(isinstance(w, Linear) for w in absorbed)  # stacked heads
    assert all((w.method.format is None) == (quantization is None) for w in absorbed)
    eager, eager_model = _generate(tmp_path, enforce_eager=True, **options)
    assert eager_model._plan is None
    assert planned == eager


def test_a_latent_pool_takes_the_kernel_with_fewer_jobs_than_threads(tmp_path, plan_runs):
    """One sequence on 4 threads: the 16 heads on the one latent split into 2 jobs, fewer than
    the threads, where a Llama attention of 8+ heads a KV head gives way to torch's GEMMs. A
    latent pool keeps the kernel (torch's path gathers it twice), so the plan runs every step,
    and op by op computes the same tokens."""
    save_latent_model("deepseek-v3-yarn", tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        planned, model = _generate(tmp_path, [PROMPTS[1]], quantization="int4")
        assert model.kernels.ext.decode_attention_jobs(1, 16, 1) == 2
        assert model._plan is not None and plan_runs and all(plan_runs)
        eager, _ = _generate(tmp_path, [PROMPTS[1]], quantization="int4", enforce_eager=True)
    finally:
        torch.set_num_threads(threads)
    assert planned == eager


@pytest.mark.parametrize(
    "variant,options",
    [("deepseek-v2-lite", {}), ("llama-gqa", {"dtype": "float32"})],
    ids=["latent-attention-4-heads", "float32"],
)
def test_what_the_plan_does_not_cover_runs_op_by_op(tmp_path, variant, options):
    build(variant, tmp_path)
    llm = LLM(
        str(tmp_path), **{"dtype": "bfloat16", "num_kv_blocks": 64, "device": "cpu", "tokenizer": "bytes", **options}
    )
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    model = llm.engine.executor.worker.model
    assert isinstance(model.kernels, Avx2Kernels)
    assert model._plan_key is not None and model._plan is None  # asked for, and declined


def test_the_plan_refuses_an_index_outside_the_pools_before_touching_anything(tmp_path):
    build("llama-gqa", tmp_path)
    _, model = _generate(tmp_path, quantization="int4")
    assert_refuses_bad_indices(model._plan.plan, model.model.rotary, COMMON["hidden_size"], "AVX2 decode plan")


@pytest.mark.parametrize("variant", ["mixtral-moe", "qwen2-moe-shared"])
def test_a_bf16_exact_router_is_held_in_bf16_and_routes_as_in_float32(tmp_path, variant, monkeypatch):
    assert_bf16_router_routes_as_float32(tmp_path, variant, _generate, Avx2Kernels, monkeypatch)


def test_an_moe_the_plan_cannot_hold_is_refused_with_a_clear_error(tmp_path):
    """set_moe checks the router and each stacked projection against the layer before it keeps
    anything: a router of another width, experts whose rows do not match, a shared expert
    without an MoE."""
    build("mixtral-moe", tmp_path)
    _, model = _generate(tmp_path, quantization="int4")
    plan, ops = model._plan.plan, model.kernels
    moe = model.model.layers[0].block_sparse_moe
    gate_up, down = ops.plan_experts(moe.experts.gate_up_proj), ops.plan_experts(moe.experts.down_proj)
    args = moe.gate.route_args()
    with pytest.raises(RuntimeError, match="float32 or bf16 \\(experts, hidden\\) router"):
        plan.set_moe(moe.gate.weight[:, :16].contiguous(), *args, gate_up, down)
    with pytest.raises(RuntimeError, match="do not match a weight"):
        plan.set_moe(moe.gate.weight, *args, (gate_up[0][:-8], *gate_up[1:]), down)
    with pytest.raises(RuntimeError, match="top_k of 4 experts"):
        plan.set_moe(moe.gate.weight, 5, *args[1:], gate_up, down)
    fresh = ops.decode_plan()
    with pytest.raises(RuntimeError, match="set_shared_expert before set_moe"):
        fresh.set_shared_expert([], [], None)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-moe-shared"])
def test_greedy_multi_step_runs_are_one_call_of_the_plan(tmp_path, variant, monkeypatch):
    """--num-scheduler-steps with greedy rows: each run is one call of the plan (its passes'
    final norm, lm_head, argmax and next embedding in C++), with the single-step engine's
    tokens; a run whose rows the plan declines (here: none) would run its passes from Python."""
    build(variant, tmp_path)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [3], [40, 41]]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (13, 6, 21, 9)]

    def tokens(**options):
        llm = LLM(
            str(tmp_path),
            dtype="bfloat16",
            num_kv_blocks=64,
            block_size=4,
            seed=0,
            device="cpu",
            tokenizer="bytes",
            quantization="int4",
            **options,
        )
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = tokens()
    in_one_call = []
    greedy = llama.LlamaForCausalLM.decode_greedy

    def counted(self, *args):
        out = greedy(self, *args)
        in_one_call.append(out is not None)
        return out

    monkeypatch.setattr(llama.LlamaForCausalLM, "decode_greedy", counted)
    assert tokens(num_scheduler_steps=8) == want
    assert in_one_call and all(in_one_call)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_prompt_prefilled_in_chunks_computes_what_one_chunk_computes(tmp_path, kv_cache_dtype):
    """Prefill attention runs each query as a decode of its own (Avx2Kernels.prefill_attention):
    a prompt prefilled in chunks of 4 tokens, or in one, gives the same tokens and logprobs."""
    build("llama-gqa", tmp_path)
    whole, _ = _generate(tmp_path, quantization="int4", kv_cache_dtype=kv_cache_dtype)
    chunked, _ = _generate(
        tmp_path, quantization="int4", kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=4, max_num_seqs=4
    )
    assert chunked == whole
