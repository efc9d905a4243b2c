"""The OpenAI wire format: pydantic models of requests, responses and the error object.

Request models forbid unknown fields (as OpenAI does: a misspelt ``temprature`` is an error,
not a silent default). They accept the OpenAI fields ridge implements, a few that are
harmless to ignore (``user``, ``metadata``, ...), and vLLM's sampling extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ...),
so clients written for vLLM work unchanged. Fields ridge cannot honour (``suffix``,
``logit_bias``, ``suffix``, ...) are declared so that setting them gives a clear 400 rather than
an "unknown field" error.

Schema problems (wrong types, missing fields) are caught by pydantic and become 422s in the
app; value problems (ranges, lengths) are checked by ``SamplingParams`` and the serving code
and become 400s (``APIError``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ridge.sampling import SamplingParams

# OpenAI's cap on n (a request with n = 10**6 would otherwise build a million sequences).
MAX_N = 128


# -- errors ------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, the body of every non-2xx reply."""

    error: ErrorInfo


# OpenAI's error ``type`` for each status ridge answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error a handler raises on purpose; the app answers ``status`` with its error object."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# -- requests ----------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, ignored


class SamplingRequest(_Strict):
    """Fields shared by completions and chat: sampling, stopping, streaming."""

    model: str | None = None  # None: the first served name (as vLLM)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and ignored: they change nothing about the tokens.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Declared so that using them is a clear 400 (see ``unsupported``).
    logit_bias: dict[str, float] | None = None
    # vLLM's: a request's part in disaggregated serving (what ``ridge router`` sends; see
    # ridge/kv_transfer/config.py)
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: the output's shape (json, json_object, regex, choice, grammar), enforced token by token
    structured_outputs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first set field ridge cannot honour, else None."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if isinstance(self.n, int) and self.n > MAX_N:
            return "n", f"n must be <= {MAX_N}, got {self.n}"
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's ``SamplingParams``; raises ValueError (naming the field) for bad values.

        Unset fields take the OpenAI defaults (which are ``SamplingParams``'s: temperature 1,
        top_p 1, no penalties).
        """
        given = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "seed",
            )
            if getattr(self, name) is not None
        }
        structured = self.structured_outputs
        response_format = getattr(self, "response_format", None)
        if response_format is not None and response_format.structured_outputs() is not None:
            if structured is not None:
                raise ValueError("structured_outputs and a JSON response_format cannot both be given")
            structured = response_format.structured_outputs()
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            structured_outputs=structured,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            **given,
        )


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or a list of those."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (use n)"
        return super().unsupported()

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: score the prompt, generate nothing (what
        lm-evaluation-harness sends for log-likelihoods)."""
        return self.echo and self.max_tokens == 0


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation. Extra keys (``name``, ...) pass through to the template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextContentPart] | None = None

    def for_template(self) -> dict:
        """The message as the chat template sees it, with content parts joined into a string."""
        data = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        data["content"] = content or ""
        return data


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object``, or ``json_schema`` with its schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> dict | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            return {"json": self.json_schema.schema_}
        return None


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context limit
    max_completion_tokens: int | None = None  # takes precedence over max_tokens (OpenAI)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: None (off), or how many top alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.response_format is not None and self.response_format.type not in ("text", "json_object", "json_schema"):
            return "response_format", f"response_format {self.response_format.type!r} is not supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs to be true"
        return super().unsupported()


# -- responses ---------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a producer's: where the prompts' KV cache waits


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a producer's: where the prompts' KV cache waits


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A fragment of tool call ``index``: its id, type and name come once, with its first arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    """A streamed message fragment; unset fields are left out (``{}`` on the final chunk)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "ridge"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
