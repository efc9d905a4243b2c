"""When a sequence stops: the token rules. The output processor is the one place that applies
them, together with stop strings (which need the text), token by token in order.

After each new token, in this order (vLLM's):

    1. once ``min_tokens`` are out: a stop token id (stop_reason = the id), or eos unless
       ``ignore_eos`` ends it as "stop";
    2. ``max_tokens`` out, or the context limit reached, ends it as "length".
"""

from __future__ import annotations

from dataclasses import dataclass

from ridge.sampling import SamplingParams

STOPPED = "stop"
LENGTH = "length"
ABORTED = "abort"


@dataclass(frozen=True)
class StopLimits:
    """What one sequence's stop rules need beyond its params (resolved at admission)."""

    params: SamplingParams
    max_tokens: int  # the user's max_tokens, capped by the context limit
    num_prompt_tokens: int
    max_model_len: int
    eos_token_ids: frozenset[int]


def check_stop(limits: StopLimits, token: int, num_output_tokens: int) -> tuple[str, int | None] | None:
    """After ``token`` became output token number ``num_output_tokens``: (finish reason, stop
    reason) if it ends the sequence, else None. String stops are the detokenizer's."""
    params = limits.params
    if num_output_tokens >= params.min_tokens:
        if token in params.stop_token_ids:
            return STOPPED, token
        if not params.ignore_eos and token in limits.eos_token_ids:
            return STOPPED, None
    if num_output_tokens >= limits.max_tokens or limits.num_prompt_tokens + num_output_tokens >= limits.max_model_len:
        return LENGTH, None
    return None
