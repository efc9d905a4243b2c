"""Between steps: decide how many tokens to speculate and ask the proposer for them.

The engine calls ``propose`` after a step's outputs are built, with the sequences whose next
step is a decode (token ids and params, ``ProposalRequest``) and how many more tokens each may
emit; the proposals it returns (tokens, and from a draft model their distributions) go to the
scheduler, which turns each into a VERIFY chunk of 1 + k rows. ``record`` takes each verify
run's outcome. The proposer behind it follows ``spec_decode/proposer.py``'s protocol.
"""

from __future__ import annotations

import time

from ridge.spec_decode.config import SpeculativeConfig
from ridge.spec_decode.policy import SpeculationPolicy
from ridge.spec_decode.proposer import Proposal, ProposalRequest, Proposer
from ridge.spec_decode.stats import SpecDecodeStats


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, policy: SpeculationPolicy | None) -> None:
        self.config = config
        self.proposer = proposer
        self.cost_model = policy  # the roofline's view of a verify step (benchmarks' predictions)
        self.policy = policy if config.adaptive else None
        self.stats = SpecDecodeStats()
        self.last_k = config.num_speculative_tokens
        self.propose_s = 0.0  # time spent proposing (the draft model's passes)
        self.cost_model_proposer_cost = policy.proposer_cost if policy is not None else 0.0
        self._draft_cost: float | None = None  # measured: seconds per drafted token / a step's
        self._step_s: float | None = None  # moving average of a step's wall time
        self._next: tuple[int, int] | None = None  # the next step's (decoding sequences, drafts each at most)
        # sequences the last proposal round (or peek) drafted for; None: no round yet
        self.found: int | None = None

    def propose(self, decoding: list[ProposalRequest], room: dict[str, int], running: set[str]) -> dict[str, Proposal]:
        """Proposals for the sequences in ``decoding``; ``room``: tokens each may still emit
        (max_tokens and the context limit); ``running``: every running sequence (the
        proposer forgets the others)."""
        start = time.perf_counter()
        self.proposer.forget_except(running)
        self._next = (len(decoding), 0) if decoding else None
        k = self.choose_k(len(decoding), max((len(r.token_ids) for r in decoding), default=0))
        if k == 0 or not decoding:
            return {}
        # the step runs as this choice makes it, drafts found or not (with asynchronous
        # scheduling, synchronously): its time prices k
        self._next = (len(decoding), k)
        # No draft past max_tokens or the context limit: a run emits at most k + 1 tokens. A
        # draft model with a shorter context proposes while the sequence fits it: its last
        # fed draft sits at position N + k - 2.
        draft_len = self.proposer.max_model_len
        limits = {}
        for r in decoding:
            limit = min(k, room[r.req_id] - 1)
            if draft_len is not None:
                limit = min(limit, draft_len - len(r.token_ids) + 1)
            limits[r.req_id] = limit
        wanted = [r for r in decoding if limits[r.req_id] > 0]
        if not wanted:
            self.found = 0
            return {}
        k_run = min(k, max(limits[r.req_id] for r in wanted))
        proposed = self.proposer.propose(wanted, k_run)
        out = {}
        for rid, (tokens, probs) in proposed.items():
            limit = limits[rid]
            if limit > 0 and len(tokens):
                out[rid] = (tokens[:limit], probs[:limit] if probs is not None else None)
        elapsed = time.perf_counter() - start
        self.propose_s += elapsed
        self.found = len(out)
        if self.policy is not None:
            self.policy.observe_coverage(len(out), len(decoding))
        pass_s = self.proposer.pass_s
        if pass_s is None and out:
            pass_s = elapsed / k_run  # a proposer without a model (n-gram): its lookup's time a token
        if self.policy is not None and self._step_s and pass_s is not None:
            # The proposer's measured cost per proposed token (a draft's one-token pass, not the
            # catch-up pass that prefills new prompts), relative to a target step: where steps
            # are bound by launches and Python (a GPU here), not by the roofline, this is what
            # it costs.
            measured = pass_s / self._step_s
            self._draft_cost = (
                measured if self._draft_cost is None else self._draft_cost + 0.1 * (measured - self._draft_cost)
            )
            self.policy.proposer_cost = max(self.cost_model_proposer_cost, self._draft_cost)
        return out

    @property
    def peeks(self) -> bool:
        """Whether the engine should ``peek`` after collecting a pipelined step: the proposer
        costs host time only and the policy's last choice was to draft."""
        return self.proposer.host_only and self.last_k > 0

    def peek(self, decoding: list[ProposalRequest]) -> None:
        """Between pipelined steps (``--async-scheduling``): what the proposer drafts from the
        tokens collected so far (one behind: the next is on the device), observed as the
        drafted share, without drafting. Lookup that finds nothing then keeps the steps
        pipelined (``drafts_nothing``) instead of costing a synchronous step to find out; one
        that finds drafts ends the pipeline for a verify step."""
        if not decoding:
            return
        start = time.perf_counter()
        found = self.proposer.propose(decoding, 1)
        self.propose_s += time.perf_counter() - start
        self.found = len(found)
        if self.policy is not None:
            self.policy.observe_coverage(len(found), len(decoding))

    def drafts_nothing(self) -> bool:
        """For a host-only proposer: its last proposal round or peek drafted for no sequence, or
        it has not looked yet (the peek after the next pipelined step will). A draft model is
        never peeked at (each look is model passes), so its steps keep to the policy's k."""
        return self.proposer.host_only and not self.found

    def choose_k(self, batch: int, context: int) -> int:
        """How many tokens to draft for the next step of ``batch`` decoding sequences of up to
        ``context`` tokens (the policy's choice, or the configured k without one); ``last_k``
        keeps it. The engine also asks it before pipelining a step (``--async-scheduling``)."""
        k = self.config.num_speculative_tokens
        if self.policy is not None and batch:
            k = self.policy.choose_k(batch, context)
        self.last_k = k
        return k

    def observe_plain_step(self, batch: int, step_s: float) -> None:
        """A decode step the engine ran without asking for proposals (a pipelined one)."""
        self._next = None
        if self.policy is not None:
            self.policy.observe_step(batch, 0, step_s)

    def report(self) -> dict:
        """What speculation gained so far (the bench JSON's ``speculation``)."""
        out = {"method": self.config.method, "max_k": self.config.num_speculative_tokens, **self.stats.as_dict()}
        out["last_k"] = self.last_k
        out["propose_s"] = round(self.propose_s, 4)
        if self.policy is not None:
            out["acceptance_estimate"] = round(self.policy.acceptance, 4)
        return out

    def format(self) -> str:
        s = self.stats
        by_pos = " ".join(f"{a:.2f}" for a in s.acceptance_by_position())
        return (
            f"speculation ({self.config.method}, k <= {self.config.num_speculative_tokens}"
            f"{', adaptive' if self.policy is not None else ''}): {s.num_draft_tokens} proposed, "
            f"{s.num_accepted_tokens} accepted ({100 * s.acceptance_rate:.1f}%), "
            f"{s.mean_accepted_length:.2f} tokens per verify run; acceptance by position: {by_pos or '-'}"
        )

    def record(
        self, verified: dict[str, tuple[int, int]], step_s: float | None = None, decode_only: bool = True
    ) -> None:
        """A step's verify outcomes, and its wall time: the draft's relative cost and, for a
        step of decodes and verifies alone (``decode_only``), the policy's measured T(k)."""
        if step_s is not None:
            self._step_s = step_s if self._step_s is None else self._step_s + 0.1 * (step_s - self._step_s)
            if self.policy is not None and decode_only and self._next is not None:
                self.policy.observe_step(*self._next, step_s)
                batch, k = self._next
                if k and batch >= len(verified):  # what the step emitted a decoding sequence
                    emitted = sum(accepted + 1 for _, accepted in verified.values()) + batch - len(verified)
                    self.policy.observe_yield(batch, k, emitted / batch)
        self._next = None
        for num_drafts, num_accepted in verified.values():
            self.stats.record(num_drafts, num_accepted)
            if self.policy is not None:
                self.policy.observe(num_drafts, num_accepted)
