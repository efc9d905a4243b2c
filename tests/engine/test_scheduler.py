"""Scheduler tests with a fake runner: no model, only computed-vs-total token arithmetic."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ridge.engine.request import Request, RequestStatus
from ridge.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ridge.engine.stop import StopLimits, check_stop
from ridge.kv.manager import KVCacheManager
from ridge.sampling import SamplingParams

_ids = itertools.count()


_made: dict[str, Request] = {}


def req_of(chunk) -> Request:
    """The request a chunk names (plans carry ids only)."""
    return _made[chunk.req_id]


def make_request(prompt_len: int, max_tokens: int = 4, prompt: list[int] | None = None) -> Request:
    rid = next(_ids)
    # distinct prompts, so prefix caching only hits where a test shares tokens on purpose
    tokens = prompt if prompt is not None else [1000 * (rid + 1) + i for i in range(prompt_len)]
    req = _made[f"r{rid}"] = Request(
        request_id=f"r{rid}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_tokens=max_tokens,
        arrival_time=0.0,
    )
    return req


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_seqs=8, policy="continuous", caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, policy), kv, max_model_len=10_000)


def fake_run(plan: SchedulerOutput) -> dict[str, list[int]]:
    """Every sampling chunk gets token 7."""
    return {c.req_id: [7] for c in plan.chunks if c.samples}


def stops(sched: Scheduler, sampled: dict[str, list[int]]) -> dict[str, RequestStatus]:
    """The stop rules, as the output processor applies them (max_tokens here: eos is ignored)."""
    finished = {}
    for rid, tokens in sampled.items():
        req = sched.requests[rid]
        limits = StopLimits(
            req.sampling_params, req.max_tokens, req.num_prompt_tokens, sched.max_model_len, frozenset()
        )
        stop = check_stop(limits, tokens[-1], req.num_output_tokens + len(tokens))
        if stop is not None:
            finished[rid] = RequestStatus(stop[0])
    return finished


def step(sched: Scheduler) -> SchedulerOutput:
    plan = sched.schedule()
    sampled = fake_run(plan)
    sched.update(plan, sampled, stops(sched, sampled))
    sched.kv.check_integrity()
    return plan


def test_token_budget_and_chunking():
    sched = make_scheduler(budget=16)
    a, b = make_request(10), make_request(10)
    sched.add_request(a)
    sched.add_request(b)
    plan = step(sched)
    assert [(req_of(c), c.num_new_tokens) for c in plan.chunks] == [(a, 10), (b, 6)]
    assert plan.num_batched_tokens == 16
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0  # b's chunk does not sample
    plan = step(sched)
    # a decodes (1 token) first, then b's remaining 4 prompt tokens
    assert [(req_of(c), c.num_new_tokens) for c in plan.chunks] == [(a, 1), (b, 4)]
    assert b.num_output_tokens == 1


def test_long_prompt_is_prefilled_in_chunks():
    sched = make_scheduler(budget=16)
    req = make_request(50, max_tokens=2)
    sched.add_request(req)
    sizes = [step(sched).chunks[0].num_new_tokens for _ in range(5)]
    assert sizes == [16, 16, 16, 2, 1]
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 2


def test_without_chunking_a_long_prompt_waits_for_a_whole_budget():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(8, 16, "continuous", enable_chunked_prefill=False), kv, 10_000)
    short, long = make_request(4), make_request(20)
    sched.add_request(short)
    sched.add_request(long)
    plan = step(sched)
    assert [req_of(c) for c in plan.chunks] == [short]  # the 20-token prompt does not fit 16 - 4


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = make_scheduler(budget=8)
    first = make_request(3, max_tokens=10)
    sched.add_request(first)
    step(sched)
    late = make_request(20)
    sched.add_request(late)
    plan = step(sched)
    assert req_of(plan.chunks[0]) is first and plan.chunks[0].num_new_tokens == 1
    assert req_of(plan.chunks[1]) is late and plan.chunks[1].num_new_tokens == 7


def test_max_num_seqs_caps_running():
    sched = make_scheduler(budget=100, max_seqs=2)
    reqs = [make_request(4) for _ in range(4)]
    for r in reqs:
        sched.add_request(r)
    plan = step(sched)
    assert {req_of(c).request_id for c in plan.chunks} == {reqs[0].request_id, reqs[1].request_id}


def test_finished_requests_leave_and_waiting_join_the_next_step():
    sched = make_scheduler(budget=100, max_seqs=1)
    a, b = make_request(4, max_tokens=1), make_request(4, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert a.is_finished and not sched.running
    plan = step(sched)
    assert [req_of(c) for c in plan.chunks] == [b]


def test_preemption_takes_the_most_recent_and_recomputes_it():
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens take 2 blocks each.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    reqs = [make_request(8, max_tokens=8) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched)  # all three prefilled, 9 tokens each -> each needs a third block next
    assert all(r.num_output_tokens == 1 for r in reqs)
    plan = step(sched)
    assert plan.preempted_req_ids == [reqs[2].request_id]  # the last admitted
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].num_computed_tokens == 0
    assert sched.waiting[0] is reqs[2]
    assert {req_of(c).request_id for c in plan.chunks} == {reqs[0].request_id, reqs[1].request_id}
    outputs_before = list(reqs[2].output_token_ids)
    while sched.has_unfinished_requests():
        step(sched)
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert reqs[2].output_token_ids[: len(outputs_before)] == outputs_before
    assert sched.num_preemptions >= 1
    assert sched.kv.pool.counts()["used"] == 0


def test_preempting_a_request_already_scheduled_this_step_returns_its_budget():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, caching=False)
    old, young = make_request(8, max_tokens=8), make_request(8, max_tokens=8)
    sched.add_request(old)
    sched.add_request(young)
    step(sched)
    # Give young a decode-ready state and old a pending prefill chunk, so young is scheduled first.
    sched.kv.free(old)
    old.num_computed_tokens = 0
    sched.kv.allocate_slots(old, 4)
    old.num_computed_tokens = 4
    plan = step(sched)
    assert young.request_id in plan.preempted_req_ids
    assert all(req_of(c) is not young for c in plan.chunks)


def test_no_starvation_under_memory_pressure():
    sched = make_scheduler(num_blocks=12, block_size=4, budget=16, max_seqs=6)
    reqs = [make_request(3 + (i * 7) % 13, max_tokens=2 + (i * 5) % 9) for i in range(20)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert sched.kv.pool.counts()["used"] == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=12),
    st.integers(4, 24),
    st.integers(1, 40),
    st.sampled_from(["continuous", "static"]),
)
def test_random_workloads_always_finish(shapes, num_blocks, budget, policy):
    block_size = 4
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=budget, max_seqs=5, policy=policy)
    reqs = []
    for prompt_len, max_tokens in shapes:
        if -(-(prompt_len + max_tokens) // block_size) > num_blocks:
            continue  # the engine refuses these at admission
        reqs.append(make_request(prompt_len, max_tokens))
        sched.add_request(reqs[-1])
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        plan = step(sched)
        assert plan.num_batched_tokens <= budget
        assert len(sched.running) <= 5
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert sched.kv.pool.counts()["used"] == 0


def test_static_policy_admits_only_into_an_empty_engine():
    sched = make_scheduler(budget=100, policy="static")
    a = make_request(4, max_tokens=3)
    sched.add_request(a)
    step(sched)
    b = make_request(4, max_tokens=1)
    sched.add_request(b)
    plan = step(sched)
    assert [req_of(c) for c in plan.chunks] == [a]  # b waits for the batch to finish
    step(sched)
    assert a.is_finished
    plan = step(sched)
    assert [req_of(c) for c in plan.chunks] == [b]


def test_prefix_cache_hits_share_blocks_and_count_references():
    sched = make_scheduler(block_size=4, budget=100)
    shared = list(range(10, 22))  # 12 tokens = 3 full blocks
    a = make_request(0, max_tokens=4, prompt=shared + [1, 2])
    sched.add_request(a)
    step(sched)
    b = make_request(0, max_tokens=4, prompt=shared + [3])
    sched.add_request(b)
    plan = step(sched)
    chunk_b = next(c for c in plan.chunks if req_of(c) is b)
    new_b = next(n for n in plan.new_requests if n.req_id == b.request_id)
    assert new_b.num_computed_tokens == 12 and chunk_b.start == 12 and chunk_b.num_new_tokens == 1
    table_a, table_b = sched.kv.block_table(a), sched.kv.block_table(b)
    assert table_a[:3] == table_b[:3] and table_a[3] != table_b[3]
    assert all(sched.kv.pool.blocks[i].ref_cnt == 2 for i in table_a[:3])
    sched.abort(a.request_id)
    assert all(sched.kv.pool.blocks[i].ref_cnt == 1 for i in table_b[:3])
    sched.kv.check_integrity()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = make_scheduler(block_size=4, budget=100)
    prompt = list(range(30, 38))  # exactly 2 blocks
    a = make_request(0, max_tokens=1, prompt=prompt)
    sched.add_request(a)
    step(sched)
    b = make_request(0, max_tokens=1, prompt=prompt)
    sched.add_request(b)
    plan = step(sched)
    assert plan.new_requests[0].num_computed_tokens == 4 and plan.chunks[0].num_new_tokens == 4
    assert b.is_finished


def test_abort_frees_blocks_at_once():
    sched = make_scheduler(budget=100)
    r = make_request(9, max_tokens=50)
    sched.add_request(r)
    step(sched)
    assert sched.kv.pool.counts()["used"] == 3
    sched.abort(r.request_id)
    assert r.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv.pool.counts()["used"] == 0 and not sched.has_unfinished_requests()
