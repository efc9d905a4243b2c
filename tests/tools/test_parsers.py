"""The tool-call format parsers on hand-written model outputs: several calls, text around them,
malformed calls left as content, and streaming (every way of cutting an output into deltas
joins into the calls and content of the whole output)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ridge.tools.calls import ToolPlan
from ridge.tools.parsers import (
    ArgumentsParser,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    Parsed,
    ToolCall,
    make_tool_parser,
)

HERMES_TWO_CALLS = (
    "I will look both up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris", "note": "a } and a \\" inside"}}\n'
    "</tool_call>\nThat is all."
)


def test_hermes_several_calls_with_text_around_them():
    parsed = HermesToolParser().parse(HERMES_TWO_CALLS)
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris", "days": [1, 2]}
    assert json.loads(parsed.calls[1].arguments) == {"zone": "Europe/Paris", "note": 'a } and a " inside'}
    # the arguments are the model's own text of the object
    assert parsed.calls[0].arguments == '{"city": "Paris", "days": [1, 2]}'
    assert parsed.content.startswith("I will look both up.") and parsed.content.endswith("That is all.")
    assert "<tool_call>" not in parsed.content


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": get_weather}</tool_call>',  # not JSON
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',  # junk after the object
        '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut short
    ],
)
def test_hermes_malformed_calls_stay_content(text):
    parsed = HermesToolParser().parse("Before. " + text)
    assert parsed.calls == []
    assert parsed.content == ("Before. " + text).strip()


def test_hermes_keeps_good_calls_beside_a_malformed_one():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    parsed = HermesToolParser().parse(text)
    assert parsed.calls == [ToolCall("a", "{}")]
    assert parsed.content == "<tool_call>{oops}</tool_call>"


def test_hermes_arguments_in_a_string_and_an_unterminated_last_block():
    parsed = HermesToolParser().parse('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}')
    assert parsed.calls == [ToolCall("a", '{"x": 1}')] and parsed.content is None


def test_plain_text_is_content():
    assert HermesToolParser().parse("  Just text.\n") == Parsed("Just text.", [])
    assert Llama3JsonToolParser().parse("Just text.") == Parsed("Just text.", [])


def test_llama3_json_calls():
    parser = Llama3JsonToolParser()
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert parser.parse(text) == Parsed(None, [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")])
    assert parser.parse(' {"name": "a", "arguments": {"y": "z"}}') == Parsed(None, [ToolCall("a", '{"y": "z"}')])
    # an answer that is JSON but not calls, or calls with text after them, is content
    for text in ('{"answer": 42}', '{"name": "a", "parameters": {}} and then some text', '{"name": "a", "param'):
        assert parser.parse(text) == Parsed(text, [])


def test_json_array_and_arguments():
    text = '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{}}]'
    assert JsonArrayToolParser().parse(text) == Parsed(None, [ToolCall("a", '{"x":1}'), ToolCall("b", "{}")])
    assert JsonArrayToolParser().parse(text[:-5]) == Parsed(text[:-5], [])  # cut short: content
    assert ArgumentsParser("f").parse('{"x": [1, 2]}') == Parsed(None, [ToolCall("f", '{"x": [1, 2]}')])
    assert ArgumentsParser("f").parse('{"x": [1, ') == Parsed('{"x": [1,', [])


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'.*hermes"):
        make_tool_parser("mistral")


def _stream(parser, text: str, cuts: list[int]) -> tuple[str, list[ToolCall]]:
    """Feed ``text`` in pieces ending at ``cuts`` and join what the stream sends."""
    reader = ToolPlan("auto", [], parser=parser).stream()
    content, names, args = "", {}, {}
    ends = sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    for end in ends:
        delta, calls = reader.update(text[:end], final=end == len(text))
        content += delta
        for d in calls:
            if d.id is not None:
                assert d.index not in names and d.name is not None
                names[d.index] = d.name
                args[d.index] = ""
            args[d.index] += d.arguments
    return content, [ToolCall(names[i], args[i]) for i in sorted(names)]


WELL_FORMED = [
    (HermesToolParser(), HERMES_TWO_CALLS),
    (HermesToolParser(), 'Sure <tool_call>{"name": "t", "arguments": {"q": "<tool_call> in a string"}}</tool_call>'),
    (
        Llama3JsonToolParser(),
        '<|python_tag|>{"name": "a", "parameters": {"x": [1, {"y": 2}]}}; {"name": "b", "parameters": {}}',
    ),
    (Llama3JsonToolParser(), "No tools needed: the answer is 4."),
    (JsonArrayToolParser(), '[{"name":"a","parameters":{"s":"]}"}},{"name":"b","parameters":{}}]'),
    (ArgumentsParser("f"), '{"city": "Paris", "days": 3}'),
]


@pytest.mark.parametrize("parser,text", WELL_FORMED, ids=lambda v: getattr(v, "name", None))
def test_streamed_one_character_at_a_time_joins_into_the_whole(parser, text):
    whole = parser.parse(text)
    content, calls = _stream(parser, text, list(range(1, len(text))))
    assert calls == whole.calls
    assert content == (whole.content or "")


@given(data=st.data())
def test_streamed_in_any_pieces_joins_into_the_whole(data):
    parser, text = data.draw(st.sampled_from(WELL_FORMED))
    cuts = data.draw(st.lists(st.integers(1, len(text) - 1), max_size=12))
    whole = parser.parse(text)
    content, calls = _stream(parser, text, cuts)
    assert calls == whole.calls and content == (whole.content or "")


def test_stream_names_a_call_before_its_arguments_end():
    reader = ToolPlan("auto", [], parser=HermesToolParser()).stream()
    assert reader.update("Hi <tool_") == ("Hi", [])  # what may be a tag waits
    delta, calls = reader.update('Hi <tool_call>{"name": "f", "arguments": {"a": 1')
    assert delta == "" and len(calls) == 1
    assert (calls[0].name, calls[0].arguments) == ("f", '{"a": 1')
    assert calls[0].id.startswith("call_")
