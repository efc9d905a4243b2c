"""``plan_tools``: the four tool-choice modes, the grammar each forced mode sets, and the
errors a request's tools and tool_choice can have."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ridge.structured.params import StructuredOutputsParams
from ridge.tools.calls import ToolError, plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def test_modes():
    assert plan_tools(None, None).mode == "none"
    assert plan_tools([WEATHER], "none", parser="hermes").mode == "none"
    auto = plan_tools([WEATHER], None, parser="hermes")
    assert auto.mode == "auto" and auto.parser.name == "hermes" and auto.structured_outputs is None
    assert auto.finish_reason == "tool_calls" and auto.needs_special_tokens
    named = plan_tools([WEATHER, NOW], {"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "function" and named.finish_reason == "stop"
    assert named.structured_outputs == {"json": WEATHER["function"]["parameters"]}
    # a function without parameters takes an empty object
    assert (
        plan_tools([NOW], {"type": "function", "function": {"name": "now"}}).structured_outputs["json"]["type"]
        == "object"
    )


@pytest.mark.parametrize("parallel", [True, False])
def test_required_grammar_is_an_array_of_the_functions_calls(parallel):
    plan = plan_tools([WEATHER, NOW], "required", parallel_tool_calls=parallel)
    schema = plan.structured_outputs["json"]
    StructuredOutputsParams(json=schema)  # a valid constraint
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(good[:1])
    assert validator.is_valid(good) == parallel  # parallel_tool_calls false: one call
    assert not validator.is_valid([])
    assert not validator.is_valid([{"name": "get_weather", "parameters": {}}])  # city is required
    assert not validator.is_valid([{"name": "other", "parameters": {}}])
    parsed = plan.answer(json.dumps(good[:1]))
    assert [c.name for c in parsed.calls] == ["get_weather"] and parsed.content is None


def test_auto_without_parallel_calls_keeps_the_first():
    plan = plan_tools([WEATHER, NOW], "auto", parallel_tool_calls=False, parser="hermes")
    text = (
        '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    assert len(plan.answer(text).calls) == 1


@pytest.mark.parametrize(
    "tools,choice,parser,param,message",
    [
        ([WEATHER], "auto", None, "tool_choice", "--tool-call-parser"),
        ([WEATHER], None, None, "tool_choice", "--tool-call-parser"),
        ([WEATHER], "always", "hermes", "tool_choice", "must be 'none', 'auto', 'required'"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice", "'nope', which is not"),
        ([WEATHER], {"type": "function"}, None, "tool_choice", "named tool_choice"),
        (None, "required", None, "tool_choice", "needs tools"),
        ([{"type": "function", "function": {}}], "required", None, "tools", "name must be a non-empty"),
        ([{"type": "retrieval"}], "required", None, "tools", "must be"),
        ([WEATHER, WEATHER], "required", None, "tools", "given twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "required", None, "tools", "JSON schema"),
    ],
)
def test_errors_name_the_field(tools, choice, parser, param, message):
    with pytest.raises(ToolError, match=message) as info:
        plan_tools(tools, choice, parser=parser)
    assert info.value.param == param
