"""The adaptive policy: speculate while the step stays memory-bound, not past the ridge."""

from __future__ import annotations

import pytest

from ridge.spec_decode.policy import SpeculationPolicy, expected_speedup, expected_tokens


def roofline(ridge_rows: int):
    """A fake machine: a step costs max(reading the weights, rows of arithmetic), with the
    two equal at ``ridge_rows`` rows in all."""

    def step_time(batch, rows, context):
        return max(1.0, batch * rows / ridge_rows)

    return step_time


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_speedup(0.5, 2, 1.0) == pytest.approx(1.75)


def test_speculates_fully_under_the_ridge_and_not_past_it():
    policy = SpeculationPolicy(4, roofline(ridge_rows=12), prior_acceptance=0.7)
    assert policy.choose_k(1, 100) == 4  # 5 rows: still memory-bound, every draft is free
    assert policy.choose_k(2, 100) == 4  # 10 rows
    assert 0 < policy.choose_k(4, 100) < 4  # past the ridge at 4 x 5 rows: fewer
    assert policy.choose_k(32, 100) == 0  # 32 rows already: compute-bound, no draft pays


def test_follows_the_measured_acceptance():
    policy = SpeculationPolicy(4, roofline(ridge_rows=12), prior_acceptance=0.7, smoothing=0.5)
    assert policy.choose_k(8, 100) > 0  # 8 x 2 rows cost 1.33x a plain step; 0.7 acceptance pays for it
    for _ in range(20):
        policy.observe(4, 0)  # every first draft rejected
    assert policy.acceptance < 0.01
    assert policy.choose_k(8, 100) == 0
    assert policy.choose_k(1, 100) == 0  # free drafts that are never accepted gain nothing either
    for _ in range(10):  # not speculating: the estimate drifts back, and speculation is tried again
        policy.choose_k(1, 100)
    assert policy.choose_k(1, 100) > 0


def test_draft_cost_limits_k():
    policy = SpeculationPolicy(8, roofline(ridge_rows=64), proposer_cost=0.3, prior_acceptance=0.6)
    k = policy.choose_k(1, 100)
    assert 0 < k < 8


def test_a_draft_pass_is_priced_at_its_measured_cost():
    """Where steps are bound by launches, not bytes (a GPU), a draft pass costs about a target
    step whatever the roofline says: the measured cost replaces the roofline's when larger."""
    from ridge.sampling import SamplingParams
    from ridge.spec_decode.config import SpeculativeConfig
    from ridge.spec_decode.proposer import ProposalRequest
    from ridge.spec_decode.speculator import Speculator

    class SlowDraft:
        pass_s = 0.8  # a one-token draft pass: 0.8 of a target step
        max_model_len = None

        def forget_except(self, running):
            pass

        def propose(self, requests, k):
            return {r.req_id: ([5] * k, None) for r in requests}

    config = SpeculativeConfig("draft_model", 4, model="random:tiny")
    policy = SpeculationPolicy(4, roofline(ridge_rows=64), proposer_cost=0.001, prior_acceptance=0.6)
    speculator = Speculator(config, SlowDraft(), policy)
    req = ProposalRequest("r", list(range(10)), SamplingParams())
    room = {"r": 99}
    assert speculator.propose([req], room, {"r"}) == {"r": ([5] * 4, None)}  # the roofline: drafting is nearly free
    for _ in range(40):
        speculator.record({"r": (speculator.last_k, 1)}, step_s=1.0)
        speculator.propose([req], room, {"r"})
    assert policy.proposer_cost > 0.5
    speculator.propose([req], room, {"r"})
    assert speculator.last_k <= 1  # 0.6 acceptance cannot pay for 0.8 of a step per draft


def test_measured_steps_replace_the_roofline_and_few_drafts_do_not_pay():
    """A GPU's batch-32 n-gram run (stop 43, H200): the roofline calls 160 rows free, the
    measured verify step costs 1.3 plain ones, and lookup drafts for 8% of the sequences."""
    policy = SpeculationPolicy(4, roofline(ridge_rows=1000), prior_acceptance=0.6)
    assert policy.choose_k(32, 100) == 4  # nothing measured: the roofline says drafts are free
    policy.observe_step(32, 4, 1.3)
    assert policy.choose_k(32, 100) == 0  # one plain step prices the verify step
    policy.observe_step(32, 0, 1.0)
    assert policy.measured_ratios(32) == {4: pytest.approx(1.3)}
    assert policy.measured_ratios(8) == {}  # another batch size: not measured
    assert policy.choose_k(32, 100) > 0  # every sequence drafting at 0.6 acceptance: 2.3 tokens for 1.3
    for _ in range(20):
        policy.observe_coverage(3, 32)
    assert policy.coverage < 0.11
    assert policy.choose_k(32, 100) == 0  # 1 + 0.09 x 1.3 tokens for at least 1.3x the time
    assert policy.choose_k(1, 100) == 4  # batch 1 is priced by its own (unmeasured) steps
    for _ in range(400):  # not speculating: the drafted share drifts back, and drafting is tried again
        if policy.choose_k(32, 100):
            break
    else:
        raise AssertionError("never tried again")


def test_an_unmeasured_k_costs_at_least_a_measured_smaller_one():
    policy = SpeculationPolicy(4, roofline(ridge_rows=1000), prior_acceptance=0.9)
    policy.observe_step(4, 0, 1.0)
    policy.observe_step(4, 1, 2.0)  # a verify step's fixed cost: twice a plain step
    assert policy.choose_k(4, 100) == 4  # 0.9 acceptance: 4.1 tokens for at least 2x (the roofline: free)
    policy.observe_step(4, 4, 6.0)
    assert policy.choose_k(4, 100) == 3  # 2 and 3 at 2x (unmeasured), 4 at 6x: 3.44 tokens for 2x


def test_coverage_scales_the_expected_gain():
    assert expected_speedup(0.5, 2, 1.0, coverage=0.0) == 1.0
    assert expected_speedup(0.5, 2, 1.0, coverage=0.5) == pytest.approx(1 + 0.5 * 0.75)


def test_a_lookup_that_finds_nothing_stops_costing_a_pipelined_step():
    """n-gram at batch 1 on a fresh text (stop 43, H200): lookup finds nothing, and each step
    the policy drafts for runs synchronously, 1.70 ms against a pipelined 1.26. The policy
    prices that choice from those times and the drafted share, and stops within a few steps."""
    from ridge.sampling import SamplingParams
    from ridge.spec_decode.config import SpeculativeConfig
    from ridge.spec_decode.proposer import ProposalRequest
    from ridge.spec_decode.speculator import Speculator

    class NoMatches:
        pass_s = None
        max_model_len = None

        def forget_except(self, running):
            pass

        def propose(self, requests, k):
            return {}

    config = SpeculativeConfig("ngram", 4)
    policy = SpeculationPolicy(4, roofline(ridge_rows=1000), prior_acceptance=0.6)
    speculator = Speculator(config, NoMatches(), policy)
    req = ProposalRequest("r", list(range(10)), SamplingParams())
    drafting_steps = 0
    for _ in range(30):
        speculator.propose([req], {"r": 99}, {"r"})
        if speculator.last_k:
            drafting_steps += 1
            speculator.record({}, step_s=1.70)
        else:
            speculator.observe_plain_step(1, 1.26)
    assert policy.measured_ratios(1) == {4: pytest.approx(1.70 / 1.26)}
    assert drafting_steps <= 8
    assert speculator.last_k == 0


def test_what_verify_steps_emit_caps_what_the_model_expects():
    """A draft model at batch 32 (stop 49, H200): acceptance 0.97 and 4.84 tokens a run, but
    runs cut short by max_tokens and sequences left without drafts made a step emit far fewer
    tokens a sequence than E(a, k); priced at 3.85 plain steps, a verify step lost (0.82x).
    The measured yield caps the model, and the policy stops."""
    policy = SpeculationPolicy(4, roofline(ridge_rows=1000), prior_acceptance=0.97)
    for _ in range(20):
        policy.observe(4, 4)
    policy.observe_step(32, 0, 1.3e-3)
    policy.observe_step(32, 4, 5.0e-3)
    assert policy.choose_k(32, 200) == 4  # E(0.97, 4) = 4.7 tokens for 3.85 steps' time
    for _ in range(5):
        policy.observe_yield(32, 4, 3.1)
    assert policy.choose_k(32, 200) == 0  # 3.1 tokens for 3.85 steps' time
    # an unmeasured k is scaled by the same shortfall, a measured one by its own
    policy.observe_yield(32, 2, 2.9)
    assert policy._yield[(policy._bucket(32), 2)] == 2.9
    assert policy.choose_k(32, 200) == 0
