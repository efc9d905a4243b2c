"""What a chat request's ``tools`` and ``tool_choice`` ask for, and its answer's tool calls,
whole and streamed.

:func:`plan_tools` checks OpenAI's fields and returns a :class:`ToolPlan`, one of four modes:

* ``none``: the template shows the tools; the output is content.
* ``auto``: the model decides; its output is read by the server's ``--tool-call-parser``.
* ``required``: a grammar makes the output a JSON array of calls of the given functions, at
  least one (exactly one when ``parallel_tool_calls`` is false), whatever the model.
* ``function`` (``tool_choice`` names one): a grammar makes the output that function's
  arguments, an object of its ``parameters`` schema.

The engine sees only the plan's ``structured_outputs`` (the grammar); the answer's calls come
from :meth:`ToolPlan.answer` (the whole output) or a :class:`ToolCallStream` (deltas as the
output grows, which join into the same calls; see ``ridge/tools/parsers.py`` for the contract).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ridge.tools.parsers import (
    ArgumentsParser,
    JsonArrayToolParser,
    Parsed,
    ToolParser,
    make_tool_parser,
)

# A function that declares no parameters takes an empty object.
NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A request's tools or tool_choice cannot be honoured; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_call_id() -> str:
    """A tool call's id, as OpenAI spells them (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """What the request's tools ask of the engine and of the answer."""

    mode: str
    tools: list[dict]  # as given, for the chat template
    function: str | None = None  # the named function (mode "function")
    parallel: bool = True
    parser: ToolParser | None = None  # reads the output (None: mode "none")

    @property
    def structured_outputs(self) -> dict | None:
        """The grammar that forces the output (``required`` and a named function), else None."""
        if self.mode == "function":
            return {"json": _parameters(self._functions()[self.function])}
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": _parameters(fn)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, fn in self._functions().items()
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return {"json": schema}
        return None

    @property
    def finish_reason(self) -> str:
        """The ``finish_reason`` of an answer that calls tools and stopped by itself (OpenAI's:
        ``tool_calls``, but ``stop`` when ``tool_choice`` forced the function)."""
        return "stop" if self.mode == "function" else "tool_calls"

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the output must be decoded with special tokens (the parser's markers)."""
        return self.parser is not None and self.parser.needs_special_tokens

    def answer(self, text: str) -> Parsed:
        """The whole output's content and calls."""
        if self.parser is None:
            return Parsed(text)
        return self.limit_calls(self.parser.parse(text, final=True))

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def limit_calls(self, parsed: Parsed) -> Parsed:
        """Only the first call when parallel_tool_calls is false (as vLLM)."""
        return parsed if self.parallel else Parsed(parsed.content, parsed.calls[:1])

    def _functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools}


def _parameters(function: Mapping) -> dict:
    return function.get("parameters") or NO_PARAMETERS


def plan_tools(
    tools: Sequence[Any] | None,
    tool_choice: str | Mapping | None,
    parallel_tool_calls: bool | None = None,
    parser: str | None = None,
) -> ToolPlan:
    """Check a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` against the
    server's ``--tool-call-parser`` (``parser``, None when not set) and return its plan.

    ``tool_choice`` left out means ``auto`` when tools are given (OpenAI's default), which,
    as in vLLM, needs a parser. Raises :class:`ToolError` naming the field at fault.
    """
    tools = _check_tools(tools)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
                "tool_choice",
            )
        if tool_choice == "none" or (tool_choice == "auto" and not tools):
            return ToolPlan("none", tools, parallel=parallel)
        if not tools:
            raise ToolError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        if tool_choice == "required":
            return ToolPlan("required", tools, parallel=parallel, parser=JsonArrayToolParser())
        if parser is None:
            raise ToolError(
                '"auto" tool choice needs the server to be started with --tool-call-parser '
                "(hermes or llama3_json); use tool_choice 'required' or a named function otherwise",
                "tool_choice",
            )
        return ToolPlan("auto", tools, parallel=parallel, parser=make_tool_parser(parser))
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError(
            'a named tool_choice must be {"type": "function", "function": {"name": str}}',
            "tool_choice",
        )
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        known = ", ".join(map(repr, names)) or "none"
        raise ToolError(
            f"tool_choice names the function {name!r}, which is not among the tools ({known})", "tool_choice"
        )
    return ToolPlan("function", tools, function=name, parallel=parallel, parser=ArgumentsParser(name))


def _check_tools(tools: Sequence[Any] | None) -> list[dict]:
    if not tools:
        return []
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(function, Mapping)
        ):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": str, ...}}}}', "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in seen:
            raise ToolError(f"tools[{i}]: the function name {name!r} is given twice", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        seen.add(name)
        out.append(dict(tool))
    return out


@dataclass
class CallDelta:
    """A fragment of call ``index``: its id and name come once, with its first arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class ToolCallStream:
    """One choice's output read as it grows: each :meth:`update` gives the new content and
    call fragments; they join into what :meth:`ToolPlan.answer` gives for the whole output."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.content = ""  # sent so far
        self.calls: list[tuple[str, str, str]] = []  # (id, name, arguments sent so far)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def update(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """``(content delta, call deltas)`` for the output ``text`` so far (all of it when ``final``)."""
        if self.plan.parser is None:
            delta = text[len(self.content) :]
            self.content = text
            return delta, []
        parsed = self.plan.limit_calls(self.plan.parser.parse(text, final))
        content = parsed.content or ""
        delta = ""
        if content.startswith(self.content):
            delta, self.content = content[len(self.content) :], content
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index < len(self.calls):
                call_id, name, sent = self.calls[index]
                if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                    deltas.append(CallDelta(index, None, None, call.arguments[len(sent) :]))
                    self.calls[index] = (call_id, name, call.arguments)
            elif index == len(self.calls):
                call_id = new_call_id()
                deltas.append(CallDelta(index, call_id, call.name, call.arguments))
                self.calls.append((call_id, call.name, call.arguments))
        return delta, deltas
