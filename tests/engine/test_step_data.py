"""The step as plain data: every plan of a mixed run (chunked prefill, prefix hits, forced
preemption, n-gram speculation, prompt logprobs, sampling with seeds and penalties) holds only
ids, numbers, params and tensors, crosses a pickle round trip to the worker, and the run's
outputs are exactly those of a run whose plans never left the process."""

from __future__ import annotations

import dataclasses
import enum
import pickle

import torch

from ridge import LLM, SamplingParams
from ridge.engine.step import RunnerOutput, SchedulerOutput
from ridge.sampling import SamplingParams as Params

from ..models.hf_tiny import build

PLAIN = (str, int, float, bool, type(None), bytes)


def assert_plain(value, path="plan") -> None:
    """Only plain values, containers of them, and dataclasses of them (no engine objects)."""
    if isinstance(value, PLAIN) or isinstance(value, enum.Enum):
        return
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            assert_plain(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            assert_plain(k, f"{path} key")
            assert_plain(v, f"{path}[{k!r}]")
        return
    assert dataclasses.is_dataclass(value), f"{path}: {type(value).__name__} is not plain data"
    assert value.__class__.__module__ in ("ridge.engine.step", Params.__module__), f"{path}: {type(value)}"
    for f in dataclasses.fields(value):
        assert_plain(getattr(value, f.name), f"{path}.{f.name}")


class PicklingExecutor:
    """Wraps the engine's executor: each plan and output crosses pickle, as to another process."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.plans: list[SchedulerOutput] = []

    def execute_model(self, plan: SchedulerOutput) -> RunnerOutput:
        assert_plain(plan)
        sent = pickle.loads(pickle.dumps(plan))
        self.plans.append(sent)
        out = self.inner.execute_model(sent)
        assert_plain(out, "output")
        return pickle.loads(pickle.dumps(out))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _requests():
    gen = torch.Generator().manual_seed(5)
    stem = torch.randint(3, 250, (12,), generator=gen).tolist()
    prompts, params = [], []
    for i in range(16):
        own = torch.randint(3, 250, (int(torch.randint(1, 28, (1,), generator=gen)),), generator=gen).tolist()
        prompts.append((stem if i % 3 == 0 else []) + own + own[: i % 6])
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=True)
        elif kind == 1:
            sp = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True, logprobs=2)
        elif kind == 2:
            sp = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1, ignore_eos=True)
        else:
            sp = SamplingParams(temperature=1.0, seed=100 + i, repetition_penalty=1.3, max_tokens=9, ignore_eos=True)
        params.append(sp)
    return prompts, params


def _llm(model, **options):
    # 40 blocks of 4 tokens for 16 requests of up to 70 tokens: preemption is forced; a budget
    # of 24 tokens chunks the longer prompts.
    return LLM(
        str(model),
        tokenizer="bytes",
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=24,
        **options,
    )


def test_every_plan_is_plain_data_and_survives_pickle(tmp_path):
    build("llama-gqa", tmp_path, seed=4)
    prompts, params = _requests()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False}
    reference = _llm(tmp_path, speculative_config=spec).generate(prompts, params, use_tqdm=False)
    llm = _llm(tmp_path, speculative_config=spec)
    executor = llm.engine.executor = PicklingExecutor(llm.engine.executor)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(reference, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.prompt_logprobs == b.prompt_logprobs
    plans = executor.plans
    # the run covered what the plans must carry
    assert llm.engine.scheduler.num_preemptions > 0 and any(p.preempted_req_ids for p in plans)
    assert any(c.draft_token_ids for p in plans for c in p.chunks)
    assert any(n.num_computed_tokens > 0 for p in plans for n in p.new_requests)  # prefix hits
    assert any(not c.samples for p in plans for c in p.chunks)  # a prompt chunk short of its end
    assert any(c.first_block == 0 and len(c.new_block_ids) > 1 for p in plans for c in p.cached_requests)  # resumed
    assert any(p.finished_req_ids for p in plans)
    llm.engine.kv.check_integrity()


def test_finished_ids_reach_the_workers_even_after_an_idle_step():
    """A request that finishes before the engine goes idle is dropped by the runner with the next
    plan that runs (an empty plan runs nowhere)."""
    llm = LLM("random:tiny", tokenizer="bytes", dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)
    engine = llm.engine
    runner = engine.executor.worker.runner
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert engine.step() == []  # idle
    assert set(runner.requests) == {"0"}  # not told yet
    llm.generate([[8, 9]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert set(runner.requests) == {"1"}  # the first one dropped with the next plan
