"""The proposer protocol, and the one factory that builds a proposer from the config.

A proposer sees token ids and sampling params, never the scheduler's objects:

    propose(requests: list[ProposalRequest], k) -> {request id: (tokens, probs or None)}
    forget_except(running ids)   drop per-sequence state of sequences no longer running
    pass_s                       seconds of its last one-token pass (None: runs no model)
    take_passes()                the model passes run since the last call (for the telemetry)
    max_model_len                the longest sequence it can propose for (None: no limit)
    host_only                    proposing costs host time only, no model pass (n-gram): the
                                 engine may look between pipelined steps (``Speculator.peek``)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ridge.sampling import SamplingParams
from ridge.spec_decode.config import SpeculativeConfig


@dataclass
class ProposalRequest:
    """One sequence whose next step is a decode: its accepted token ids (prompt + output;
    read-only), and the params it samples with."""

    req_id: str
    token_ids: list[int]
    params: SamplingParams


Proposal = tuple[list[int], torch.Tensor | None]  # tokens, and their (k, V) distributions or None


class Proposer(Protocol):
    pass_s: float | None
    max_model_len: int | None
    host_only: bool

    def propose(self, requests: list[ProposalRequest], k: int) -> dict[str, Proposal]: ...

    def forget_except(self, running: set[str]) -> None: ...

    def take_passes(self) -> list: ...


def make_proposer(
    spec: SpeculativeConfig,
    *,
    target_vocab_size: int,
    num_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    seed: int,
    kernels: str,
    max_num_seqs: int = 256,
) -> Proposer:
    """The proposer ``spec`` names. A draft model gets its own KV pool of at least
    ``num_tokens`` tokens (the target's pool plus room for each sequence's drafts)."""
    if spec.method == "ngram":
        from ridge.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from ridge.spec_decode.draft import DraftProposer

    return DraftProposer.load(
        spec.model,
        spec.draft_options,
        target_vocab_size=target_vocab_size,
        num_tokens=num_tokens,
        dtype=dtype,
        device=device,
        block_size=block_size,
        seed=seed,
        kernels=kernels,
        max_num_seqs=max_num_seqs,
        num_speculative_tokens=spec.num_speculative_tokens,
    )
