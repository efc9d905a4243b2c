"""Multi-step scheduling (``--num-scheduler-steps``): a plan of plain decodes runs several
forward passes, and every request's outputs equal the single-step engine's (tokens, text,
finish and stop reasons) under stop tokens and strings met inside a run, length and context
limits, prefix-cache hits, chunked prefill, preemption, seeded sampling, requests whose
sampling keeps them to single steps (logprobs, penalties), and aborts."""

from __future__ import annotations

import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.config import EngineConfig
from ridge.engine.request import Request
from ridge.engine.scheduler import Scheduler, SchedulerConfig
from ridge.kv.manager import KVCacheManager
from ridge.models.llama import LlamaForCausalLM
from ridge.worker import runner as runner_module

from ..models.hf_tiny import build
from .same_outputs import same


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-multi-step")
    build("llama-gqa", directory, seed=7)
    return directory


def _llm(model_dir, steps: int, **options) -> LLM:
    options = {"block_size": 4, "num_kv_blocks": 256, "dtype": "float32", "device": "cpu", **options}
    return LLM(str(model_dir), tokenizer="bytes", seed=0, num_scheduler_steps=steps, **options)


def _workload():
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 250, (9,), generator=gen).tolist()  # a prefix several prompts share
    prompts, params = [], []
    for i in range(12):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        tail = torch.randint(3, 250, (n,), generator=gen).tolist()
        prompts.append(shared + tail if i % 3 == 0 else tail)
        max_tokens = int(torch.randint(1, 23, (1,), generator=gen))  # most not a multiple of the run
        kind = 3 if i == 3 else i % 3
        if kind == 0:  # seeded sampling: the request's own generator, drawn once a pass
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=max_tokens))
        elif kind == 1:  # greedy, with a stop token met inside a run (found below)
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[]))
        elif kind == 2:  # logprobs, read after each pass (greedy and seeded sampling)
            temperature = 0.0 if i % 2 else 0.8
            params.append(
                SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
            )
        else:  # penalties: single steps while it runs (short, so that runs come after)
            params.append(SamplingParams(temperature=0.0, max_tokens=min(max_tokens, 4), repetition_penalty=1.3))
    return prompts, params


def _with_stops(llm, prompts, params):
    """Give the stop-token requests a token their greedy output reaches midway."""
    probe = llm.generate(
        prompts,
        [p if p.temperature else SamplingParams(temperature=0.0, max_tokens=22) for p in params],
        use_tqdm=False,
    )
    for p, out in zip(params, probe):
        tokens = out.outputs[0].token_ids
        if p.stop_token_ids == [] and len(tokens) > 2:
            p.stop_token_ids = [tokens[len(tokens) // 2]]
    return params


def _summary(outputs):
    """Each completion's tokens, text, finish, stop reason and logprobs (logprobs compared within
    1e-5 by ``same``: a float32 step's batch may differ from the single-step engine's)."""
    rows = []
    for out in outputs:
        for c in out.outputs:
            lps = [sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in c.logprobs or []]
            rows.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
    return rows


def _count_runs(monkeypatch) -> list[int]:
    """The num_steps of every multi-step plan the runner runs."""
    runs: list[int] = []
    original = runner_module.ModelRunner._run_steps
    monkeypatch.setattr(
        runner_module.ModelRunner, "_run_steps", lambda self, plan: runs.append(plan.num_steps) or original(self, plan)
    )
    return runs


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill beside decodes
        {"num_kv_blocks": 24, "max_num_seqs": 8},  # preemptions, and runs the pool cannot supply
        {"enable_prefix_caching": False, "max_model_len": 40},  # the context limit ends requests
        {"dtype": "bfloat16"},  # the CPU kernels' decode plan runs each pass
    ],
    ids=["plain", "chunked", "preempting", "context-limit", "bf16-plan"],
)
def test_multi_step_outputs_equal_single_step_ones(model_dir, monkeypatch, options):
    single = _llm(model_dir, 1, **options)
    prompts, params = _workload()
    params = _with_stops(single, prompts, params)
    want = _summary(single.generate(prompts, params, use_tqdm=False))

    runs = _count_runs(monkeypatch)
    multi = _llm(model_dir, 4, **options)
    got = _summary(multi.generate(prompts, params, use_tqdm=False))
    assert same(got, want)
    assert any(row[4] for row in got)  # logprobs came back
    assert runs and max(runs) == 4 and all(2 <= n <= 4 for n in runs)  # it did run several passes a plan
    engine = multi.engine
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.kv.pool.num_free_blocks == engine.num_kv_blocks  # every block back


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_runs_in_one_call_of_the_plan(model_dir, monkeypatch, dtype):
    """Greedy rows only, bf16 on the CPU kernels: each run is one call of the decode plan
    (its passes' final norm, lm_head, argmax and next embedding in C++), with the single-step
    engine's tokens; float32 has no plan and runs its passes from Python."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist() for n in (3, 9, 17, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (13, 6, 21, 9)]
    want = _summary(_llm(model_dir, 1, dtype=dtype).generate(prompts, params, use_tqdm=False))
    in_one_call = []
    greedy = LlamaForCausalLM.decode_greedy

    def counted(self, *args):
        tokens = greedy(self, *args)
        in_one_call.append(tokens is not None)
        return tokens

    monkeypatch.setattr(LlamaForCausalLM, "decode_greedy", counted)
    got = _summary(_llm(model_dir, 8, dtype=dtype).generate(prompts, params, use_tqdm=False))
    assert got == want
    assert in_one_call and all(in_one_call) == (dtype == "bfloat16")


def test_a_stop_inside_a_run_drops_the_tokens_after_it(model_dir, monkeypatch):
    """One greedy request alone: its runs are whole until the stop token, which ends the output
    inside a run; the passes after it were computed and their tokens dropped."""
    prompt = [5, 17, 99, 3]
    free = _llm(model_dir, 1).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    tokens = free[0].outputs[0].token_ids
    stop_at = next(i for i in range(5, 20) if i % 8 not in (0, 7) and tokens[i] not in tokens[:i])
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[stop_at]])
    runs = _count_runs(monkeypatch)
    out = _llm(model_dir, 8).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: stop_at + 1] and out.finish_reason == "stop"
    assert out.stop_reason == tokens[stop_at]
    assert runs[0] == 8 and sum(runs) > stop_at  # the run that met the stop went past it


def test_streamed_runs_and_telemetry(model_dir):
    """A streamed request gets its tokens in runs, and the telemetry counts each pass as a step
    of one decode row, its context one longer than the pass before."""
    llm = _llm(model_dir, 4)
    engine = llm.engine
    engine.add_request("r", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True), stream=True)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(len(out.outputs[0].token_ids))
    # the prefill samples the first token, then runs of 4, 4 and the 2 left
    assert seen == [1, 5, 9, 11]
    decodes = [r.decode_contexts for r in engine.telemetry.recent if r.decode_contexts]
    assert [c[0] for c in decodes] == list(range(4, 14))


def _scheduler(steps: int, blocks: int = 64, max_model_len: int = 1000) -> Scheduler:
    kv = KVCacheManager(blocks, 4, True)
    return Scheduler(SchedulerConfig(num_scheduler_steps=steps), kv, max_model_len)


def _decoding(sched: Scheduler, rid: str, params: SamplingParams, prompt_len: int = 6) -> Request:
    """A request past its prefill, one output token known and not yet computed."""
    req = Request(rid, list(range(3, 3 + prompt_len)), params, params.max_tokens, 0.0)
    sched.add_request(req)
    plan = sched.schedule()
    sched.update(plan, {rid: [42]})
    return req


def test_scheduler_runs_only_plain_decodes_to_their_limits():
    sched = _scheduler(8)
    _decoding(sched, "a", SamplingParams(max_tokens=30))
    plan = sched.schedule()
    assert plan.num_steps == 8 and [c.num_new_tokens for c in plan.chunks] == [1]
    assert len(sched.kv.block_table(sched.requests["a"])) == 4  # 14 tokens' slots: 6 + 8
    sched.update(plan, {"a": list(range(50, 58))})
    assert sched.requests["a"].num_computed_tokens == 14 and sched.requests["a"].num_output_tokens == 9

    _decoding(sched, "b", SamplingParams(max_tokens=4))  # 1 token out: 3 to go
    plan = sched.schedule()
    assert plan.num_steps == 3  # the nearest max_tokens

    sched = _scheduler(8)
    _decoding(sched, "a", SamplingParams(max_tokens=30))
    _decoding(sched, "lp", SamplingParams(max_tokens=30, logprobs=0))
    assert sched.schedule().num_steps == 8  # logprobs: read after each pass
    sched = _scheduler(8)
    _decoding(sched, "a", SamplingParams(max_tokens=30))
    _decoding(sched, "penalized", SamplingParams(max_tokens=30, repetition_penalty=1.2))
    assert sched.schedule().num_steps == 1  # a penalty reads the output so far, each pass

    sched = _scheduler(8)
    _decoding(sched, "a", SamplingParams(max_tokens=30))
    sched.add_request(Request("new", [3, 4, 5], SamplingParams(max_tokens=5), 5, 0.0))
    assert sched.schedule().num_steps == 1  # a prompt admitted beside the decode

    sched = _scheduler(8, blocks=3)  # 12 slots: 6 + 8 do not fit
    _decoding(sched, "a", SamplingParams(max_tokens=30))
    assert sched.schedule().num_steps == 1

    sched = _scheduler(8, max_model_len=10)
    _decoding(sched, "a", SamplingParams(max_tokens=30))  # 7 tokens: 3 to the context limit
    assert sched.schedule().num_steps == 3


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_scheduler_steps": 0}, "num_scheduler_steps must be a positive integer"),
        ({"num_scheduler_steps": 4, "async_scheduling": True}, "does not combine with async_scheduling"),
        ({"num_scheduler_steps": 4, "tensor_parallel_size": 2, "device": "cpu"}, "tensor parallelism"),
        (
            {"num_scheduler_steps": 4, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "speculative decoding",
        ),
    ],
)
def test_multi_step_refuses_what_it_does_not_combine_with(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
    assert EngineConfig(num_scheduler_steps=4).async_scheduling is False
