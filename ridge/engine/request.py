"""A request as the scheduler sees it (the scheduler's own object, never shared): computed
tokens versus total tokens.

    all_token_ids:  [ prompt ............ | output ...... ]
                      num_computed_tokens ^               ^ num_tokens

Chunked prefill, prefix-cache hits and recompute after preemption are all the same thing:
advancing ``num_computed_tokens`` towards ``num_tokens``. A step that brings it there
samples one more token. Speculated tokens live apart (``spec_token_ids``) until a step
verifies them: only accepted ones join ``all_token_ids``. Whether a token ends the request is
decided elsewhere (``engine/stop.py``, applied by the output processor); the scheduler is told.

Disaggregated serving (``kv_transfer/``): a producer's request with ``kv_park`` keeps its
blocks when it finishes, for a consumer to pull; a consumer's request with ``remote`` starts
from the first token the producer sampled and gets its prompt's cache from that producer
(``follows``: a later sample of the same prompt, admitted once the first has its cache, to
find the shared blocks in the prefix cache).

``num_sent_tokens`` / ``num_sent_blocks``: how much of the token ids and block table the
workers hold (the scheduler sends them deltas, ``engine/step.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ridge.kv_transfer.config import RemoteKV
from ridge.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # admitted, holding blocks: its prompt's cache is on its way
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: the user's max_tokens, capped by the context limit
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # filled by the KV manager
    spec_token_ids: list[int] = field(default_factory=list)  # proposed for the next step, unverified
    spec_token_probs: Any = None  # (k, V) tensor: the draft's distribution of each (None: n-gram, greedy)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_sent_tokens: int = 0  # token ids the workers hold (0: the workers do not know it)
    num_sent_blocks: int = 0  # leading block ids of the table the workers hold
    kv_park: bool = False  # producer: keep the blocks after finishing, for a consumer to pull
    remote: RemoteKV | None = None  # consumer: the prompt's cache comes from a producer
    generator_state: bytes | None = None  # consumer: a seeded sample goes on from the producer's draws
    follows: str | None = None  # consumer, n > 1: admitted once this sequence has its cache
    kv_tag: int = 0  # consumer: the tag of its transfer (0: none posted)
    # asynchronous scheduling: tokens that launched steps sample and the host does not know yet
    # (their positions count as scheduled; the workers feed them to the next step themselves)
    num_pending_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens known, plus those launched steps are sampling (asynchronous scheduling)."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
