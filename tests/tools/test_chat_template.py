"""Tools in the prompt: the plain fallback template (no model template) and the checks on an
assistant's ``tool_calls``; the model's own template is exercised in tests/server/test_tools.py."""

from __future__ import annotations

import pytest

from ridge.engine.tokenizer import ByteTokenizer

TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def test_plain_template_shows_tools_calls_and_results():
    messages = [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    text = ByteTokenizer().apply_chat_template(messages, tools=TOOLS)
    assert text == (
        'tools: [{"type": "function", "function": {"name": "now", "parameters": '
        '{"type": "object", "properties": {}}}}]\n'
        "user: Time?\n"
        'assistant: <tool_call>{"name": "now", "arguments": {"tz": "UTC"}}</tool_call>\n'
        "tool: 12:00\n"
        "assistant:"
    )
    assert ByteTokenizer().apply_chat_template(messages[:1]) == "user: Time?\nassistant:"  # no tools: as before


@pytest.mark.parametrize(
    "calls,message",
    [
        ("not a list", "must be a list"),
        ([{"type": "function"}], "must be"),
        ([{"function": {"name": "now", "arguments": "{bad"}}], "not valid JSON"),
    ],
)
def test_malformed_tool_calls_are_errors(calls, message):
    with pytest.raises(ValueError, match=message):
        ByteTokenizer().apply_chat_template([{"role": "assistant", "content": None, "tool_calls": calls}])
