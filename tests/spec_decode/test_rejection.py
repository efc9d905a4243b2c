"""Verification: greedy prefix matching, and the rejection sampler against the exact target
distribution on hand-made p and q."""

from __future__ import annotations

import pytest
import torch

from ridge.sampling import Sampler, SamplingParams, SamplingState
from ridge.spec_decode.rejection import verify


def state(**kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), prompt_token_ids=[1, 2], output_token_ids=[3])


def logits_of(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 0.0, 0.0]])
    s = state(temperature=0.0)
    out = verify(Sampler(0), logits, s, [1, 0, 1])
    assert (out.token_ids, out.num_accepted) == ([1, 0, 2], 2)
    out = verify(Sampler(0), logits, s, [1, 0, 2])
    assert (out.token_ids, out.num_accepted) == ([1, 0, 2, 0], 3)  # all accepted, plus the bonus token
    out = verify(Sampler(0), logits, s, [2, 0, 2])
    assert (out.token_ids, out.num_accepted) == ([1], 0)


def test_greedy_counts_accepted_drafts_for_penalties():
    # repetition penalty 10: token 1, once drafted, is penalized at the next slot
    logits = torch.tensor([[0.0, 5.0, 4.0], [0.0, 5.0, 4.0]])
    s = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=10.0), prompt_token_ids=[0])
    out = verify(Sampler(0), logits, s, [1])
    assert out.token_ids == [1, 2]


def _empirical(make, runs: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab)
    for i in range(runs):
        counts[make(i)] += 1
    return counts / runs


# (p at the first slot, q at the first slot): the first emitted token must follow p exactly.
CASES = {
    "q-overlaps-p": ([0.5, 0.3, 0.15, 0.05], [0.1, 0.6, 0.2, 0.1]),
    "q-misses-mass": ([0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.5, 0.5]),
    "q-equals-p": ([0.4, 0.4, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_sampler_keeps_the_target_distribution(case):
    p, q = CASES[case]
    logits = logits_of([p, p])
    draft_probs = torch.tensor([q])
    sampler = Sampler(0)
    draft_gen = torch.Generator().manual_seed(1)

    def first_token(i):
        s = state(temperature=1.0, seed=i)
        draft = int(torch.multinomial(draft_probs[0], 1, generator=draft_gen))
        return verify(sampler, logits, s, [draft], draft_probs).token_ids[0]

    runs = 6000
    freq = _empirical(first_token, runs, 4)
    # total variation against p; 6000 draws over 4 outcomes: the TV's standard deviation is
    # about 0.01, and 0.035 is a > 4-sigma bound (false alarm < 1e-4; seeds are fixed anyway)
    assert 0.5 * (freq - torch.tensor(p)).abs().sum() < 0.035


def test_ngram_drafts_one_hot_q_keep_the_target_distribution():
    p = [0.1, 0.6, 0.2, 0.1]
    logits = logits_of([p, p])
    sampler = Sampler(0)

    def first_token(i):
        return verify(sampler, logits, state(temperature=1.0, seed=i), [1]).token_ids[0]

    freq = _empirical(first_token, 6000, 4)
    assert 0.5 * (freq - torch.tensor(p)).abs().sum() < 0.035


def test_top_p_applies_at_every_slot():
    # top-p 0.5 keeps only token 0 at each slot: any accepted or resampled token is 0
    logits = logits_of([[0.7, 0.1, 0.1, 0.1]] * 3)
    for i in range(50):
        out = verify(Sampler(i), logits, state(temperature=1.0, top_p=0.5, seed=i), [0, 2])
        assert out.token_ids[0] == 0
        assert out.token_ids[1] == 0 and out.num_accepted == 1  # draft 2 is outside the nucleus


def test_a_run_needs_one_row_per_draft_plus_one():
    with pytest.raises(ValueError, match="needs 3 rows"):
        verify(Sampler(0), torch.zeros(2, 4), state(), [1, 2])


def test_greedy_runs_verified_together_equal_one_by_one():
    gen = torch.Generator().manual_seed(0)
    from ridge.spec_decode.rejection import verify_greedy_batch

    runs = [[3, 1], [], [2, 2, 0], [1]]
    logits = torch.randn(sum(len(r) + 1 for r in runs), 4, generator=gen)
    together = verify_greedy_batch(logits, runs)
    row = 0
    for drafts, result in zip(runs, together):
        alone = verify(Sampler(0), logits[row : row + len(drafts) + 1], state(temperature=0.0), drafts)
        assert (result.token_ids, result.num_accepted) == (alone.token_ids, alone.num_accepted)
        row += len(drafts) + 1
