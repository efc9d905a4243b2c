"""From sampled tokens to ``RequestOutput`` objects: text, stop strings and logprob texts.

The engine's step ends here: ``Scheduler.update`` has appended each new token to its
request; the output processor feeds the tokens to each sequence's detokenizer, finds stop
strings (the scheduler finishes those requests), prices logprobs with token texts, and
builds the outputs of the user requests that progressed.

A *user request* (``RequestState``) is what a caller added: one prompt, ``n`` sequences
(``SequenceState``), each of them one scheduler ``Request``.

Logprob token texts (``Logprob.decoded_token``) follow vLLM's fields and one contract: the
sampled tokens' texts concatenate to the sequence's text. Each is the text that token adds
to ``.text`` (a SentencePiece token keeps its leading space; a character split over several
tokens belongs to the token that completes it), except that a stop token that ends the
output unseen (eos, a stop token id) carries its own rendered text, and that the text of a
stop string cut from the output stays with the tokens that produced it. The top
alternatives are decoded after the token before them, so their leading spaces show too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ridge.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ridge.engine.request import Request, RequestStatus
from ridge.engine.tokenizer import BaseTokenizer, IncrementalDetokenizer

# (sampled token's logprob, [(token id, logprob) of the top alternatives])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class SequenceState:
    """One of a user request's n completions: the scheduler's request plus its text state."""

    user_id: str
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0
    # Text only at the end: nobody reads it earlier (not streamed, no logprobs) and no stop
    # string needs it. Saves a detokenizer call per sequence per step.
    text_at_finish: bool = False


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
        return all(s.request.is_finished for s in self.sequences)


class OutputProcessor:
    """Owns the user requests' output state; see the module docstring.

    ``stop(request, stop_string)`` is called when a sequence's text hits a stop string
    (the engine finishes it in the scheduler) before that request's output is built.
    """

    def __init__(self, tokenizer: BaseTokenizer, stop: Callable[[Request, str], None]) -> None:
        self.tokenizer = tokenizer
        self._stop = stop
        self.requests: dict[str, RequestState] = {}
        self._sequence_of: dict[str, SequenceState] = {}  # scheduler request id -> sequence

    # -- bookkeeping ----------------------------------------------------------------------
    def has_sequence(self, sequence_id: str) -> bool:
        return sequence_id in self._sequence_of

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for seq in state.sequences:
            self._sequence_of[seq.request.request_id] = seq

    def remove(self, request_id: str) -> RequestState | None:
        """Forget a user request (finished or aborted); returns it, or None if unknown."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.sequences:
                self._sequence_of.pop(seq.request.request_id, None)
        return state

    # -- one step -------------------------------------------------------------------------
    def process(
        self,
        progressed: list[tuple[Request, int]],
        logprobs: dict[str, list[TokenLogprobs]],
        prompt_logprobs: dict[str, tuple[int, list]] | None = None,
    ) -> list[RequestOutput]:
        """Outputs for the user requests that progressed (streamed ones every step, the
        others when they finish); finished user requests are forgotten.

        ``progressed``: each request with the number of tokens it received this step (more
        than one after a verified speculation); ``logprobs``: one entry per received token,
        where asked. A stop string found inside a run ends the output at the token that
        completed it: the tokens after it are dropped.
        """
        for rid, (first, entries) in (prompt_logprobs or {}).items():
            self._add_prompt_logprobs(rid, first, entries)
        touched: dict[str, RequestState] = {}
        for req, count in progressed:
            seq = self._sequence_of[req.request_id]
            if seq.text_at_finish:
                if req.is_finished:
                    # A request stopped on eos or a stop token id: that token's text is not shown.
                    stopped_on_token = req.status is RequestStatus.FINISHED_STOPPED
                    hide = stopped_on_token and not req.sampling_params.include_stop_str_in_output
                    seq.detokenizer.add_tokens(req.output_token_ids[:-1] if hide else req.output_token_ids)
            else:
                self._add_run(seq, req, count, logprobs.get(req.request_id))
            # A user request finishes only in a step where one of its sequences finishes.
            state = self.requests[seq.user_id]
            if seq.user_id not in touched and (req.is_finished or state.stream):
                touched[seq.user_id] = state
        outputs = []
        for state in touched.values():
            finished = state.finished
            if state.stream or finished:
                outputs.append(self._make_output(state))
            if finished:
                self.remove(state.request_id)
        return outputs

    def _add_run(self, seq: SequenceState, req: Request, count: int, logprobs: list[TokenLogprobs] | None) -> None:
        """Feed a sequence's ``count`` new tokens to its detokenizer, in order."""
        first = req.num_output_tokens - count
        for j in range(count):
            index = first + j
            token = req.output_token_ids[index]
            last = j == count - 1
            # Only a run's last token can have finished it on eos or a stop token id (the
            # scheduler drops what follows a stop); such a token's text is not shown.
            stopped_on_token = last and req.status is RequestStatus.FINISHED_STOPPED
            show_token = not stopped_on_token or req.sampling_params.include_stop_str_in_output
            stop = seq.detokenizer.add_tokens([token]) if show_token else None
            if stop is not None and not req.is_finished:
                self._stop(req, stop)
                req.truncate_output(index + 1)
            if seq.logprobs is not None and logprobs is not None:
                token_text = seq.detokenizer.take_token_text(final=req.is_finished)
                if not show_token:  # the unseen stop token: its own rendered text
                    token_text += self.tokenizer.piece(token).text
                before = req.all_token_ids[req.num_prompt_tokens + index - 1]  # the token before (prompt or output)
                seq.logprobs.append(self._logprob_entry(before, token, token_text, *logprobs[j]))
                seq.cumulative_logprob += logprobs[j][0]
            if req.is_finished:
                break

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
            req = seq.request
            finished = req.is_finished
            delta_ids = req.output_token_ids[seq.num_sent_tokens :]
            seq.num_sent_tokens = req.num_output_tokens
            completions.append(
                CompletionOutput(
                    index=index,
                    text=seq.detokenizer.text,
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=seq.logprobs,
                    finish_reason=req.status.value if finished else None,
                    stop_reason=req.stop_reason,
                    delta_text=seq.detokenizer.take_delta(finished=finished),
                    delta_token_ids=delta_ids,
                )
            )
        reqs = [s.request for s in state.sequences]

        def earliest(name: str) -> float | None:
            times = [getattr(r, name) for r in reqs if getattr(r, name) is not None]
            return min(times) if times else None

        def latest(name: str) -> float | None:
            times = [getattr(r, name) for r in reqs if getattr(r, name) is not None]
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
            num_cached_tokens=max(reqs[0].num_cached_tokens, 0),
            prompt_logprobs=state.prompt_logprobs,
        )
