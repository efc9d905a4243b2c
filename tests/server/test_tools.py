"""Tool calling through the server with the ``openai`` client, on stories260K with a
hermes-format chat template (``HERMES_TEMPLATE``) and ``--tool-call-parser hermes``.

``required`` and a named function are forced by their grammar, so a random-ish model's calls
validate against the functions' schemas; ``auto`` is shown with outputs forced into the hermes
format by a regex (the model would never write one). Streamed deltas join into the calls of the
same request unstreamed."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from ridge.server.serving import ServerConfig
from tests.server.conftest import RunningServer, stories_engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": -9, "maximum": 9},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(stories_tools_dir):
    srv = RunningServer(
        stories_engine(stories_tools_dir),
        ServerConfig(("stories",), model_root=str(stories_tools_dir), tool_call_parser="hermes"),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


def _valid(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def _joined(stream) -> dict[int, dict]:
    """Per choice: content, calls (id, name, arguments joined from the deltas), finish_reason."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            choice = out.setdefault(c.index, {"content": "", "calls": {}, "finish_reason": None})
            choice["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = choice["calls"].setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id is not None:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
            if c.finish_reason is not None:
                choice["finish_reason"] = c.finish_reason
    return out


def test_required_calls_validate_streamed_and_not(client):
    kwargs = dict(
        model="stories",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: the array closes after it
        max_tokens=120,
    )
    res = client.chat.completions.create(**kwargs, temperature=0)
    (choice,) = res.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid(call)
    streamed = _joined(client.chat.completions.create(**kwargs, temperature=0, stream=True))[0]
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (call.function.name, call.function.arguments)
    ]
    sampled = client.chat.completions.create(**kwargs, temperature=1.0, seed=3, n=4)
    names = set()
    for choice in sampled.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        _valid(call)
        names.add(call.function.name)
    assert names == {"add", "get_weather"}  # the model picks among the functions


def test_required_parallel_calls_cut_short_stay_content(client):
    """This tiny model never closes the array of calls: cut by max_tokens, the output is
    returned as content, never as half a call."""
    res = client.chat.completions.create(
        model="stories", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=90, temperature=0
    )
    choice = res.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith('[{"name":')
    assert choice.message.content.count('"name":') >= 2  # several calls were under way


def test_named_function_streamed_and_not(client):
    kwargs = dict(
        model="stories",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=60,
        temperature=0.9,
        seed=11,
    )
    res = client.chat.completions.create(**kwargs)
    (call,) = res.choices[0].message.tool_calls
    assert call.function.name == "add" and res.choices[0].finish_reason == "stop"  # forced: OpenAI's "stop"
    _valid(call)
    streamed = _joined(client.chat.completions.create(**kwargs, stream=True))[0]
    (joined,) = streamed["calls"].values()
    assert (joined["name"], joined["arguments"]) == ("add", call.function.arguments)


# The hermes format with text around the calls, forced by a regex: what ``auto`` reads.
AUTO_REGEX = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", '
    r'"unit": "C"\}\}\n</tool_call>\n<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": 2\}\}\n'
    r"</tool_call>"
)


def test_auto_reads_the_models_calls_streamed_and_not(client):
    kwargs = dict(
        model="stories",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=150,
        temperature=0.7,
        seed=2,
        extra_body={"structured_outputs": {"regex": AUTO_REGEX}},
    )
    res = client.chat.completions.create(**kwargs)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "add"]
    for call in choice.message.tool_calls:
        _valid(call)
    streamed = _joined(client.chat.completions.create(**kwargs, stream=True))[0]
    assert streamed["content"] == "Let me check." and streamed["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert len({c["id"] for c in streamed["calls"].values()}) == 2


def test_auto_without_a_call_is_content(client):
    res = client.chat.completions.create(
        model="stories", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0
    )  # tool_choice left out: auto
    choice = res.choices[0]
    assert choice.message.tool_calls in (None, []) and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_a_conversation_with_calls_and_results(client, server):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    res = client.chat.completions.create(model="stories", messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    prompt = server.engine.tokenizer.apply_chat_template(
        [{**m} for m in messages], add_generation_prompt=True, tools=TOOLS
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' in prompt
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in prompt
    assert "Tools:\nget_weather(city, unit)\nadd(a, b)\n" in prompt
    # the server rendered exactly this prompt
    assert res.usage.prompt_tokens == len(server.engine.tokenizer.encode_chat(messages, tools=TOOLS))


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "non-empty"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
                    }
                ],
                "tool_choice": "required",
            },
            "structured_outputs",
            "structured_outputs",
        ),
    ],
)
def test_bad_tools_are_400s_and_the_next_request_is_served(server, body, param, message):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        res = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
        assert res.status_code == 400, res.text
        error = res.json()["error"]
        assert error["param"] == param and message in error["message"]
        ok = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
        assert ok.status_code == 200


def test_malformed_arguments_in_a_message_are_a_400(server):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}],
        },
    ]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        res = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
        assert res.status_code == 400 and "not valid JSON" in res.json()["error"]["message"]


def test_an_agent_loop_sends_the_reply_message_back(client):
    """The openai client's own message object goes back as the assistant's turn, then the result."""
    messages = list(MESSAGES)
    reply = client.chat.completions.create(
        model="stories",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    ).choices[0]
    (call,) = reply.message.tool_calls
    messages += [reply.message, {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    answer = client.chat.completions.create(model="stories", messages=messages, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].message.content is not None
