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

Multi-step scheduling (``num_scheduler_steps``, vLLM's ``--num-scheduler-steps``): a plan
whose every running request decodes one plain token runs several forward passes, its blocks
allotted for all of them (``_num_steps``); ``update`` then takes several tokens a request, as
it takes a verify run's.

Disaggregated serving (``kv_transfer/``) adds two holding places:

    parked      producer: finished requests whose blocks wait for a consumer's pull
                (``add_pull`` sends them, then frees them; ``park_timeout`` frees them anyway)
    receiving   consumer: admitted requests whose prompt's cache is on its way: admission
                looks up the prefix cache, allocates the prompt's blocks and pulls only the
                blocks it lacks; ``kv_received`` makes the request run from the first output
                token (which the producer sampled), ``kv_failed`` ends it
"""

from __future__ import annotations

import time
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
from ridge.kv_transfer.config import RemoteKV
from ridge.kv_transfer.connector import KVRecv, KVSend

__all__ = ["ChunkKind", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


# A producer frees a parked request's blocks after this long without a pull.
DEFAULT_PARK_TIMEOUT_S = 120.0


@dataclass
class Pull:
    """Consumer: the control message that asks a producer for a transfer's blocks
    ``[first_block, first_block + num_blocks)`` under ``tag`` (0 blocks: release them)."""

    req_id: str
    peer_id: str
    transfer_id: str
    first_block: int
    num_blocks: int
    tag: int

    def message(self) -> dict:
        return {
            "type": "pull",
            "transfer_id": self.transfer_id,
            "first_block": self.first_block,
            "num_blocks": self.num_blocks,
            "tag": self.tag,
        }


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "continuous"
    enable_chunked_prefill: bool = True
    num_scheduler_steps: int = 1  # a plan of plain decodes runs up to this many passes (_num_steps)

    def __post_init__(self) -> None:
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"scheduler policy must be 'continuous' or 'static', got {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.num_scheduler_steps < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and num_scheduler_steps must be >= 1")


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
        # disaggregated serving (module docstring)
        self.park_timeout = DEFAULT_PARK_TIMEOUT_S
        self.parked: dict[str, tuple[Request, float]] = {}  # transfer id -> (request, deadline)
        self.receiving: dict[str, Request] = {}
        self.pulls: list[Pull] = []  # due once the plan that posts their receives has run
        self._sends: list[KVSend] = []  # for the next plan
        self._releasing: list[Request] = []  # parked requests whose blocks the next plan sends
        self._loaded: list[str] = []  # received: copied into their blocks by the next plan
        self._next_tag = 1

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
        self.receiving.pop(req.request_id, None)
        if req.kv_park and status is not RequestStatus.FINISHED_ABORTED:
            self.parked[req.request_id] = (req, time.monotonic() + self.park_timeout)  # blocks kept
        else:
            self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if req.num_sent_tokens or req.kv_tag:
            self._finished_ids.append(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def kv_pending(self) -> bool:
        """A KV transfer is under way (or blocks wait for one): the engine must keep polling."""
        return bool(self.parked or self.receiving or self._sends or self._loaded or self.pulls)

    # -- disaggregated serving -----------------------------------------------------------------
    def add_pull(self, consumer_id: str, message: dict) -> str | None:
        """Producer: a consumer's pull. Its blocks go out with the next plan and are freed after
        it; returns why it cannot be served (an unknown or expired transfer: the answer is a
        refusal, which completes the consumer's receive and fails its request), else None."""
        entry = self.parked.pop(str(message.get("transfer_id")), None)
        first, count, tag = int(message["first_block"]), int(message["num_blocks"]), int(message["tag"])
        if count == 0:  # everything was in the consumer's prefix cache
            if entry is not None:
                self.kv.free(entry[0])
            return None
        block_ids = None
        if entry is not None:
            block_ids = self.kv.block_table(entry[0])[first : first + count]
            self._releasing.append(entry[0])
        if block_ids is None or len(block_ids) != count:
            self._sends.append(KVSend(consumer_id, tag, None, count))
            if entry is None:
                return f"transfer {message.get('transfer_id')!r} is unknown here (expired or never produced)"
            return f"transfer {message.get('transfer_id')!r} holds fewer than the {first + count} blocks asked for"
        self._sends.append(KVSend(consumer_id, tag, block_ids, count))
        return None

    def expired_parked(self, now: float | None = None) -> list[str]:
        """Producer: the parked transfers nobody pulled in time (the engine's KV-transfer
        coordinator withdraws their offers, then ``release_parked`` frees them)."""
        now = time.monotonic() if now is None else now
        return [tid for tid, (_, deadline) in self.parked.items() if deadline <= now]

    def release_parked(self, transfer_id: str) -> None:
        """Producer: a parked transfer's blocks were read (or expired): they return to the pool."""
        entry = self.parked.pop(transfer_id, None)
        if entry is not None:
            self.kv.free(entry[0])

    def kv_received(self, req_id: str) -> None:
        """Consumer: a transfer arrived; the request runs from its first output token."""
        req = self.receiving.pop(req_id, None)
        if req is None:  # aborted while the transfer ran
            return
        self._start_remote(req)
        self._loaded.append(req_id)

    def kv_failed(self, req_id: str) -> Request | None:
        """Consumer: a transfer failed: the request ends (aborted); returns it, if it was waiting."""
        req = self.receiving.get(req_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def _start_remote(self, req: Request) -> None:
        req.remote = None  # a later preemption recomputes locally
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens - 1
        self.running.append(req)

    def _admit_remote(self, req: Request, plan: SchedulerOutput) -> bool:
        """Consumer: admit a request whose prompt's cache a producer holds: allocate its blocks,
        pull the ones the prefix cache lacks (False: no room)."""
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        if not self.kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits, cache=False):
            return False
        self.kv.record_prefix_lookup(req.num_tokens, num_hit_tokens)
        self.waiting.popleft()
        req.num_computed_tokens = num_hit_tokens
        first = len(hits)
        # the prompt's blocks; the first output token (the producer's) is computed here
        needed = -(-(req.num_tokens - 1) // self.kv.block_size)
        count = max(0, needed - first)
        remote = req.remote
        tag = 0
        if count:
            tag, self._next_tag = self._next_tag, self._next_tag + 1
            req.kv_tag, req.status = tag, RequestStatus.WAITING_FOR_KV
            self.receiving[req.request_id] = req
            table = self.kv.block_table(req)
            plan.kv_recvs.append(KVRecv(remote.peer_id, req.request_id, tag, table[first:needed]))
        else:
            self._start_remote(req)
        self.pulls.append(Pull(req.request_id, remote.peer_id, remote.transfer_id, first, count, tag))
        return True

    def release_remote(self, req_id: str, remote: RemoteKV) -> None:
        """Consumer: a sequence that ended on the producer's first token needs no cache: the
        producer may free its blocks (a pull of none)."""
        self.pulls.append(Pull(req_id, remote.peer_id, remote.transfer_id, 0, 0, 0))

    def _waits_for_leader(self, req: Request) -> bool:
        leader = self.requests.get(req.follows) if req.follows is not None else None
        return leader is not None and leader.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_KV)

    def set_proposals(self, proposals: dict[str, tuple[list[int], object]]) -> None:
        """Tokens proposed for each request's next step (and their draft distributions, or
        None): a request that is not decoding next ignores them."""
        for rid, (tokens, probs) in proposals.items():
            req = self.requests.get(rid)
            if req is not None and req.status is RequestStatus.RUNNING:
                req.spec_token_ids, req.spec_token_probs = list(tokens), probs

    def decoding(self) -> list[Request]:
        """Running requests whose next step is a decode (those a proposer may speculate for)."""
        return [r for r in self.running if r.num_scheduled_tokens - r.num_computed_tokens == 1]

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int, int, list[int]]] = {}  # id -> (req, start, num_new, drafts)
        draft_probs: dict = {}
        preempted: list[Request] = []

        decodes = [r for r in self.running if r.num_scheduled_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_scheduled_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            if req.num_pending_tokens and req.num_output_tokens + req.num_pending_tokens >= req.max_tokens:
                continue  # its pending token is its last (length): nothing more to compute
            num_new = self._chunk_size(req.num_scheduled_tokens - req.num_computed_tokens, budget)
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
        plan = SchedulerOutput(preempted_req_ids=[r.request_id for r in preempted], draft_probs=draft_probs)
        held: list[Request] = []  # samples of a prompt whose cache is still on its way
        while (
            may_admit
            and self.waiting
            and budget > 0
            and len(self.running) + len(self.receiving) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if self._waits_for_leader(req) or req.num_pending_tokens:  # (preempted: its token is on its way)
                held.append(self.waiting.popleft())
                continue
            if req.remote is not None:
                if not self._admit_remote(req, plan):
                    break
                continue
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
        self.waiting.extendleft(reversed(held))

        plan.kv_sends, self._sends = self._sends, []
        plan.kv_loaded, self._loaded = self._loaded, []
        if scheduled or plan.kv_recvs or plan.kv_loaded:
            # an empty plan runs nowhere: the finished ids wait for the next one
            plan.finished_req_ids, self._finished_ids = self._finished_ids, []
        if self.config.num_scheduler_steps > 1 and not preempted and len(scheduled) == len(self.running):
            plan.num_steps = self._num_steps([req for req, *_ in scheduled.values()])
        for req, start, num_new, drafts in scheduled.values():
            self._send_deltas(req, plan)
            plan.chunks.append(self._chunk(req, start, num_new, drafts))
        plan.chunks.sort(key=lambda c: not c.decode_rows)
        return plan

    def _num_steps(self, reqs: list[Request]) -> int:
        """Multi-step scheduling (vLLM's ``--num-scheduler-steps``): how many forward passes a
        plan of these requests runs, their blocks allotted for all of them. More than one only
        where every running request decodes one plain token (nothing admitted or preempted
        this step; speculative decoding does not combine with it) whose sampling reads nothing
        a pass before it would have to hand back to the host (penalties and min_tokens read
        the output so far, a grammar its state; a generator to export is read after each
        sample), and no further than the nearest request's max_tokens or context limit, so
        that a request can only stop inside a run on a stop token or string (its passes after
        that are wasted, and the output processor drops their tokens). Where the pool cannot
        supply the blocks of every pass, one: the blocks taken for the first requests stay
        theirs, for their next tokens."""
        steps = self.config.num_scheduler_steps
        for req in reqs:
            p = req.sampling_params
            if (
                req.num_computed_tokens != req.num_tokens - 1
                or req.num_computed_tokens < req.num_prompt_tokens
                or req.kv_park
                or p.has_penalties
                or p.min_tokens
                or p.structured_outputs is not None
            ):
                return 1
            steps = min(steps, req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        if steps < 2 or not all(self.kv.allocate_slots(req, steps) for req in reqs):
            return 1
        return steps

    def launched(self, plan: SchedulerOutput) -> None:
        """Asynchronous scheduling: ``plan`` runs while the next one is scheduled. Its chunks
        count as computed now, and each sampling chunk's token as pending (the next plan
        computes it, fed by the workers); ``update(plan, ..., launched=True)`` brings the
        tokens."""
        for chunk in plan.chunks:
            req = self.requests.get(chunk.req_id)
            if req is None or req.is_finished:
                continue
            req.num_computed_tokens = chunk.end
            if chunk.samples:
                req.num_pending_tokens += 1

    @staticmethod
    def _chunk(req: Request, start: int, num_new: int, drafts: list[int]) -> ScheduledChunk:
        samples = start + num_new - len(drafts) == req.num_scheduled_tokens
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
                    export_generator=req.kv_park,
                    generator_state=req.generator_state,
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
        launched: bool = False,
    ) -> None:
        """Advance computed tokens, append the accepted tokens, finish what stopped.

        ``accepted``: request id -> the tokens its chunk produced that stand (one, or for a
        VERIFY chunk the accepted drafts and the target's own, cut after a stop); ``finished``:
        the requests the stop rules ended this step, with their status. ``launched``: the plan
        went through ``launched`` (its computed counts are set; its tokens were pending).
        """
        finished = finished or {}
        for req in self._releasing:  # the plan that sent their blocks has run
            self.kv.free(req)
        self._releasing = []
        for chunk in plan.chunks:
            req = self.requests.get(chunk.req_id)
            if req is None or req.is_finished:  # aborted while the step ran
                continue
            if launched:
                if chunk.samples:
                    req.num_pending_tokens -= 1
                    for token in accepted.get(chunk.req_id, ()):
                        req.append_output_token(token)
                    if chunk.req_id in finished:
                        self.finish(req, finished[chunk.req_id])
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
