"""Asynchronous scheduling (``--async-scheduling``): the next step is scheduled and launched
before the last one's tokens are back, and every request's outputs equal the synchronous
engine's: tokens, logprobs, text, finish reasons, under stops that come a step late, length
limits, prefix-cache hits, chunked prefill, preemption, seeded sampling and aborts."""

from __future__ import annotations

import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.worker import runner as runner_module

from ..models.hf_tiny import build
from .same_outputs import same


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-async")
    build("llama-gqa", directory, seed=5)
    return directory


def _llm(model_dir, asynchronous: bool, **options) -> LLM:
    options = {"block_size": 4, "num_kv_blocks": 256, "dtype": "float32", "device": "cpu", **options}
    return LLM(str(model_dir), tokenizer="bytes", seed=0, async_scheduling=asynchronous, **options)


def _workload():
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 250, (9,), generator=gen).tolist()  # a prefix several prompts share
    prompts, params = [], []
    for i in range(14):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        tail = torch.randint(3, 250, (n,), generator=gen).tolist()
        prompts.append(shared + tail if i % 3 == 0 else tail)
        max_tokens = int(torch.randint(1, 20, (1,), generator=gen))
        if i % 4 == 0:  # seeded sampling with logprobs
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=max_tokens, logprobs=2))
        elif i % 4 == 1:  # a stop token id that greedy decoding meets (found below), a step late
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[]))
        elif i % 4 == 2:  # (one with its prompt's logprobs: that step reads its results at launch)
            prompt_logprobs = 1 if i == 2 else None
            params.append(
                SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, prompt_logprobs=prompt_logprobs
                )
            )
        else:  # unseeded sampling: the engine's generator, drawn in the same order
            params.append(SamplingParams(temperature=0.7, top_k=20, max_tokens=max_tokens, n=2))
    return prompts, params


def _summary(outputs, params=None):
    """Each completion's tokens, text, finish and logprobs (compared within 1e-5 by ``same``:
    a step's batch, wider by the sequences that stopped a step earlier, may change the float32
    matmul's last bits). Unseeded sampling draws from the engine's generator, whose draws depend on the
    batch as they do in vLLM: only its finish is compared."""
    summary = []
    for i, out in enumerate(outputs):
        unseeded = params is not None and params[i].temperature > 0 and params[i].seed is None
        rows = []
        for c in out.outputs:
            if unseeded:
                rows.append(c.finish_reason in ("stop", "length") and len(c.token_ids) <= params[i].max_tokens)
                continue
            lps = [sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in c.logprobs or []]
            rows.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
        if out.prompt_logprobs:
            rows.append([sorted((t, lp.logprob) for t, lp in d.items()) for d in out.prompt_logprobs if d])
        summary.append(rows)
    return summary


def _with_stops(llm_sync, prompts, params):
    """Give the stop-token requests a token their greedy output reaches midway."""
    probe = llm_sync.generate(prompts, [p if p.temperature else SamplingParams(max_tokens=20) for p in params])
    for p, out in zip(params, probe):
        if p.stop_token_ids == [] and len(out.outputs[0].token_ids) > 2:
            p.stop_token_ids = [out.outputs[0].token_ids[len(out.outputs[0].token_ids) // 2]]
    return params


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill beside decodes
        {"num_kv_blocks": 24, "max_num_seqs": 8},  # preemptions
        {"enable_prefix_caching": False, "max_model_len": 40},  # the context limit ends requests
    ],
    ids=["plain", "chunked", "preempting", "context-limit"],
)
def test_async_outputs_equal_synchronous_ones(model_dir, monkeypatch, options):
    sync = _llm(model_dir, False, **options)
    prompts, params = _workload()
    params = _with_stops(sync, prompts, params)
    want = _summary(sync.generate(prompts, params, use_tqdm=False), params)

    fed = []  # rows whose token the device fed (the previous step was still out)
    prepare = runner_module.ModelRunner.prepare
    monkeypatch.setattr(
        runner_module.ModelRunner,
        "prepare",
        lambda self, chunks: fed.extend(c for c in chunks if c.deferred is not None) or prepare(self, chunks),
    )
    asynchronous = _llm(model_dir, True, **options)
    got = _summary(asynchronous.generate(prompts, params, use_tqdm=False), params)
    assert same(got, want)
    assert len(fed) > 20  # it did pipeline
    engine = asynchronous.engine
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.kv.pool.num_free_blocks == engine.num_kv_blocks  # every block back (cached ones too)
    if options.get("num_kv_blocks") == 24:
        assert engine.scheduler.num_preemptions > 0
    # a second batch on the same engine: nothing left over from the first
    assert same(_summary(asynchronous.generate(prompts[:3], params[:3], use_tqdm=False), params), want[:3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: tokens fed on the GPU, read from pinned copies")
def test_async_outputs_equal_synchronous_ones_on_cuda(model_dir):
    """On a GPU the launched step's tokens reach the host through pinned copies and an event
    while the next step runs (CUDA graphs on): the same outputs (logprobs within 1e-3: the
    GPU's float32 matmuls change more with the batch's width than the CPU's)."""
    sync = _llm(model_dir, False, device="cuda")
    prompts, params = _workload()
    params = _with_stops(sync, prompts, params)
    want = _summary(sync.generate(prompts, params, use_tqdm=False), params)
    got = _summary(_llm(model_dir, True, device="cuda").generate(prompts, params, use_tqdm=False), params)
    assert same(got, want, tol=1e-3)


def test_requests_that_need_every_token_run_synchronously(model_dir):
    """Penalties and min_tokens read the whole output: their steps wait for each token (the
    other requests' outputs are unchanged too)."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=9, min_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7),
    ]
    want = _summary(_llm(model_dir, False).generate(prompts, params, use_tqdm=False))
    assert same(_summary(_llm(model_dir, True).generate(prompts, params, use_tqdm=False)), want)


def test_abort_while_a_step_is_out(model_dir):
    llm = _llm(model_dir, True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9, 10], params)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 4:
            engine.abort_request("a")
    assert set(finished) == {"a", "b"} or set(finished) == {"b"}
    assert len(finished["b"].outputs[0].token_ids) == 30
    alone = _llm(model_dir, False).generate([[8, 9, 10]], params, use_tqdm=False)[0]
    assert finished["b"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.kv.pool.num_free_blocks == engine.num_kv_blocks and not engine.scheduler.requests


def test_async_scheduling_refuses_what_it_cannot_pipeline():
    from ridge.config import EngineConfig

    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)


def test_async_scheduling_is_on_by_default_on_cuda_only_where_it_applies(monkeypatch):
    """vLLM's default: on where it applies on CUDA (an explicit False turns it off); off on the
    CPU, whose step has nothing on the host to overlap; off, not an error, with KV transfer or
    tensor parallelism unless asked for."""
    from ridge.config import EngineConfig
    from ridge.engine.args import add_engine_args, engine_options

    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert EngineConfig(device="cpu").async_scheduling is False
    assert EngineConfig(device="cpu", async_scheduling=True).async_scheduling is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig().async_scheduling is True  # auto -> CUDA
    assert EngineConfig(device="cuda:0").async_scheduling is True
    assert EngineConfig(device="cuda", async_scheduling=False).async_scheduling is False
    assert EngineConfig(speculative_config=ngram).async_scheduling is True  # its plain steps pipeline
    assert EngineConfig(tensor_parallel_size=2, device="cpu").async_scheduling is False
    assert EngineConfig(kv_transfer_config={"kv_role": "kv_producer"}).async_scheduling is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().async_scheduling is False  # auto -> CPU

    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, want in [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)]:
        assert engine_options(parser.parse_args(["--model", "m", *argv]))["async_scheduling"] is want


def test_speculation_pipelines_the_steps_it_drafts_nothing_for(model_dir, monkeypatch):
    """n-gram speculation with asynchronous scheduling: the steps its policy drafts nothing
    for run pipelined, its verify steps synchronously, switching back and forth; the greedy
    outputs are the plain engine's."""
    from ridge.spec_decode.policy import SpeculationPolicy

    gen = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(6):  # repeated phrases: prompt lookup finds drafts
        phrase = torch.randint(3, 250, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
        prompts.append(phrase * (2 + i % 3))
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)
    want = _summary(_llm(model_dir, False).generate(prompts, params, use_tqdm=False))

    calls = []

    def alternating(self, batch, context):  # 3 drafts for three decisions, then none for three
        calls.append(batch)
        return 3 if (len(calls) // 3) % 2 == 0 else 0

    monkeypatch.setattr(SpeculationPolicy, "choose_k", alternating)
    fed = []
    prepare = runner_module.ModelRunner.prepare
    monkeypatch.setattr(
        runner_module.ModelRunner,
        "prepare",
        lambda self, chunks: fed.extend(c for c in chunks if c.deferred is not None) or prepare(self, chunks),
    )
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    spec = _llm(model_dir, True, speculative_config=ngram)
    got = _summary(spec.generate(prompts, params, use_tqdm=False))
    assert same(got, want)
    assert len(fed) > 5  # pipelined steps
    assert spec.engine.speculator.stats.num_verify_runs > 5  # and verify steps
    assert not spec.engine.has_unfinished_requests() and not spec.engine.scheduler.requests


def test_a_lookup_that_finds_nothing_costs_no_synchronous_step(model_dir, monkeypatch):
    """n-gram speculation on texts where prompt lookup finds nothing, asynchronous: the engine
    looks between pipelined steps (``Speculator.peek``, on the tokens collected so far) instead
    of ending the pipeline to find out, so every step runs pipelined, as the plain engine's; the
    peeks teach the policy the drafted share. Texts that repeat end it for verify steps."""
    from ridge.engine.engine import LLMEngine
    from ridge.spec_decode.policy import SpeculationPolicy

    # a policy that would always draft (as the roofline's prior does on a GPU, where verify
    # rows look free), so only what lookup finds decides
    monkeypatch.setattr(SpeculationPolicy, "choose_k", lambda self, batch, context: 3)
    gen = torch.Generator().manual_seed(5)
    fresh = [torch.randperm(240, generator=gen)[:n].add(3).tolist() for n in (7, 12, 20)]  # no token twice
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    spec = _llm(model_dir, True, speculative_config=ngram)
    want = _summary(_llm(model_dir, True).generate(fresh, params, use_tqdm=False))
    synchronous = []  # per synchronous step: whether it had drafts to verify
    step_sync = LLMEngine._step_sync

    def counted(self):
        synchronous.append(any(r.spec_token_ids for r in self.scheduler.running))
        return step_sync(self)

    monkeypatch.setattr(LLMEngine, "_step_sync", counted)
    lookups = []
    peek = type(spec.engine.speculator).peek
    monkeypatch.setattr(type(spec.engine.speculator), "peek", lambda self, d: lookups.append(len(d)) or peek(self, d))
    got = _summary(spec.generate(fresh, params, use_tqdm=False))
    assert same(got, want)
    speculator = spec.engine.speculator
    # no synchronous step but to verify drafts (the tiny model's greedy text repeats a bigram
    # now and then): none spent finding that lookup finds nothing (12 before the peeks)
    assert all(synchronous) and len(synchronous) <= speculator.stats.num_verify_runs
    assert len(lookups) > 5 and speculator.policy.coverage < 0.5

    repeated = [[7, 8, 9, 10] * 4, [20, 21, 22] * 5]
    synchronous.clear()
    got = _summary(spec.generate(repeated, params, use_tqdm=False))
    assert same(got, _summary(_llm(model_dir, True).generate(repeated, params, use_tqdm=False)))
    assert synchronous and all(synchronous) and speculator.stats.num_verify_runs > 3
