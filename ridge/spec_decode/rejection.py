"""Verification: the target's logits at the 1 + k positions of a speculated run decide which
proposed tokens stand.

    rows:      r0        r1        ...  rk
    input:     t_last    d1        ...  dk          (the last accepted token, then the drafts)
    predicts:  slot 1    slot 2    ...  slot k + 1

Greedy: accept the drafts while each equals the target's argmax at its slot, then emit the
target's own token at the first mismatch (or the bonus token after the last draft).

Sampling (Leviathan et al., the standard rejection sampler): draft d_j, proposed with
probability q_j(d_j), is accepted with probability min(1, p_j(d_j) / q_j(d_j)); the first
rejection emits a token from norm(max(0, p_j - q_j)) and ends the run; a fully accepted run
emits a bonus token from p_k. Every emitted token is then distributed exactly as the target
samples it. n-gram drafts have no distribution: q_j is one-hot at d_j.

p_j is the target's distribution after everything the sampler applies (penalties, min_tokens,
temperature, min-p, top-k, top-p), with the drafts before slot j counted as generated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ridge.sampling import PendingSample, Sampler, SamplingState, apply_min_tokens, apply_penalties


@dataclass
class VerifyResult:
    token_ids: list[int]  # 1 .. k + 1 tokens: the accepted drafts, then the target's own
    num_accepted: int  # drafts accepted
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None  # per emitted token, where asked


def _position_states(state: SamplingState, drafts: list[int]) -> list[SamplingState]:
    """The request's state at each slot: the drafts before it count as generated."""
    if not (state.params.has_penalties or state.params.min_tokens):
        return [state] * (len(drafts) + 1)
    base = state.output_token_ids
    return [dataclasses.replace(state, output_token_ids=base + drafts[:j]) for j in range(len(drafts) + 1)]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    state: SamplingState,
    drafts: list[int],
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """One request's run: ``logits`` (1 + k, V) at its rows, ``drafts`` (k), ``draft_probs``
    (k, V) the draft model's distributions (None: n-gram, one-hot)."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"a run of {k} drafts needs {k + 1} rows of logits, got {logits.shape[0]}")
    params = state.params
    x = logits.float()
    raw = torch.log_softmax(x, dim=-1) if params.logprobs is not None else None
    if params.has_penalties or state.min_tokens_active() or params.min_tokens:
        x = x.clone()
        states = _position_states(state, drafts)
        apply_penalties(x, states)
        apply_min_tokens(x, states)
    else:
        states = [state] * (k + 1)

    if params.greedy:
        target = sampler.argmax(x).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == target[accepted]:
            accepted += 1
        tokens = drafts[:accepted] + [target[accepted]]
    else:
        probs = sampler.probabilities(x if x is not logits else x.clone(), states)
        accepted, tokens = _rejection_sample(sampler, probs, state, drafts, draft_probs)
    logprobs = None
    if raw is not None:
        ids = torch.tensor(tokens, device=raw.device)
        n = len(tokens)
        out = PendingSample(ids, n, *Sampler._logprobs(raw[:n], ids, list(range(n)), states[:n])).result()
        logprobs = list(zip(out.logprobs, out.top_logprobs))
    return VerifyResult(tokens, accepted, logprobs)


def verify_greedy_batch(
    logits: torch.Tensor, runs: list[list[int]], argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> list[VerifyResult]:
    """Several plain-greedy runs at once: ``logits`` holds their 1 + k rows back to back; one
    argmax (``argmax``, the sampler's; torch's by default) and one device-to-host copy for all
    (on a GPU, one sync instead of one per run)."""
    target = (logits.argmax(dim=-1) if argmax is None else argmax(logits)).tolist()
    out, row = [], 0
    for drafts in runs:
        k, accepted = len(drafts), 0
        while accepted < k and drafts[accepted] == target[row + accepted]:
            accepted += 1
        out.append(VerifyResult(drafts[:accepted] + [target[row + accepted]], accepted, None))
        row += k + 1
    return out


def _rejection_sample(
    sampler: Sampler, probs: torch.Tensor, state: SamplingState, drafts: list[int], draft_probs: torch.Tensor | None
) -> tuple[int, list[int]]:
    k = len(drafts)
    device = probs.device
    uniforms = sampler.uniforms(k, state, device) if k else []
    idx = torch.arange(k, device=device)
    d = torch.tensor(drafts, dtype=torch.long, device=device)
    p_draft = probs[idx, d].tolist() if k else []
    q_draft = [1.0] * k if draft_probs is None else draft_probs[idx, d].float().tolist()
    for j in range(k):
        if uniforms[j] * q_draft[j] < p_draft[j]:  # u < p / q, so q = 0 drafts are never accepted
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[drafts[j]] = 0.0
        else:
            residual = (probs[j] - draft_probs[j].float()).clamp_min_(0.0)
        total = residual.sum()
        if not total > 0:  # p == q: nothing to correct, the target's own distribution
            residual = probs[j].clone()
        token = sampler.draw(residual[None, :], [state])[0].item()
        return j, drafts[:j] + [int(token)]
    bonus = sampler.draw(probs[k : k + 1].clone(), [state])[0].item()
    return k, drafts + [int(bonus)]
