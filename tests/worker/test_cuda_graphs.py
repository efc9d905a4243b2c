"""CUDA graphs for decode steps (``worker/cuda_graphs.py``). Where there is no GPU the same
padded forward runs from the same persistent buffers without a graph (``capture=False``) on
``CudaKernels`` through Triton's interpreter: padding rows must leave every real row's tokens,
logprobs and KV cache as an unpadded step leaves them. On a GPU the graphs are captured and
replayed for real."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, in its interpreter (tests/conftest.py sets it)

from ridge import LLM, SamplingParams
from ridge.layers import triton_kernels as tk
from ridge.layers.cuda_kernels import CudaKernels, _gemv_key
from ridge.layers.linear import Linear
from ridge.worker.cuda_graphs import DecodeGraphs, capture_sizes, unsupported_reason

from ..models.hf_tiny import build

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# a short prompt (decode rows on CudaKernels), two longer than a block (one prefill launch
# for both), one token
PROMPTS = [[5, 6, 7], list(range(9, 26)), [3], list(range(40, 60))]


def test_the_ladder_is_vllms():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert capture_sizes(4) == [1, 2, 4, 8]
    assert capture_sizes(1) == [1, 2]
    # speculating k tokens: a step of verify runs has up to max_num_seqs * (1 + k) rows
    assert capture_sizes(64, 4)[-5:] == [256, 272, 288, 304, 320]
    assert capture_sizes(4, 4) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256, 4)[-1] == 512


def _run(path, graphs: bool, cuda_kernels: bool = True, prompts=PROMPTS, gemv=None, **options):
    """Greedy tokens and top-3 logprobs of four prompts (decode steps of 4 rows, then 3,
    padded to 4), on CudaKernels with or without the graphs' padded buffers (or on the
    reference kernels: ``cuda_kernels`` False). ``gemv``: a Triton GEMV config every dense
    layer's one-row steps take (without a GPU; on one, ``tune_gemv`` chooses at capture)."""
    llm = LLM(
        str(path), dtype="float32", num_kv_blocks=64, seed=0, device=str(DEVICE), tokenizer="bytes", kernels="torch",
        enforce_eager=True, max_num_seqs=4, **options,
    )  # fmt: skip
    worker = llm.engine.executor.worker
    if cuda_kernels:
        worker.model.set_kernels(CudaKernels(DEVICE))
        assert unsupported_reason(worker.model, worker.model.kernels) is None
        if options.get("quantization"):  # the block-format kernel holds the layers' weights
            assert worker.model.model.layers[0].mlp.gate_up_proj.packed is not None
    if graphs:
        runner = worker.runner
        runner.graphs = DecodeGraphs(
            worker.model, runner.kv_caches, 16, 256, capture_sizes(4), DEVICE, capture=DEVICE.type == "cuda"
        )
        runner.graphs.capture()
        if gemv is not None and DEVICE.type != "cuda":
            kernels = worker.model.kernels
            for layer in worker.model.model.modules():
                if isinstance(layer, Linear):
                    kernels.gemv_configs[_gemv_key(layer.weight, layer.bias)] = gemv
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0.0, logprobs=3)
    outs = llm.generate(prompts, [params, params, short, params][: len(prompts)])
    if graphs:  # every decode step went through the buffers, the 3-row ones padded to 4
        assert worker.runner.graphs.replays >= 7
        assert worker.runner.graphs.padding_rows >= (5 if prompts is PROMPTS else 0)
    return [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs
    ]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "quantization"), [("auto", None), ("int8", None), ("auto", "int4"), ("auto", "int8")]
)
def test_padded_graph_steps_compute_what_eager_steps_compute(tmp_path, monkeypatch, kv_cache_dtype, quantization):
    build("llama-gqa", tmp_path)
    """... and both what the reference kernels compute (where the 3-token prompt runs as
    decode rows, and the 17-token one through prefill attention; Q4_0/Q8_0 weights through the
    block-format kernel)."""
    options = dict(kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    reference = _run(tmp_path, graphs=False, cuda_kernels=False, **options)
    launches = []  # the two long prompts' prefill: one launch per layer for both
    batched = tk.paged_prefill_attention
    monkeypatch.setattr(tk, "paged_prefill_attention", lambda *a, **kw: launches.append(1) or batched(*a, **kw))
    fused = []  # the graphs' RoPE and KV write in one launch, for a cache of the model's dtype
    rope_write_kv = tk.rope_write_kv_
    monkeypatch.setattr(tk, "rope_write_kv_", lambda *a: rope_write_kv(*a) and not fused.append(1))
    eager = _run(tmp_path, graphs=False, **options)
    assert not fused  # eager steps keep torch's RoPE and index_copy_
    padded = _run(tmp_path, graphs=True, **options)
    assert len(launches) == 2 * 2  # two runs, two layers
    assert (len(fused) >= 7 * 2) == (kv_cache_dtype == "auto") and (not fused) == (kv_cache_dtype != "auto")
    for run in (eager, padded):
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(run, reference):
            assert tokens == want_tokens
            for got, want in zip(logprobs, want_logprobs):
                assert got.keys() == want.keys()
                assert all(abs(got[t] - want[t]) < 1e-4 for t in want)


def test_one_row_graph_steps_through_the_triton_gemv_compute_what_cublas_computes(tmp_path, monkeypatch):
    """A batch of one: each dense layer through Triton's GEMV (forced here without a GPU; on
    one, as ``tune_gemv`` chose at capture), tokens and logprobs as the reference's."""
    build("llama-gqa", tmp_path)
    prompts = [PROMPTS[1]]
    reference = _run(tmp_path, graphs=False, cuda_kernels=False, prompts=prompts)
    calls = []
    gemv = tk.dense_gemv
    monkeypatch.setattr(tk, "dense_gemv", lambda *a: calls.append(1) or gemv(*a))
    got = _run(tmp_path, graphs=True, prompts=prompts, gemv=tk.GEMV_CONFIGS[1])
    if DEVICE.type != "cuda":  # 7 one-row steps of 2 layers, 4 dense layers each
        assert len(calls) == 7 * 2 * 4
    (tokens, logprobs), (want_tokens, want_logprobs) = got[0], reference[0]
    assert tokens == want_tokens
    for got_step, want in zip(logprobs, want_logprobs):
        assert got_step.keys() == want.keys() and all(abs(got_step[t] - want[t]) < 1e-4 for t in want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k", "bias"), [(37, 96, False), (64, 1000, True)])
def test_dense_gemv_matches_torch(dtype, n, k, bias):
    torch.manual_seed(0)
    x = torch.randn(1, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE)
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    for config in tk.GEMV_CONFIGS:
        got = tk.dense_gemv(x, w, b, config)
        err = (got.float() - want).norm() / want.norm()
        assert err < (1e-6 if dtype == torch.float32 else 2e-3), (config, err)
    assert tk.dense_gemv(x.expand(2, k), w, b, tk.GEMV_CONFIGS[0]) is None  # two rows: cuBLAS's


@pytest.mark.skipif(DEVICE.type != "cuda", reason="times CUDA graphs")
def test_tune_gemv_times_every_candidate_and_keeps_the_fastest():
    kernels = CudaKernels(DEVICE)
    layers = [Linear(512, 2048, bias=False) for _ in range(4)]
    for layer in layers:
        layer.weight.data = torch.randn(2048, 512, dtype=torch.bfloat16, device=DEVICE)
    report = kernels.tune_gemv(layers, rounds=2)
    ((key, times),) = report.items()
    assert key == (2048, 512, torch.bfloat16, False) and set(times) == {None, *tk.GEMV_CONFIGS}
    assert kernels.gemv_configs.get(key) == min(times, key=times.get)


def test_moe_and_other_kernels_are_not_captured(tmp_path):
    build("mixtral-moe", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, device="cpu", tokenizer="bytes", kernels="torch")
    model = llm.engine.executor.worker.model
    assert "kernels" in unsupported_reason(model, model.kernels)
    assert "MoE" in unsupported_reason(model, CudaKernels(torch.device("cpu")))


def test_the_capture_log_names_the_kernels_choice_not_the_fastest_time(tmp_path, caplog):
    """A Triton GEMV within the 2% margin of cuBLAS is not taken; the log says cuBLAS."""
    import logging

    build("llama-gqa", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, device="cpu", tokenizer="bytes", enforce_eager=True)
    worker = llm.engine.executor.worker
    kernels = CudaKernels(torch.device("cpu"))
    worker.model.set_kernels(kernels)
    graphs = DecodeGraphs(worker.model, worker.runner.kv_caches, 16, 64, [1, 2], DEVICE, capture=False)
    near, clear = (64, 32, torch.float32, False), (96, 32, torch.float32, False)

    def tune(layers):
        kernels.gemv_configs = {clear: tk.GEMV_CONFIGS[0]}
        return {near: {None: 10.0, tk.GEMV_CONFIGS[1]: 9.9}, clear: {None: 10.0, tk.GEMV_CONFIGS[0]: 8.0}}

    kernels.tune_gemv = tune
    with caplog.at_level(logging.INFO, logger="ridge.worker.cuda_graphs"):
        graphs.tune_gemv()
    assert "64x32 cuBLAS 10.0 us (cuBLAS 10.0)" in caplog.text
    assert f"96x32 Triton {tk.GEMV_CONFIGS[0]} 8.0 us (cuBLAS 10.0)" in caplog.text
