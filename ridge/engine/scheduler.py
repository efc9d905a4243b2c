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

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ridge.engine.request import Request, RequestStatus
from ridge.kv.manager import KVCacheManager


class ChunkKind(enum.Enum):
    """What a chunk computes; the one place that says it (runner, engine and telemetry read it).

    DECODE   a generated token, the request's newest: one query row, sampled
    VERIFY   the newest token plus k proposed ones: 1 + k query rows, all sampled
    PREFILL  prompt (or recomputed) tokens, sampled only when the chunk reaches the end

    Which attention path a chunk takes follows from its query rows (``decode_rows``): one-row
    chunks (DECODE, and a one-token PREFILL chunk, which costs the same) and VERIFY runs are
    decode rows (each row its own context length, so a run is causal); longer PREFILL chunks
    take the prefill path.
    """

    DECODE = "decode"
    VERIFY = "verify"
    PREFILL = "prefill"


@dataclass
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` starting at ``start`` (its computed tokens).

    A VERIFY chunk's tokens are the request's last token and then ``draft_token_ids``.
    """

    request: Request
    start: int
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None  # (k, V) tensor: the draft model's distributions (None: n-gram or greedy)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def kind(self) -> ChunkKind:
        if self.draft_token_ids:
            return ChunkKind.VERIFY
        if self.num_new_tokens == 1 and self.start >= self.request.num_prompt_tokens:
            return ChunkKind.DECODE
        return ChunkKind.PREFILL

    @property
    def decode_rows(self) -> bool:
        """Its query rows run on the decode attention path (see ``ChunkKind``)."""
        return self.num_new_tokens == 1 or bool(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so its logits give the next token."""
        return self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose logits are sampled: 0 (a prompt chunk short of the end), 1, or 1 + k."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    def token_ids(self) -> list[int]:
        """The tokens this chunk runs through the model."""
        if self.draft_token_ids:
            return [self.request.all_token_ids[self.start], *self.draft_token_ids]
        return self.request.all_token_ids[self.start : self.end]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decode-row chunks first
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


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
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0

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
        req.finish_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}
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
            draft_probs = req.spec_token_probs[: len(drafts)] if drafts and req.spec_token_probs is not None else None
            req.spec_token_ids, req.spec_token_probs = [], None  # consumed: verified this step, or dropped
            num_new += len(drafts)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id).num_new_tokens
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = ScheduledChunk(req, req.num_computed_tokens, num_new, drafts, draft_probs)
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
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            scheduled[req.request_id] = ScheduledChunk(req, num_hit_tokens, num_new)
            budget -= num_new

        chunks = sorted(scheduled.values(), key=lambda c: not c.decode_rows)
        return SchedulerOutput(chunks=chunks, preempted=preempted)

    def _chunk_size(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and queue it first, to be recomputed."""
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_token_probs = [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, int]]:
        """Advance computed tokens, append sampled tokens, finish what stopped.

        ``sampled``: request id -> the tokens its chunk produced (one, or for a VERIFY chunk
        the accepted drafts and the target's own token). Tokens after a stop (a stop token,
        eos, ``max_tokens``, the context limit) are dropped. Returns each request that
        received tokens this step (finished ones included) with how many it received.
        """
        now = time.monotonic()
        progressed = []
        for chunk in output.chunks:
            req = chunk.request
            if req.is_finished:  # aborted while the step ran
                continue
            if not chunk.samples:
                req.num_computed_tokens = chunk.end
                continue
            tokens = sampled[req.request_id]
            # A verify run computed the newest token and the drafts it accepted; the last
            # token it emits (the target's own) is computed next step, like any sampled token.
            req.num_computed_tokens = chunk.end - len(chunk.draft_token_ids) + len(tokens) - 1
            received = 0
            for token in tokens:
                req.append_output_token(token)
                received += 1
                status = req.check_stop(self.max_model_len)
                if status is not None:
                    self.finish(req, status)
                    break
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if chunk.draft_token_ids and not req.is_finished:
                self.kv.trim(req, req.num_tokens)  # blocks taken for rejected drafts go back
            progressed.append((req, received))
        return progressed
