"""Tool calls in a model's output: the formats models write them in, parsed whole or as they stream.

A model that was trained to call tools writes each call in its own format; a parser turns
the text into *content* (what is left for the user) and *tool calls* (a function's name and
its arguments as a JSON object's text). The formats, by vLLM's ``--tool-call-parser`` names:

* ``hermes`` (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any number, with text before, between and after them as content.
* ``llama3_json`` (Llama 3.1/3.2/3.3): an answer that is, after an optional ``<|python_tag|>``,
  one or more ``{"name": ..., "parameters": {...}}`` objects separated by ``;``. Any other
  answer is content.

Two more serve forced tool choices (no flag picks them; see ``ridge/tools/choice.py``):
``json_array`` reads ``tool_choice: "required"``'s ``[{"name": ..., "parameters": {...}}, ...]``,
and ``ArgumentsParser`` reads a named function's arguments, which are the whole output.

**The parse contract.** ``parse(text, final)``:

* ``final=True`` (the whole output): the answer. A call that does not parse (bad JSON, no
  name, arguments that are not an object) stays in the content as written.
* ``final=False`` (the output so far, while streaming): the content no later text can change
  (text that may be the start of a tag, and trailing whitespace, are held back) and the calls
  begun so far whose name is known, with their arguments so far. Later parses only extend
  this: content and each call's arguments by appending, the calls by adding calls.

A call's ``arguments`` is the JSON text of its arguments object exactly as the model wrote
it (re-serialized only when the model put the object in a string), so the fragments a stream
sends join into exactly the arguments of the whole answer. Content is stripped of the
whitespace at its ends and is None when there is none.

Where a stream and the whole answer can differ: a call whose name and first arguments were
streamed and that then turns out malformed (or is cut by ``max_tokens``) has been sent as a
call; the whole answer leaves it as content. Well-formed output gives the same result both ways.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments (a JSON object's text)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """What a parser found: the content (None when empty) and the calls, in order."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    """A model's tool-call format (see the module docstring for the contract)."""

    name: str
    # Whether the format's markers are special tokens a decoder skipping them would drop.
    needs_special_tokens: bool

    def parse(self, text: str, final: bool = True) -> Parsed: ...


# A call object that begins with its name: streaming can name the call before it ends.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def json_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array that opens at ``text[start]``, None when
    the text ends first. Counts brackets outside strings (it does not validate the JSON)."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _held_tag_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _content(text: str, final: bool) -> str | None:
    if final:
        return text.strip() or None
    return text.lstrip().rstrip()  # trailing whitespace waits: it may end the content


def object_call(text: str, start: int, final: bool) -> tuple[ToolCall | None, int | None]:
    """The call in the JSON object opening at ``text[start]``: ``(call, end)``.

    ``end`` is None while the object is unfinished; then ``call`` is the call so far when
    its name is known (never when ``final``). A finished object that is not a call gives
    ``(None, end)``.
    """
    end = json_end(text, start)
    head = _HEAD.match(text, start)
    if end is None:
        if final or head is None:
            return None, None
        args_start = head.end()
        if args_start >= len(text) or text[args_start] != "{":
            return ToolCall(_unquote(head.group(1)), ""), None
        args_end = json_end(text, args_start) or len(text)
        return ToolCall(_unquote(head.group(1)), text[args_start:args_end]), None
    try:
        obj = json.loads(text[start:end])
    except ValueError:
        return None, end
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, end
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models put the arguments object in a string
        try:
            args = json.loads(args)
        except ValueError:
            return None, end
    if not isinstance(args, dict):
        return None, end
    if head is not None and text[head.end()] == "{":
        arguments = text[head.end() : json_end(text, head.end())]
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], arguments), end


def _unquote(escaped: str) -> str:
    return json.loads(f'"{escaped}"')


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5/3, Hermes)."""

    name = "hermes"
    needs_special_tokens = True  # Hermes-2-Pro's <tool_call> is a special token
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - _held_tag_prefix(tail, self.START)])
                break
            content.append(text[pos:start])
            body = start + len(self.START)
            end = text.find(self.END, body)
            block = text[body : end if end >= 0 else len(text)]
            first = _skip_space(block, 0)
            if end < 0 and not final:  # a block still being written
                if first < len(block) and block[first] == "{":
                    call, _ = object_call(block, first, final=False)
                    if call is not None:
                        calls.append(call)
                break
            call, call_end = object_call(block, first, final=True) if block[first : first + 1] == "{" else (None, None)
            if call is not None and call_end is not None and not block[call_end:].strip():
                calls.append(call)
            else:  # malformed: left as the model wrote it
                content.append(text[start : end + len(self.END) if end >= 0 else len(text)])
            if end < 0:
                break
            pos = end + len(self.END)
        return Parsed(_content("".join(content), final), calls)


class Llama3JsonToolParser:
    """Llama 3.x's JSON tool calls: ``<|python_tag|>`` (optional), then ``{"name": ...,
    "parameters": {...}}`` objects separated by ``;``. An answer that is anything else is content."""

    name = "llama3_json"
    needs_special_tokens = False  # <|python_tag|> is optional: without it the JSON still parses
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        pos = _skip_space(text, 0)
        if text.startswith(self.TAG, pos):
            pos = _skip_space(text, pos + len(self.TAG))
        elif not final and self.TAG.startswith(text[pos:]):
            return Parsed("")  # nothing yet, or the tag's beginning
        if pos < len(text) and text[pos] != "{":
            return Parsed(_content(text, final))
        if pos == len(text):
            return Parsed(_content(text, final) if final else "")
        calls, whole = _call_sequence(text, pos, final, separator=";", closer=None)
        if final and not whole:
            return Parsed(_content(text, final))
        return Parsed(None if final else "", calls)


class JsonArrayToolParser:
    """``tool_choice: "required"``'s output: ``[{"name": ..., "parameters": {...}}, ...]``."""

    name = "json_array"
    needs_special_tokens = False

    def parse(self, text: str, final: bool = True) -> Parsed:
        pos = _skip_space(text, 0)
        if pos == len(text) or text[pos] != "[":
            return Parsed(_content(text, final) if final or pos < len(text) else "")
        calls, whole = _call_sequence(text, _skip_space(text, pos + 1), final, separator=",", closer="]")
        if final and not whole:
            return Parsed(_content(text, final))
        return Parsed(None if final else "", calls)


def _call_sequence(text: str, pos: int, final: bool, separator: str, closer: str | None) -> tuple[list[ToolCall], bool]:
    """Call objects from ``pos``, separated by ``separator`` and ended by ``closer`` (or the
    text's end): ``(calls, whole)``, ``whole`` False when something that is not a call came
    (or, when ``final``, the sequence did not end properly)."""
    calls: list[ToolCall] = []
    while pos < len(text):
        if closer is not None and text[pos] == closer:
            return calls, not text[pos + 1 :].strip()
        if text[pos] != "{":
            return calls, False
        call, end = object_call(text, pos, final)
        if call is not None:
            calls.append(call)
        if end is None or call is None:
            return calls, False
        pos = _skip_space(text, end)
        if text.startswith(separator, pos):
            pos = _skip_space(text, pos + len(separator))
    return calls, closer is None and bool(calls)


@dataclass(frozen=True)
class ArgumentsParser:
    """A named function's forced output: the whole text is its arguments object."""

    function: str
    name: str = "arguments"
    needs_special_tokens: bool = False

    def parse(self, text: str, final: bool = True) -> Parsed:
        arguments = text.strip()
        if not final:
            return Parsed("", [ToolCall(self.function, arguments)])
        try:
            whole = isinstance(json.loads(arguments), dict)
        except ValueError:
            whole = False
        return Parsed(None, [ToolCall(self.function, arguments)]) if whole else Parsed(arguments or None)


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def make_tool_parser(name: str) -> ToolParser:
    """The parser for ``--tool-call-parser NAME``; ValueError listing the names for another."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; expected one of {sorted(TOOL_PARSERS)}") from None
