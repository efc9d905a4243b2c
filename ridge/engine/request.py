"""A request as the scheduler sees it: computed tokens versus total tokens.

    all_token_ids:  [ prompt ............ | output ...... ]
                      num_computed_tokens ^               ^ num_tokens

Chunked prefill, prefix-cache hits and recompute after preemption are all the same thing:
advancing ``num_computed_tokens`` towards ``num_tokens``. A step that brings it there
samples one more token. Speculated tokens live apart (``spec_token_ids``) until a step
verifies them: only accepted ones join ``all_token_ids``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ridge.sampling import SamplingParams, SamplingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
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
    eos_token_ids: frozenset[int] = frozenset()
    sampling_state: SamplingState | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    block_hashes: list[bytes] = field(default_factory=list)  # filled by the KV manager
    spec_token_ids: list[int] = field(default_factory=list)  # proposed for the next step, unverified
    spec_token_probs: Any = None  # (k, V) tensor: the draft's distribution of each (None: n-gram, greedy)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

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

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first ``num_output_tokens`` (a stop string found
        inside a run of accepted tokens ends the output there)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop :]

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """After a new token: the finished status it causes, if any (stop strings are the detokenizer's)."""
        params, token = self.sampling_params, self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
