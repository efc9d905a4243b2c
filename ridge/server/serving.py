"""OpenAI requests in, engine requests through the ``AsyncEngine``, OpenAI responses out.

``OpenAIServing`` implements ``/v1/completions`` and ``/v1/chat/completions`` for the app:

1. check the request (unsupported fields, the model name, sampling values) -> ``APIError``;
2. bound the prompt cheaply before tokenizing: more characters than ``max_model_len`` tokens
   could hold is a 400 at once (``LLMEngine.max_prompt_chars``), so a megabyte prompt costs
   nothing; text that is not valid Unicode (a lone surrogate) is a 400 too;
3. tokenize on a small pool of tokenizer threads, each with its own copy of the tokenizer
   (never on the event loop; a long prompt being tokenized does not hold up a short one);
4. check lengths against the context limit: a prompt that leaves no room, or ``max_tokens``
   beyond the room left, is a 400 (``context_length_exceeded``), as in vLLM;
5. queue the prompts as one group; the engine's own validation errors come back as 400s;
6. answer: a full response, or server-sent events ending in ``data: [DONE]``: one event per
   choice per engine step that produced a token (as vLLM), so clients can time every token;
   its text may be empty while the detokenizer holds back an unfinished character or what
   could be the start of a stop string.

A client that goes away is noticed (the stream is cancelled by Starlette; a non-streaming
request watches for ``http.disconnect``) and its requests are aborted, which frees their KV
blocks before the next step.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from ridge.engine.outputs import CompletionOutput, Logprob, RequestOutput
from ridge.engine.tokenizer import BaseTokenizer
from ridge.kv_transfer.config import KVTransferParams, handover_to_json, request_params
from ridge.sampling import SamplingParams
from ridge.server.async_engine import AsyncEngine, EngineDeadError, OutputStream
from ridge.server.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    SamplingRequest,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
    bad_request,
)
from ridge.tools.calls import ToolError, ToolPlan, new_call_id, plan_tools
from ridge.tools.parsers import make_tool_parser

DONE = "data: [DONE]\n\n"
# Prompts tokenized at once: a long one occupies a thread, the others go on.
TOKENIZER_THREADS = 4
# HTTP 499 (nginx's "client closed request"): the status logged when a client leaves early.
CLIENT_CLOSED = 499


@dataclass(frozen=True)
class ServerConfig:
    """What the server needs beyond the engine.

    ``served_model_names``: the names clients may ask for (the first is reported in
    responses and metrics); ``api_key``: when set, ``/v1`` needs ``Authorization: Bearer``;
    ``max_request_bytes``: larger bodies get a 413.
    """

    served_model_names: tuple[str, ...]
    model_root: str | None = None
    api_key: str | None = None
    max_request_bytes: int = 8 * 2**20
    kv_info: dict | None = None  # disaggregated serving: the engine's KV-transfer identity
    tool_call_parser: str | None = None  # --tool-call-parser: reads tool calls for tool_choice "auto"

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.tool_call_parser is not None:
            make_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


@dataclass
class _Prompt:
    text: str | None  # as given (None for token ids)
    token_ids: list[int]


def sse(payload: BaseModel) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


class OpenAIServing:
    """The two generation endpoints over one ``AsyncEngine`` (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._check_prompt_chars = engine.check_prompt_chars  # reads only immutable sizes
        self._tokenizers = _TokenizerPool(self.tokenizer, TOKENIZER_THREADS)

    def close(self) -> None:
        self._tokenizers.close()

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    # -- checks shared by both endpoints --------------------------------------------------
    def _check_request(self, body: SamplingRequest) -> None:
        if body.model is not None and body.model not in self.config.served_model_names:
            raise APIError(
                404,
                f"The model {body.model!r} does not exist; this server serves "
                f"{', '.join(map(repr, self.config.served_model_names))}.",
                param="model",
                code="model_not_found",
            )
        problem = body.unsupported()
        if problem is not None:
            raise bad_request(problem[1], param=problem[0])

    def _sampling_params(self, body: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as exc:
            raise bad_request(str(exc), param=_param_of(str(exc), body, {"logprobs": _logprobs_field(body)})) from None

    def _check_length(
        self, prompt_len: int, max_tokens: int | None, prompt_param: str, max_param: str = "max_tokens"
    ) -> None:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens "
                "(and at least one token must be generated). Please shorten the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                f"Please reduce the prompt or {max_param}.",
                param=max_param,
                code="context_length_exceeded",
            )

    def _bound_prompt(self, num_chars: int, param: str) -> None:
        try:
            self._check_prompt_chars(num_chars)
        except ValueError as exc:
            raise bad_request(str(exc), param=param, code="context_length_exceeded") from None

    def _kv_transfer(self, body: SamplingRequest, num_prompts: int) -> list[KVTransferParams] | None:
        try:
            kv = request_params(body.kv_transfer_params, num_prompts, body.n)
        except ValueError as exc:
            raise bad_request(str(exc), param="kv_transfer_params") from None
        if kv is not None and kv[0].do_remote_decode and body.stream:
            raise bad_request("a prefill-only (do_remote_decode) request is not streamed", param="stream")
        return kv

    def _handover(self, finals: Sequence[RequestOutput], kv: list[KVTransferParams] | None) -> dict | None:
        """A producer's answer: per prompt, where its KV cache waits for a consumer's pull and
        what each sample's first token was (the ``kv_transfer_params`` a consumer takes)."""
        if kv is None or not kv[0].do_remote_decode:
            return None
        prompts = []
        for out in finals:
            handover = out.kv_handover or {"transfer_ids": [], "generator_states": []}
            prompts.append(
                handover_to_json(
                    {
                        "num_prompt_tokens": len(out.prompt_token_ids),
                        "transfer_ids": handover["transfer_ids"],
                        "first_tokens": [c.token_ids[0] for c in out.outputs],
                        "first_logprobs": [_first_logprobs(c) for c in out.outputs],
                        "generator_states": handover["generator_states"],
                    }
                )
            )
        engine_id = (self.config.kv_info or {}).get("engine_id")
        return {"do_remote_prefill": True, "remote_engine_id": engine_id, "prompts": prompts}

    async def _add(
        self,
        request_id: str,
        prompts: list[_Prompt],
        params: SamplingParams,
        arrival: float,
        prompt_param: str,
        kv: list[KVTransferParams] | None = None,
    ) -> OutputStream:
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        try:
            return await self.engine.add_group(ids, [p.token_ids for p in prompts], params, arrival, kv)
        except ValueError as exc:
            param = "structured_outputs" if "structured_outputs." in str(exc) else prompt_param
            raise bad_request(str(exc), param=param) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None

    # -- /v1/completions ------------------------------------------------------------------
    async def create_completion(self, body: CompletionRequest, raw: Request) -> CompletionResponse | AsyncIterator[str]:
        arrival = time.monotonic()
        self._check_request(body)
        # echo with max_tokens 0 runs one token (the prompt's logits need a step) and drops it
        max_tokens = 1 if body.echo_only else body.max_tokens
        params = self._sampling_params(body, max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:
            params.prompt_logprobs = body.logprobs
        prompts = await self._completion_prompts(body.prompt)
        for p in prompts:
            self._check_length(len(p.token_ids), max_tokens, "prompt")
        kv = self._kv_transfer(body, len(prompts))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._add(request_id, prompts, params, arrival, "prompt", kv)
        ctx = _CompletionContext(
            request_id, int(time.time()), self.model_name, prompts, params, body.echo, self.tokenizer, body.echo_only
        )
        if body.stream:
            return self._completion_events(ctx, stream, body.include_usage)
        finals = await _collect(stream, raw, len(prompts))
        choices = []
        for i, out in enumerate(finals):
            echo = ctx.prompt_text(i) if body.echo else ""
            for c in out.outputs:
                text = echo if ctx.echo_only else echo + c.text
                choices.append(ctx.choice(i, c, text, 0, len(c.token_ids), out if body.echo else None))
        return CompletionResponse(
            id=request_id,
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            usage=ctx.usage(finals),
            kv_transfer_params=self._handover(finals, kv),
        )

    async def _completion_prompts(self, prompt: Any) -> list[_Prompt]:
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt must not be empty", param="prompt")
        out = []
        for i, item in enumerate(items):
            where = "prompt" if len(items) == 1 else f"prompt {i}"
            if isinstance(item, str):
                if not item:
                    raise bad_request(f"{where} is empty", param="prompt")
                self._bound_prompt(len(item), "prompt")
                try:
                    ids = await self._tokenizers.run(lambda tok, text=item: tok.encode(text))
                except ValueError as exc:
                    raise bad_request(f"{where}: {exc}", param="prompt") from None
                out.append(_Prompt(item, ids))
            else:
                if not item:
                    raise bad_request(f"{where} has no token ids", param="prompt")
                out.append(_Prompt(None, list(item)))
        return out

    async def _completion_events(
        self, ctx: _CompletionContext, stream: OutputStream, include_usage: bool
    ) -> AsyncIterator[str]:
        finals: list[RequestOutput | None] = [None] * len(ctx.prompts)
        echoed: set[int] = set()
        ended: set[int] = set()  # choices whose finish was sent
        try:
            async for i, out in stream:
                for c in out.outputs:
                    index = i * ctx.params.n + c.index
                    text = "" if ctx.echo_only else c.delta_text
                    echo_now = ctx.echo and index not in echoed
                    if echo_now:
                        echoed.add(index)
                        text = ctx.prompt_text(i) + text
                    end = len(c.token_ids)
                    start = end - len(c.delta_token_ids)
                    if not _is_news(text, start, end, c.finish_reason, index, ended):
                        continue  # a prefill chunk, or a choice that already ended
                    choice = ctx.choice(i, c, text, start, end, out if echo_now else None)
                    yield sse(
                        CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[choice])
                    )
                if out.finished:
                    finals[i] = out
            if include_usage:
                yield sse(
                    CompletionResponse(
                        id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[], usage=ctx.usage(finals)
                    )
                )
        except (EngineDeadError, RuntimeError) as exc:
            yield sse(ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error")))
        finally:
            stream.abort()  # a no-op when every request finished
        yield DONE

    # -- /v1/chat/completions -------------------------------------------------------------
    async def create_chat_completion(
        self, body: ChatCompletionRequest, raw: Request
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        arrival = time.monotonic()
        self._check_request(body)
        max_tokens = body.max_output_tokens
        params = self._sampling_params(body, max_tokens, body.num_logprobs)
        plan, params = self._tool_plan(body, params)
        messages = [m.for_template() for m in body.messages]
        self._bound_prompt(sum(len(m["content"]) for m in messages), "messages")
        try:
            token_ids = await self._tokenizers.run(
                lambda tok: tok.encode_chat(
                    messages, add_generation_prompt=body.add_generation_prompt, tools=plan.tools or None
                )
            )
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        self._check_length(
            len(token_ids),
            max_tokens,
            "messages",
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
        )
        kv = self._kv_transfer(body, 1)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompts = [_Prompt(None, token_ids)]
        stream = await self._add(request_id, prompts, params, arrival, "messages", kv)
        created = int(time.time())
        top = body.top_logprobs or 0
        if body.stream:
            return self._chat_events(request_id, created, stream, params, top, body.include_usage, plan)
        (final,) = await _collect(stream, raw, 1)
        choices = []
        for c in final.outputs:
            answer = plan.answer(c.text)
            calls = [
                ToolCall(id=new_call_id(), function=FunctionCall(name=t.name, arguments=t.arguments))
                for t in answer.calls
            ]
            content = answer.content if answer.content is not None or calls else ""
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(content=content, tool_calls=calls),
                    logprobs=_chat_logprobs(c, 0, len(c.token_ids), top) if params.logprobs is not None else None,
                    finish_reason=plan.finish_reason if calls and c.finish_reason == "stop" else c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=_usage([final]),
            kv_transfer_params=self._handover([final], kv),
        )

    def _tool_plan(self, body: ChatCompletionRequest, params: SamplingParams) -> tuple[ToolPlan, SamplingParams]:
        """The request's tool plan, and its sampling params with the plan's grammar (a forced
        tool choice) and the special tokens its parser reads."""
        try:
            plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.config.tool_call_parser)
        except ToolError as exc:
            raise bad_request(str(exc), param=exc.param) from None
        changes: dict[str, Any] = {}
        if plan.structured_outputs is not None:
            if params.structured_outputs is not None:
                raise bad_request(
                    f"tool_choice {plan.mode!r} sets the output's grammar; it cannot be combined with "
                    "response_format or structured_outputs",
                    param="tool_choice",
                )
            changes["structured_outputs"] = plan.structured_outputs
        if plan.needs_special_tokens:
            changes["skip_special_tokens"] = False  # the parser reads its markers (as vLLM)
        return plan, dataclasses.replace(params, **changes) if changes else params

    async def _chat_events(
        self,
        request_id: str,
        created: int,
        stream: OutputStream,
        params: SamplingParams,
        top: int,
        include_usage: bool,
        plan: ToolPlan,
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(
                ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage)
            )

        final: RequestOutput | None = None
        ended: set[int] = set()  # choices whose finish was sent
        texts = [""] * params.n
        readers = [plan.stream() for _ in range(params.n)]  # each choice's tool calls, as they grow
        try:
            for index in range(params.n):  # the role first, before any token (as OpenAI and vLLM)
                yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for _, out in stream:
                for c in out.outputs:
                    end = len(c.token_ids)
                    start = end - len(c.delta_token_ids)
                    if not _is_news(c.delta_text, start, end, c.finish_reason, c.index, ended):
                        continue
                    logprobs = _chat_logprobs(c, start, end, top) if params.logprobs is not None else None
                    texts[c.index] += c.delta_text
                    reader = readers[c.index]
                    content, calls = reader.update(texts[c.index], final=c.finish_reason is not None)
                    finish = c.finish_reason
                    if finish == "stop" and reader.called:
                        finish = plan.finish_reason
                    tool_calls = [
                        DeltaToolCall(
                            index=d.index,
                            id=d.id,
                            type="function" if d.id is not None else None,
                            function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
                        )
                        for d in calls
                    ]
                    yield chunk(
                        [
                            ChatStreamChoice(
                                index=c.index,
                                delta=DeltaMessage(content=content or None, tool_calls=tool_calls or None),
                                logprobs=logprobs,
                                finish_reason=finish,
                                stop_reason=c.stop_reason,
                            )
                        ]
                    )
                if out.finished:
                    final = out
            if include_usage:
                yield chunk([], _usage([final]))
        except (EngineDeadError, RuntimeError) as exc:
            yield sse(ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error")))
        finally:
            stream.abort()
        yield DONE


# -- helpers -----------------------------------------------------------------------------------


class _TokenizerPool:
    """Tokenization off the event loop, several at a time: a thread pool whose threads each
    hold their own copy of the tokenizer (a Hugging Face tokenizer shared across threads can
    fail with "Already borrowed" when one call changes its truncation settings)."""

    def __init__(self, tokenizer: BaseTokenizer, threads: int) -> None:
        self._local = threading.local()
        self._tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ridge-tokenizer")

    def _call(self, fn: Callable[[BaseTokenizer], Any]) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return fn(tok)

    async def run(self, fn: Callable[[BaseTokenizer], Any]) -> Any:
        """``fn(tokenizer)`` on a tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _CompletionContext:
    request_id: str
    created: int
    model: str
    prompts: list[_Prompt]
    params: SamplingParams
    echo: bool
    tokenizer: Any
    echo_only: bool = False  # echo with max_tokens 0: the generated token is dropped

    def prompt_text(self, i: int) -> str:
        p = self.prompts[i]
        return p.text if p.text is not None else self.tokenizer.decode(p.token_ids)

    def usage(self, finals: Sequence[RequestOutput | None]) -> UsageInfo:
        usage = _usage(finals)
        return UsageInfo.of(usage.prompt_tokens, 0) if self.echo_only else usage

    def choice(
        self, i: int, c: CompletionOutput, text: str, start: int, end: int, echoed: RequestOutput | None = None
    ) -> CompletionChoice:
        """The choice for ``text`` and tokens ``[start, end)`` of completion ``c`` of prompt ``i``;
        ``echoed``: the text begins with that request's prompt (its logprobs come first)."""
        if self.echo_only:
            start = end = 0
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = _completion_logprobs(c, start, end)
            if echoed is not None:
                logprobs = _prompt_logprobs(echoed, self.tokenizer, logprobs)
        return CompletionChoice(
            index=i * self.params.n + c.index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )


def _is_news(text: str, start: int, end: int, finish_reason: str | None, index: int, ended: set[int]) -> bool:
    """Whether a choice's update says anything: new text or tokens, or its finish (once: with
    n > 1 a choice that ended still comes back in every output until all of them end)."""
    if finish_reason is not None and index not in ended:
        ended.add(index)
        return True
    return bool(text) or start != end


def _entries(c: CompletionOutput, start: int, end: int) -> list[tuple[int, dict[int, Logprob]]]:
    lps = c.logprobs or []
    return [(c.token_ids[k], lps[k]) for k in range(start, min(end, len(lps)))]


def _completion_logprobs(c: CompletionOutput, start: int, end: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs for tokens ``[start, end)``; offsets count from the first of them."""
    out = CompletionLogprobs()
    lps = c.logprobs or []
    offset = sum(len(_token_text(lps[k], c.token_ids[k])) for k in range(min(start, len(lps))))
    for token_id, entry in _entries(c, start, end):
        token = _token_text(entry, token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry[token_id].logprob)
        out.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
        out.text_offset.append(offset)
        offset += len(token)
    return out


def _prompt_logprobs(out: RequestOutput, tokenizer, then: CompletionLogprobs) -> CompletionLogprobs:
    """The echoed prompt's tokens first (the first has no logprob), then ``then``'s, whose
    offsets move past the prompt's text."""
    result = CompletionLogprobs()
    offset = 0
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for token_id, entry in zip(out.prompt_token_ids, entries):
        if entry is None:
            token = tokenizer.decode([token_id])  # the first token: no context, no logprob
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            token = _token_text(entry, token_id)
            result.token_logprobs.append(entry[token_id].logprob)
            result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
    result.tokens += then.tokens
    result.token_logprobs += then.token_logprobs
    result.top_logprobs += then.top_logprobs
    result.text_offset += [offset + o for o in then.text_offset]
    return result


def _chat_logprobs(c: CompletionOutput, start: int, end: int, top: int) -> ChatLogprobs:
    content = []
    for token_id, entry in _entries(c, start, end):
        token = _token_text(entry, token_id)
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)[:top]
        content.append(
            TokenLogprob(
                token=token,
                logprob=entry[token_id].logprob,
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token or "",
                        logprob=lp.logprob,
                        bytes=list((lp.decoded_token or "").encode("utf-8")),
                    )
                    for lp in ranked
                ],
            )
        )
    return ChatLogprobs(content=content)


def _first_logprobs(c: CompletionOutput) -> list | None:
    """The first token's logprob and ranked alternatives, as the sampler gave them (a
    consumer that starts from this token reports them as its own)."""
    if not c.logprobs:
        return None
    entry, token = c.logprobs[0], c.token_ids[0]
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None)
    return [entry[token].logprob, [[tid, value] for _, tid, value in ranked]]


def _token_text(entry: dict[int, Logprob], token_id: int) -> str:
    return entry[token_id].decoded_token or ""


def _usage(finals: Sequence[RequestOutput | None]) -> UsageInfo:
    """Prompt tokens once per prompt (whatever n), completion tokens over every choice."""
    done = [f for f in finals if f is not None]
    return UsageInfo.of(
        sum(len(f.prompt_token_ids) for f in done), sum(len(c.token_ids) for f in done for c in f.outputs)
    )


def _logprobs_field(body: SamplingRequest) -> str:
    return "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"


def _param_of(message: str, body: BaseModel, renames: dict[str, str]) -> str | None:
    """The request field a ``SamplingParams`` error names (its first word), if it is one."""
    match = re.match(r"\w+", message)
    if match is None:
        return None
    name = renames.get(match.group(0), match.group(0))
    if isinstance(body, ChatCompletionRequest) and name == "max_tokens" and body.max_completion_tokens is not None:
        name = "max_completion_tokens"
    return name if name in type(body).model_fields else None


async def _collect(stream: OutputStream, raw: Request, count: int) -> list[RequestOutput]:
    """The final output of each request of the group; aborts them if the client leaves first."""
    finals: list[RequestOutput | None] = [None] * count

    async def consume() -> None:
        async for i, out in stream:
            if out.finished:
                finals[i] = out

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            try:
                work.result()
            except EngineDeadError as exc:
                raise APIError(503, str(exc)) from None
            except RuntimeError as exc:
                raise APIError(500, str(exc)) from None
            return finals  # type: ignore[return-value]
        raise ClientGone()
    finally:
        gone.cancel()
        work.cancel()
        stream.abort()


async def _disconnected(raw: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only that can come)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
