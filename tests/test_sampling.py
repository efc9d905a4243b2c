"""Tests for ridge.sampling: parameter validation, penalties, masks, seeding, logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ridge.sampling import (
    MAX_LOGPROBS,
    Sampler,
    SamplerOutput,
    SamplingParams,
    SamplingState,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
)


def state(prompt=(0,), output=(), eos=(), **params) -> SamplingState:
    return SamplingState(SamplingParams(**params), list(prompt), list(output), frozenset(eos))


def draw_many(logits_row: torch.Tensor, n: int, seed: int = 0, **params) -> torch.Tensor:
    """n independent unseeded draws from one logits row, as one batch of n identical rows."""
    states = [state(**params) for _ in range(n)]
    out = Sampler(seed)(logits_row.expand(n, -1).contiguous(), states)
    return torch.tensor(out.token_ids)


def logits_for_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


# ----------------------------------------------------------------------------------------------
# SamplingParams validation


BAD_VALUES = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("temperature", -0.1),
    ("temperature", "0.7"),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", "1"),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", False),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", None),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", "1"),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -3),
    ("frequency_penalty", "0"),
    ("seed", 1.0),
    ("seed", True),
    ("seed", "42"),
    ("seed", 2**64),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("min_tokens", None),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", 5),
    ("stop", ["a", 1]),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", 3),
    ("stop_token_ids", [True]),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", None),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 2.0),
    ("logprobs", True),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_bad_value_raises_naming_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output) == (False, True, False)
    assert not p.greedy and not p.has_penalties


def test_normalization():
    p = SamplingParams(
        stop="###", stop_token_ids=(7, 8), top_k=0, temperature=1, top_p=1, max_tokens=None, logprobs=0, seed=-3
    )
    assert p.stop == ["###"] and p.stop_token_ids == [7, 8]
    assert p.top_k == -1
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.max_tokens is None and p.logprobs == 0 and p.seed == 2**64 - 3  # manual_seed's reading
    assert SamplingParams(seed=-1).seed is None  # -1 = random, as in llama.cpp
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(frequency_penalty=0.1).has_penalties
    # replace() re-validates.
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=0)


def test_tiny_temperature_is_clamped_with_a_warning():
    with pytest.warns(UserWarning, match="temperature"):
        p = SamplingParams(temperature=1e-6)
    assert p.temperature == 0.01 and not p.greedy


def test_state_validates_params_and_builds_seeded_generator():
    with pytest.raises(ValueError, match="params"):
        SamplingState({"temperature": 0.0}, [1])
    s = state(seed=5, eos=[2, 3])
    assert s.eos_token_ids == frozenset({2, 3}) and s.seeded and s.generator is None
    g = s.generator_for(torch.device("cpu"))
    assert s.generator is g and s.generator_for(torch.device("cpu")) is g
    assert not state().seeded


# ----------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_fast_and_full_path(dtype):
    torch.manual_seed(0)
    logits = torch.randn(9, 50).to(dtype)
    expect = logits.float().argmax(-1).tolist()
    fast = Sampler()(logits, [state(temperature=0.0) for _ in range(9)])
    # logprobs force the full path; greedy rows must still be the plain argmax.
    full = Sampler()(logits, [state(temperature=0.0, logprobs=1) for _ in range(9)])
    assert fast.token_ids == expect and full.token_ids == expect
    assert fast.logprobs == [None] * 9 and fast.top_logprobs == [None] * 9


def test_greedy_rows_mixed_with_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    states = [state(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = Sampler()(logits, states)
    assert [out.token_ids[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()
    assert all(isinstance(t, int) and 0 <= t < 40 for t in out.token_ids)


def test_greedy_rows_take_the_given_argmax():
    """Every greedy path (all rows greedy, greedy with logprobs, greedy beside sampled rows)
    picks its tokens with the sampler's ``argmax`` (the model's kernels give theirs)."""
    calls = []

    def argmax(x):
        calls.append(tuple(x.shape))
        return x.float().argmax(dim=-1)

    torch.manual_seed(3)
    logits = torch.randn(4, 40).bfloat16()
    expect = logits.float().argmax(-1).tolist()
    sampler = Sampler(argmax=argmax)
    assert sampler(logits, [state(temperature=0.0)] * 4).token_ids == expect
    assert sampler(logits, [state(temperature=0.0, logprobs=1)] * 4).token_ids == expect
    mixed = sampler(logits, [state(temperature=0.0), state(temperature=1.0)] * 2)
    assert [mixed.token_ids[i] for i in (0, 2)] == [expect[0], expect[2]]
    assert calls == [(4, 40), (4, 40), (2, 40)]


def test_sampler_leaves_inputs_and_global_rng_alone():
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    before, rng = logits.clone(), torch.get_rng_state()
    states = [state(repetition_penalty=1.5, output=[1, 2], logprobs=2), state(top_p=0.5), state(seed=3, min_p=0.1)]
    Sampler()(logits, states)
    assert torch.equal(logits, before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [s.output_token_ids for s in states] == [[1, 2], [], []]


def test_empty_batch_and_shape_errors():
    out = Sampler()(torch.empty(0, 10), [])
    assert out == SamplerOutput([], [], [])
    with pytest.raises(ValueError, match="len\\(states\\)"):
        Sampler()(torch.zeros(2, 10), [state()])
    with pytest.raises(ValueError, match="float"):
        Sampler()(torch.zeros(1, 10, dtype=torch.long), [state()])


# ----------------------------------------------------------------------------------------------
# Truncation masks, through the sampler: outside tokens never drawn, inside ones all drawn.


PROBS = [0.5, 0.3, 0.1, 0.06, 0.04]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_k": 1}, {0}),
        ({"top_p": 0.75}, {0, 1}),
        ({"top_p": 0.85}, {0, 1, 2}),
        ({"top_p": 0.01}, {0}),
        ({"min_p": 0.15}, {0, 1, 2}),  # threshold 0.075
        ({"min_p": 0.7}, {0}),  # threshold 0.35
        ({"top_k": 4, "top_p": 0.95}, {0, 1, 2, 3}),
        ({"min_p": 0.1, "top_p": 0.99}, {0, 1, 2, 3}),
        ({}, {0, 1, 2, 3, 4}),
    ],
)
def test_masks_allow_exactly_the_expected_tokens(params, allowed):
    drawn = set(draw_many(logits_for_probs(PROBS), 3000, **params).tolist())
    assert drawn == allowed


def test_mixed_mask_rows_in_one_batch():
    # Rows with different masks interleaved in one batch: each row gets its own mask.
    reps = 600
    logits = logits_for_probs(PROBS).expand(4 * reps, -1).contiguous()
    specs = [{"top_k": 3}, {"top_p": 0.75}, {}, {"min_p": 0.15}]
    states = [state(**spec) for _ in range(reps) for spec in specs]
    tokens = Sampler(7)(logits, states).token_ids
    drawn = [set(tokens[i::4]) for i in range(4)]
    assert drawn == [{0, 1, 2}, {0, 1}, set(range(5)), {0, 1, 2}]


logit_rows = st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=1, max_size=24)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(logit_rows, min_size=1, max_size=4).map(
        lambda rs: [r + [0.0] * (max(map(len, rs)) - len(r)) for r in rs]
    ),
    data=st.data(),
)
def test_truncation_masks_are_never_empty_and_keep_a_top_prefix(rows, data):
    logits = torch.tensor(rows, dtype=torch.float32)
    n, vocab = logits.shape
    top_k = data.draw(st.lists(st.integers(1, vocab + 2), min_size=n, max_size=n))
    top_p = data.draw(st.lists(st.floats(1e-3, 1.0), min_size=n, max_size=n))
    min_p = data.draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    masked = apply_min_p(logits.clone(), torch.tensor(min_p))
    masked = apply_top_k_top_p(masked, torch.tensor(top_k), torch.tensor(top_p))
    for r in range(n):
        kept = torch.isfinite(masked[r])
        assert kept.any()
        assert logits[r][kept].max() == logits[r].max()  # a most likely token survives
        # Survivors keep their values and form a top prefix: none is below a dropped token.
        assert torch.equal(masked[r][kept], logits[r][kept])
        if (~kept).any():
            assert logits[r][kept].min() >= logits[r][~kept].max()
        # Without ties, top-k alone keeps exactly min(k, V) tokens.
        if len(set(rows[r])) == vocab:
            only_k = apply_top_k_top_p(logits[r : r + 1].clone(), torch.tensor([top_k[r]]), None)
            assert int(torch.isfinite(only_k).sum()) == min(top_k[r], vocab)


@settings(max_examples=150, deadline=None)
@given(row=logit_rows, p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(row, p):
    logits = torch.tensor([row], dtype=torch.float32)
    kept = torch.isfinite(apply_top_k_top_p(logits.clone(), None, torch.tensor([p])))[0]
    probs = logits[0].softmax(-1).double()
    mass = float(probs[kept].sum())
    assert mass >= p - 1e-5
    # Minimal: dropping the least likely survivor falls short of p.
    assert mass - float(probs[kept].min()) < p + 1e-5


def test_tiny_top_p_still_keeps_the_most_likely_token():
    # 1 - 1e-9 rounds to 1.0 in fp32, so every cumulative mass is <= 1 - p: only the
    # always-keep-the-top rule leaves a token to sample.
    torch.manual_seed(4)
    logits = torch.randn(8, 1000)
    masked = apply_top_k_top_p(logits.clone(), None, torch.full((8,), 1e-9))
    assert torch.isfinite(masked).sum(-1).tolist() == [1] * 8
    out = Sampler()(logits, [state(top_p=1e-9) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_only_path_handles_disabled_rows_and_k_above_vocab():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0]] * 3)
    masked = apply_top_k_top_p(logits.clone(), torch.tensor([2, 4, 9]), None)
    assert torch.isfinite(masked).tolist() == [[False, True, False, True], [True] * 4, [True] * 4]


# ----------------------------------------------------------------------------------------------
# Penalties


def test_repetition_penalty_touches_prompt_and_output_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5, 1.0]])
    s = state(prompt=[0, 1, 1], output=[3], repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), [s])
    assert out.tolist() == [[1.0, -2.0, 3.0, -4.0, 0.5, 1.0]]


def test_presence_and_frequency_penalties_use_output_counts_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    s = state(prompt=[0, 4], output=[1, 2, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), [s])[0]
    expect = [1.0, 1.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.75, 1.0, 1.0]
    assert torch.allclose(out, torch.tensor(expect))


def test_negative_presence_penalty_raises_logits():
    out = apply_penalties(torch.zeros(1, 3), [state(output=[2], presence_penalty=-1.5)])
    assert out.tolist() == [[0.0, 0.0, 1.5]]


def test_penalties_combine_repetition_first_and_leave_other_rows_alone():
    logits = torch.tensor([[4.0, -4.0, 4.0], [4.0, -4.0, 4.0], [4.0, -4.0, 4.0]])
    states = [
        state(output=[0, 0, 1, 99], repetition_penalty=2.0, frequency_penalty=1.0),
        state(output=[0, 1, 2]),  # no penalties: untouched
        state(prompt=[2], output=[], repetition_penalty=0.5),
    ]
    out = apply_penalties(logits.clone(), states)
    # Row 0: token 0 -> 4/2 - 2*1 = 0; token 1 -> -4*2 - 1 = -9; id 99 >= V is ignored.
    assert out.tolist() == [[0.0, -9.0, 4.0], [4.0, -4.0, 4.0], [4.0, -4.0, 8.0]]


def test_repetition_penalty_steers_greedy_decoding():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    assert Sampler()(logits, [state(temperature=0.0, output=[0])]).token_ids == [0]
    s = state(temperature=0.0, output=[0], repetition_penalty=1.5)
    assert Sampler()(logits, [s]).token_ids == [1]


# ----------------------------------------------------------------------------------------------
# min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # eos=1 then stop id 2 are the favourites
    sampler = Sampler()
    s = state(temperature=0.0, min_tokens=3, stop_token_ids=[2], eos=[1])
    seen = []
    for _ in range(4):
        seen.append(sampler(logits, [s]).token_ids[0])
        s.output_token_ids.append(seen[-1])
    assert seen == [3, 3, 3, 1]


def test_min_tokens_with_ignore_eos_masks_only_stop_ids():
    logits = torch.tensor([[0.0, 9.0, 8.0]])
    s = state(temperature=0.0, min_tokens=2, stop_token_ids=[1], eos=[2], ignore_eos=True)
    out = apply_min_tokens(logits.clone(), [s])
    assert out.tolist() == [[0.0, float("-inf"), 8.0]]


def test_min_tokens_never_samples_eos():
    logits = torch.tensor([3.0, 0.0, 0.0, 0.0])
    drawn = draw_many(logits, 2000, min_tokens=1, eos=[0])
    assert 0 not in drawn.tolist() and set(drawn.tolist()) == {1, 2, 3}


# ----------------------------------------------------------------------------------------------
# Seeded reproducibility


def run_steps(seed_rows: list, sampler_seed: int, steps: int = 20, vocab: int = 64) -> list:
    """Sample ``steps`` tokens for a batch; row specs are (params dict, logits stream seed).

    Each row's logits for a step depend only on its own stream, so a request sees the same
    logits whatever its batch; returns each row's token sequence.
    """
    streams = [torch.Generator().manual_seed(s) for _, s in seed_rows]
    states = [state(prompt=[1, 2, 3], **p) for p, _ in seed_rows]
    sampler = Sampler(sampler_seed)
    for _ in range(steps):
        logits = torch.stack([torch.randn(vocab, generator=g) * 2 for g in streams])
        out = sampler(logits, states)
        for s, t in zip(states, out.token_ids):
            s.output_token_ids.append(t)
    return [s.output_token_ids[:] for s in states]


TARGET = ({"seed": 1234, "top_k": 40, "temperature": 0.9}, 99)


def test_seeded_request_is_reproducible_whatever_the_batch():
    alone = run_steps([TARGET], sampler_seed=0)[0]
    batches = [
        ([TARGET, ({}, 1), ({"seed": 7}, 2)], 0),
        ([({"top_p": 0.5}, 3), ({"temperature": 0.0}, 4), TARGET], 11),
        (
            [
                ({"seed": 1234}, 5),
                ({"min_p": 0.2, "repetition_penalty": 1.3}, 6),
                TARGET,
                ({"logprobs": 3, "frequency_penalty": 1.0}, 7),
            ],
            5,
        ),
    ]
    for rows, sampler_seed in batches:
        position = rows.index(TARGET)
        assert run_steps(rows, sampler_seed)[position] == alone
    assert len(set(alone)) > 3  # it really sampled, not a degenerate stream


def test_different_seeds_give_different_sequences():
    a = run_steps([({"seed": 1}, 8)], 0)[0]
    b = run_steps([({"seed": 2}, 8)], 0)[0]
    assert a != b
    # Same seed in two rows of one batch, same logits stream: independent, equal generators.
    x, y = run_steps([({"seed": 3}, 8), ({"seed": 3}, 8)], 0)
    assert x == y


def test_unseeded_rows_follow_the_sampler_seed():
    rows = [({}, 1), ({}, 2)]
    assert run_steps(rows, 42) == run_steps(rows, 42)
    assert run_steps(rows, 42) != run_steps(rows, 43)


# ----------------------------------------------------------------------------------------------
# Logprobs


def test_logprobs_come_from_raw_logits_and_top_k_is_sorted():
    torch.manual_seed(3)
    logits = (torch.randn(4, 30) * 3).to(torch.bfloat16)
    states = [
        state(logprobs=5, temperature=0.5, top_k=3, repetition_penalty=1.7, output=[0, 1]),
        state(),
        state(logprobs=0, temperature=0.0, presence_penalty=2.0, output=[2]),
        state(logprobs=MAX_LOGPROBS, top_p=0.3, seed=9),
    ]
    out = Sampler()(logits, states)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i in (0, 2, 3):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []
    for i, k in ((0, 5), (3, MAX_LOGPROBS)):
        top = out.top_logprobs[i]
        assert len(top) == k
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        vals, ids = raw[i].topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-6)
        assert all(isinstance(t, int) for t, _ in top)


def test_logprobs_k_larger_than_vocab_returns_whole_vocab():
    out = Sampler()(torch.tensor([[0.0, 1.0, 2.0]]), [state(logprobs=10)])
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1, 0]
    assert sum(math.exp(v) for _, v in out.top_logprobs[0]) == pytest.approx(1.0, abs=1e-6)


# ----------------------------------------------------------------------------------------------
# Statistics


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.0])
def test_sampling_frequencies_follow_tempered_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 8000
    drawn = draw_many(logits, n, seed=123, temperature=temperature)
    freq = torch.bincount(drawn, minlength=6).double() / n
    expect = torch.softmax(logits.double() / temperature, -1)
    # 4.5 sigma of a binomial proportion at n = 8000 is < 0.025.
    assert (freq - expect).abs().max().item() < 0.025


def test_seeded_rows_also_follow_the_distribution():
    # 300 distinct seeds, one draw each: the exponential race per row is an unbiased sampler.
    logits = torch.tensor([1.0, 0.0, -1.0]).expand(3000, -1).contiguous()
    out = Sampler()(logits, [state(seed=s) for s in range(3000)])
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).double() / 3000
    assert (freq - torch.softmax(torch.tensor([1.0, 0.0, -1.0]).double(), -1)).abs().max() < 0.04


def test_each_sample_gets_its_own_seed_wrapping_at_2_to_the_64():
    p = SamplingParams(n=3, seed=2**64 - 2)
    assert [p.for_sample(i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert SamplingParams(n=3).for_sample(2).seed is None
    # a negative seed is kept as manual_seed reads it: the same random stream
    a = torch.Generator().manual_seed(SamplingParams(seed=-3).seed)
    b = torch.Generator().manual_seed(-3)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the host copy of a launched step's tokens")
def test_a_pending_sample_waits_for_its_own_tokens_not_for_work_queued_after_it():
    from ridge.sampling import PendingSample

    pending = PendingSample(torch.arange(5, device="cuda"), 5)
    torch.cuda._sleep(500_000_000)  # ~0.3 s of GPU work queued after the launch: the next step's forward
    assert pending.result().token_ids == [0, 1, 2, 3, 4]
    assert not torch.cuda.current_stream().query()  # read while the later work still runs
    assert pending.tokens.is_cuda  # the device tensor stays: the next step reads it there
    torch.cuda.synchronize()
