"""Iteration-level scheduling (continuous batching), in the vLLM v1 spirit.

Each step builds a token budget (``max_num_batched_tokens``) like this:

    1. running decodes (one token each, or 1 + k to verify k proposed tokens), oldest first;
    2. running requests still in prefill, a chunk each (as much as the budget allows);
    3. waiting requests, FIFO, a chunk each, up to ``max_num_seqs`` running sequences,
       starting after their prefix-cache hits.

When the KV pool cannot supply a block, the most recently admitted running request is
preempted: its blocks are freed and it returns to the head of the queue, to be recomputed
(its cached blocks usually survive, so the recompute is mostly prefix hits). Old requests
keep their blocks, so every request eventually runs alone if need be, and the engine
refuses at admission any request that could not fit the whole pool: no deadlock.

``static`` admits a batch only when nothing runs, and runs it until every member finishes:
the baseline that continuous batching is measured against.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ridge.engine.request import Request, RequestStatus
from ridge.engine.step import (
    CachedRequestData,
    ChunkKind,
    NewRequestData,
    ScheduledChunk,
    SchedulerOutput,
)
from ridge.kv.manager import KVCacheManager

__all__ = ["ChunkKind", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "continuous"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"scheduler policy must be 'continuous' or 'static', got {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


class Scheduler:
    """Owns the requests (``Request``, never shared) and the KV manager; each ``schedule``
    returns a plan of plain data (``engine/step.py``), each ``update`` takes what the step
    produced and what the stop rules decided."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self._finished_ids: list[str] = []  # since the last plan: the workers drop these

    # -- requests -----------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish a request now: it leaves the queues and its blocks return to the pool."""
        if req.is_finished:
            return
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if req.num_sent_tokens:
            self._finished_ids.append(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def set_proposals(self, proposals: dict[str, tuple[list[int], object]]) -> None:
        """Tokens proposed for each request's next step (and their draft distributions, or
        None): a request that is not decoding next ignores them."""
        for rid, (tokens, probs) in proposals.items():
            req = self.requests.get(rid)
            if req is not None and req.status is RequestStatus.RUNNING:
                req.spec_token_ids, req.spec_token_probs = list(tokens), probs

    def decoding(self) -> list[Request]:
        """Running requests whose next step is a decode (those a proposer may speculate for)."""
        return [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int, int, list[int]]] = {}  # id -> (req, start, num_new, drafts)
        draft_probs: dict = {}
        preempted: list[Request] = []

        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = self._chunk_size(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 0:
                continue
            drafts = req.spec_token_ids[: budget - 1] if num_new == 1 else []
            if drafts and req.spec_token_probs is not None:
                draft_probs[req.request_id] = req.spec_token_probs[: len(drafts)]
            req.spec_token_ids, req.spec_token_probs = [], None  # consumed: verified this step, or dropped
            num_new += len(drafts)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)[2]
                    draft_probs.pop(victim.request_id, None)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = (req, req.num_computed_tokens, num_new, drafts)
                budget -= num_new

        # Static batching admits only into an empty engine; nobody is admitted in a step
        # that had to preempt (memory is short).
        may_admit = not preempted and (self.config.policy == "continuous" or not self.running)
        while may_admit and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.sampling_params.prompt_logprobs is None:
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            else:  # every prompt position's logits are wanted: compute them all
                hits, num_hit_tokens = [], 0
            num_new = self._chunk_size(req.num_tokens - num_hit_tokens, budget)
            if num_new == 0 or not self.kv.allocate_slots(req, num_new, hits):
                break
            self.kv.record_prefix_lookup(req.num_tokens, num_hit_tokens)
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens
            scheduled[req.request_id] = (req, num_hit_tokens, num_new, [])
            budget -= num_new

        plan = SchedulerOutput(preempted_req_ids=[r.request_id for r in preempted], draft_probs=draft_probs)
        if scheduled:  # an empty plan runs nowhere: the finished ids wait for the next one
            plan.finished_req_ids, self._finished_ids = self._finished_ids, []
        for req, start, num_new, drafts in scheduled.values():
            self._send_deltas(req, plan)
            plan.chunks.append(self._chunk(req, start, num_new, drafts))
        plan.chunks.sort(key=lambda c: not c.decode_rows)
        return plan

    @staticmethod
    def _chunk(req: Request, start: int, num_new: int, drafts: list[int]) -> ScheduledChunk:
        samples = start + num_new - len(drafts) == req.num_tokens
        if drafts:
            kind = ChunkKind.VERIFY
        elif num_new == 1 and start >= req.num_prompt_tokens:
            kind = ChunkKind.DECODE
        else:
            kind = ChunkKind.PREFILL
        return ScheduledChunk(req.request_id, start, num_new, kind, samples, drafts)

    def _send_deltas(self, req: Request, plan: SchedulerOutput) -> None:
        """What the workers lack of a scheduled request: all of it, or its new tokens and blocks."""
        table = self.kv.block_table(req)
        if not req.num_sent_tokens:
            plan.new_requests.append(
                NewRequestData(
                    req.request_id,
                    list(req.all_token_ids),
                    req.num_prompt_tokens,
                    req.sampling_params,
                    list(table),
                    req.num_computed_tokens,
                )
            )
        else:
            first = min(req.num_sent_blocks, len(table))
            plan.cached_requests.append(
                CachedRequestData(
                    req.request_id,
                    req.all_token_ids[req.num_sent_tokens :],
                    first,
                    table[first:],
                    req.num_computed_tokens,
                )
            )
        req.num_sent_tokens = req.num_tokens
        req.num_sent_blocks = len(table)

    def _chunk_size(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and queue it first, to be recomputed (the workers
        keep its tokens and sampling state; its block table comes again whole)."""
        self.kv.free(req)
        req.num_sent_blocks = 0
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_token_probs = [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(
        self,
        plan: SchedulerOutput,
        accepted: dict[str, list[int]],
        finished: dict[str, RequestStatus] | None = None,
    ) -> None:
        """Advance computed tokens, append the accepted tokens, finish what stopped.

        ``accepted``: request id -> the tokens its chunk produced that stand (one, or for a
        VERIFY chunk the accepted drafts and the target's own, cut after a stop); ``finished``:
        the requests the stop rules ended this step, with their status.
        """
        finished = finished or {}
        for chunk in plan.chunks:
            req = self.requests.get(chunk.req_id)
            if req is None or req.is_finished:  # aborted while the step ran
                continue
            if not chunk.samples:
                req.num_computed_tokens = chunk.end
                continue
            tokens = accepted.get(chunk.req_id, ())
            # A verify run computed the newest token and the drafts it accepted; the last
            # token it emits (the target's own) is computed next step, like any sampled token.
            req.num_computed_tokens = chunk.end - len(chunk.draft_token_ids) + len(tokens) - 1
            for token in tokens:
                req.append_output_token(token)
            status = finished.get(chunk.req_id)
            if status is not None:
                self.finish(req, status)
            elif chunk.draft_token_ids:
                self.kv.trim(req, req.num_tokens)  # blocks taken for rejected drafts go back
                req.num_sent_blocks = min(req.num_sent_blocks, len(self.kv.block_table(req)))
