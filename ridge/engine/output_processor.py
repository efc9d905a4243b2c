"""From sampled tokens to ``RequestOutput`` objects: stops, text and logprob texts.

The output processor is the one place that decides when a sequence stops: it takes each
step's sampled tokens (``RunnerOutput``) in order, applies the token rules
(``engine/stop.py``: stop token ids, eos, ``max_tokens``, the context limit) and the stop
strings its detokenizer finds, and tells the engine which tokens stand and which sequences
ended (the engine hands both to the scheduler as data). It keeps its own state per
sequence: output token ids, text, logprobs and the times that go into the metrics.

A *user request* (``RequestState``) is what a caller added: one prompt, ``n`` sequences
(``SequenceState``), each of them one scheduler request.

Logprob token texts (``Logprob.decoded_token``) follow vLLM's fields and one contract: the
sampled tokens' texts concatenate to the sequence's text. Each is the text that token adds
to ``.text`` (a SentencePiece token keeps its leading space; a character split over several
tokens belongs to the token that completes it), except that a stop token that ends the
output unseen (eos, a stop token id) carries its own rendered text, and that the text of a
stop string cut from the output stays with the tokens that produced it. The top
alternatives are decoded after the token before them, so their leading spaces show too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ridge.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ridge.engine.step import RunnerOutput, SchedulerOutput, TokenLogprobs
from ridge.engine.stop import ABORTED, STOPPED, StopLimits, check_stop
from ridge.engine.tokenizer import BaseTokenizer, IncrementalDetokenizer

__all__ = ["OutputProcessor", "RequestState", "SequenceState", "StepResult", "TokenLogprobs"]


@dataclass
class SequenceState:
    """One of a user request's n completions: its tokens, text state and times."""

    user_id: str
    seq_id: str  # the scheduler's request id
    limits: StopLimits
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    # Text only at the end: nobody reads it earlier (not streamed, no logprobs) and no stop
    # string needs it. Saves a detokenizer call per sequence per step.
    text_at_finish: bool = False

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def params(self):
        return self.limits.params


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    stream: bool = True  # an output every step (for streaming), or only the final one
    sequences: list[SequenceState] = field(default_factory=list)
    # when asked: one entry per prompt token (None for the first), filled as chunks compute
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # the prompt tokens' texts, token by token (they join into the decoded prompt)
    prompt_detokenizer: IncrementalDetokenizer | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)


@dataclass
class StepResult:
    """What one step's outputs decided, for the scheduler: the tokens that stand per
    sequence (cut after a stop), and the sequences that ended with their finish reason."""

    outputs: list[RequestOutput]
    accepted: dict[str, list[int]]
    finished: dict[str, str]


class OutputProcessor:
    """Owns the user requests' output state and every stop decision; see the module docstring."""

    def __init__(self, tokenizer: BaseTokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._sequence_of: dict[str, SequenceState] = {}  # scheduler request id -> sequence
        self._pending: dict[str, RequestState] = {}  # advanced by start_with, output at the next step

    # -- bookkeeping ----------------------------------------------------------------------
    def has_sequence(self, sequence_id: str) -> bool:
        return sequence_id in self._sequence_of

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for seq in state.sequences:
            self._sequence_of[seq.seq_id] = seq

    def remove(self, request_id: str) -> RequestState | None:
        """Forget a user request (finished or aborted); returns it, or None if unknown."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.sequences:
                self._sequence_of.pop(seq.seq_id, None)
        return state

    def abort(self, request_id: str) -> RequestState | None:
        """Forget a user request that has not finished: its sequences end as aborted."""
        state = self.remove(request_id)
        if state is not None:
            now = time.monotonic()
            for seq in state.sequences:
                if not seq.is_finished:
                    seq.finish_reason, seq.finish_time = ABORTED, now
        return state

    def start_with(self, sequence_id: str, token: int, logprobs: TokenLogprobs | None) -> bool:
        """A sequence's first token, sampled elsewhere (a producer, in disaggregated serving):
        taken like a sampled one (stops, text, logprobs); its output comes with the next step.
        Returns whether the token ended the sequence."""
        seq = self._sequence_of[sequence_id]
        now = time.monotonic()
        seq.first_scheduled_time = seq.first_scheduled_time or now
        self._add_run(seq, [token], [logprobs] if logprobs is not None else None, now)
        self._pending[seq.user_id] = self.requests[seq.user_id]
        return seq.is_finished

    def take_pending(self) -> list[RequestOutput]:
        """Outputs of the requests ``start_with`` advanced since the last step."""
        outputs = []
        for state in self._take_pending().values():
            outputs.extend(self._emit(state))
        return outputs

    def _take_pending(self) -> dict[str, RequestState]:
        pending, self._pending = self._pending, {}
        return {rid: st for rid, st in pending.items() if rid in self.requests}

    def _emit(self, state: RequestState) -> list[RequestOutput]:
        done = state.finished
        out = [self._make_output(state)] if state.stream or done else []
        if done:
            self.remove(state.request_id)
        return out

    def fail(self, sequence_id: str, message: str) -> tuple[RequestOutput, list[str]] | None:
        """End the user request that sequence ``sequence_id`` belongs to with an error: its
        final output carries ``message``; returns it and the request's sequence ids (the
        caller aborts them in the scheduler)."""
        seq = self._sequence_of.get(sequence_id)
        if seq is None:
            return None
        state = self.abort(seq.user_id)
        output = self._make_output(state)
        output.error = message
        return output, [s.seq_id for s in state.sequences]

    # -- one step -------------------------------------------------------------------------
    def process(self, plan: SchedulerOutput, out: RunnerOutput, now: float | None = None) -> StepResult:
        """Apply a step's sampled tokens: stops, text, logprobs. Outputs for the user requests
        that progressed (streamed ones every step, the others when they finish); finished
        user requests are forgotten.

        A VERIFY run may bring several tokens; a stop (token or string) inside it ends the
        output at the token that caused it, and the tokens after it are dropped.
        """
        now = time.monotonic() if now is None else now
        for new in plan.new_requests:
            seq = self._sequence_of.get(new.req_id)
            if seq is not None and seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                seq.num_cached_tokens = new.num_computed_tokens
        for rid, (first, entries) in out.prompt_logprobs.items():
            self._add_prompt_logprobs(rid, first, entries)
        accepted: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        touched: dict[str, RequestState] = self._take_pending()
        for rid, tokens in out.sampled.items():
            seq = self._sequence_of.get(rid)
            if seq is None or seq.is_finished:  # aborted while the step ran
                continue
            kept = self._add_run(seq, tokens, out.logprobs.get(rid), now)
            accepted[rid] = kept
            if seq.is_finished:
                finished[rid] = seq.finish_reason
            # A user request finishes only in a step where one of its sequences finishes.
            state = self.requests[seq.user_id]
            if seq.user_id not in touched and (seq.is_finished or state.stream):
                touched[seq.user_id] = state
        outputs = []
        for state in touched.values():
            outputs.extend(self._emit(state))
        return StepResult(outputs, accepted, finished)

    def _add_run(self, seq: SequenceState, tokens: list[int], logprobs: list[TokenLogprobs] | None, now: float):
        """Take a sequence's new tokens in order until one ends it; returns those that stand."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        limits, out = seq.limits, seq.output_token_ids
        params = limits.params
        for j, token in enumerate(tokens):
            out.append(token)
            stop = check_stop(limits, token, len(out))
            if stop is not None:
                seq.finish_reason, seq.stop_reason = stop
            if seq.text_at_finish:
                if seq.is_finished:
                    # A sequence stopped on eos or a stop token id: that token's text is not shown.
                    hide = seq.finish_reason == STOPPED and not params.include_stop_str_in_output
                    seq.detokenizer.add_tokens(out[:-1] if hide else out)
            else:
                # eos or a stop token id that ended the output: its text is not shown
                stopped_on_token = seq.finish_reason == STOPPED
                show_token = not stopped_on_token or params.include_stop_str_in_output
                stop_string = seq.detokenizer.add_tokens([token]) if show_token else None
                if stop_string is not None and not seq.is_finished:
                    seq.finish_reason, seq.stop_reason = STOPPED, stop_string
                if seq.logprobs is not None and logprobs is not None:
                    token_text = seq.detokenizer.take_token_text(final=seq.is_finished)
                    if not show_token:  # the unseen stop token: its own rendered text
                        token_text += self.tokenizer.piece(token).text
                    before = out[-2] if len(out) > 1 else self.requests[seq.user_id].prompt_token_ids[-1]
                    seq.logprobs.append(self._logprob_entry(before, token, token_text, *logprobs[j]))
                    seq.cumulative_logprob += logprobs[j][0]
            if seq.is_finished:
                seq.finish_time = now
                return tokens[: j + 1]
        return list(tokens)

    def _add_prompt_logprobs(self, rid: str, first: int, entries: list) -> None:
        """Prompt positions not seen yet (a recompute after preemption repeats some); from the
        first of a request's n sequences only (they share the prompt)."""
        seq = self._sequence_of.get(rid)
        if seq is None:
            return
        state = self.requests[seq.user_id]
        if state.prompt_logprobs is None or seq is not state.sequences[0]:
            return
        collected = state.prompt_logprobs
        prompt = state.prompt_token_ids
        if state.prompt_detokenizer is None:
            state.prompt_detokenizer = IncrementalDetokenizer(self.tokenizer, [])
            state.prompt_detokenizer.add_tokens(prompt[:1])
            state.prompt_detokenizer.take_token_text(final=len(prompt) == 1)
        for pos, e in enumerate(entries, start=first):
            if pos != len(collected):
                continue
            before = prompt[pos - 1]
            state.prompt_detokenizer.add_tokens([e.token])
            text = state.prompt_detokenizer.take_token_text(final=pos == len(prompt) - 1)
            entry = {e.token: Logprob(e.logprob, e.rank, text)}
            for rank, (tid, lp) in enumerate(e.top, start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self._text_after(before, tid))
            collected.append(entry)

    def _logprob_entry(
        self, before: int, token: int, token_text: str, lp: float, top: list[tuple[int, float]]
    ) -> dict[int, Logprob]:
        entry = {
            tid: Logprob(tlp, rank, token_text if tid == token else self._text_after(before, tid))
            for rank, (tid, tlp) in enumerate(top, start=1)
        }
        if token not in entry:
            entry[token] = Logprob(lp, None, token_text)
        return entry

    def _text_after(self, before: int, token: int) -> str:
        """``token``'s text when it follows ``before`` (keeps a SentencePiece leading space)."""
        context = self.tokenizer.decode([before], skip_special_tokens=False)
        both = self.tokenizer.decode([before, token], skip_special_tokens=False)
        if both.startswith(context):
            return both[len(context) :]
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _make_output(self, state: RequestState) -> RequestOutput:
        completions = []
        for index, seq in enumerate(state.sequences):
            finished = seq.is_finished
            delta_ids = seq.output_token_ids[seq.num_sent_tokens :]
            seq.num_sent_tokens = len(seq.output_token_ids)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=seq.detokenizer.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=seq.logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_text=seq.detokenizer.take_delta(finished=finished),
                    delta_token_ids=delta_ids,
                )
            )
        seqs = state.sequences

        def earliest(name: str) -> float | None:
            times = [getattr(s, name) for s in seqs if getattr(s, name) is not None]
            return min(times) if times else None

        def latest(name: str) -> float | None:
            times = [getattr(s, name) for s in seqs if getattr(s, name) is not None]
            return max(times) if times else None

        metrics = RequestMetrics(
            arrival_time=state.arrival_time,
            first_scheduled_time=earliest("first_scheduled_time"),
            first_token_time=earliest("first_token_time"),
            last_token_time=latest("last_token_time"),
            finish_time=latest("finish_time") if state.finished else None,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            metrics=metrics,
            num_cached_tokens=max(seqs[0].num_cached_tokens, 0),
            prompt_logprobs=state.prompt_logprobs,
        )
