"""The step as plain data: what the scheduler hands the workers, and what comes back.

Everything here is ids, token ids, block ids and numbers (plus, for a draft model's
proposals, their distributions as tensors), keyed by request id, so a plan pickles to a
worker in another process and back. No object here is shared with the scheduler: a worker
keeps its own state per request (token ids, block table, sampling state) and updates it from
each plan's deltas (vLLM v1's ``NewRequestData`` / ``CachedRequestData``):

    new request        every token id known so far, its sampling params, its block ids
    cached request     the token ids accepted since the last plan that named it, the block
                       ids it gained (from ``first_block`` on: blocks past it were trimmed
                       or, after a preemption, all freed), its computed count
    finished_req_ids   requests whose state the workers drop (finished or aborted)

A plan's chunks then say what to compute this step: ``num_new_tokens`` tokens of a request
from position ``start``, plus the proposed tokens a VERIFY chunk checks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ridge.kv_transfer.connector import KVRecv, KVSend
from ridge.sampling import SamplingParams


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
    """``num_new_tokens`` tokens of request ``req_id`` from position ``start``.

    A VERIFY chunk's tokens are the request's last token and then ``draft_token_ids``.
    ``samples``: the chunk reaches the request's last token, so its logits give the next one.
    """

    req_id: str
    start: int
    num_new_tokens: int
    kind: ChunkKind
    samples: bool
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def decode_rows(self) -> bool:
        """Its query rows run on the decode attention path (see ``ChunkKind``)."""
        return self.num_new_tokens == 1 or bool(self.draft_token_ids)


@dataclass
class NewRequestData:
    """A request the workers have not seen (or forgot): everything they keep about it."""

    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # disaggregated serving: a producer's request reports its generator state after sampling
    # (a seeded sample goes on from there on the consumer); a consumer's starts from one
    export_generator: bool = False
    generator_state: bytes | None = None


@dataclass
class CachedRequestData:
    """What changed for a request the workers already hold."""

    req_id: str
    new_token_ids: list[int]  # accepted since the last plan that named it
    first_block: int  # the block table is kept up to here, then ``new_block_ids`` follow
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decode-row chunks first
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # workers drop their state
    preempted_req_ids: list[str] = field(default_factory=list)
    # a draft model's distributions of a VERIFY chunk's proposals, (k, V) each (rank 0 only)
    draft_probs: dict[str, Any] = field(default_factory=dict)
    # disaggregated serving (kv_transfer/connector.py): blocks to send to a consumer, transfers
    # to receive from a producer, received transfers to copy into their blocks before the forward
    kv_sends: list[KVSend] = field(default_factory=list)
    kv_recvs: list[KVRecv] = field(default_factory=list)
    kv_loaded: list[str] = field(default_factory=list)
    # structured output (rank 0 only): an int32 token bitmask, one row per constrained
    # sequence that samples this step (``grammar_rows``: its row); masked before sampling
    grammar_bitmask: Any = None
    grammar_rows: dict[str, int] = field(default_factory=dict)
    # multi-step scheduling (vLLM's --num-scheduler-steps): a plan of plain decodes only runs
    # this many forward passes, each on the tokens the one before sampled, one position on; every
    # chunk's request then gets ``num_steps`` tokens (the scheduler allotted their slots)
    num_steps: int = 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do (no chunk and no KV transfer)."""
        return not (self.chunks or self.kv_sends or self.kv_recvs or self.kv_loaded)


@dataclass
class PromptLogprob:
    token: int
    logprob: float
    rank: int  # 1 = the most likely token at its position
    top: list[tuple[int, float]]  # the top-k (token, logprob), best first


# (sampled token's logprob, [(token id, logprob) of the top alternatives])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]]  # request id -> new tokens (one, a verify run's 1 .. k + 1, or num_steps)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # where asked, per new token
    # where asked: request id -> (prompt position of the first entry, one entry per position)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    verified: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (proposed, accepted)
    experts_touched: float | None = None  # distinct experts read per MoE layer (mean); None: dense
    comm_s: float = 0.0  # seconds this step spent in collectives (tensor parallelism)
    matmul_s: float | None = None  # seconds in the linear kernels (CPU; None where not timed)
    # seconds by kind of op where the kernels time them (the CPU extensions' step_parts.h:
    # attention, norms, ..., and inside matmul_s the block formats' matmul_setup and
    # matmul_wait); None where not timed
    step_parts: dict[str, float] | None = None
    generator_states: dict[str, bytes] = field(default_factory=dict)  # export_generator requests, seeded
