"""Structured output through the server with the ``openai`` client: ``response_format``
(json_object, json_schema, ``client.chat.completions.parse`` with a pydantic model) and vLLM's
``structured_outputs`` field, streamed and not; a constraint that does not compile is a 400."""

from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: str = pydantic.Field(pattern="^(cat|dog)$")
    age: int = pydantic.Field(ge=0, le=99)


def test_chat_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model="stories",
        messages=[{"role": "user", "content": "Tell me about a pet."}],
        response_format=Pet,
        max_tokens=80,
        temperature=0.8,
        seed=1,
        n=2,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        pet = choice.message.parsed
        assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def test_json_object_and_schema_in_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "Once upon a time"}]
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    res = client.chat.completions.create(
        model="stories",
        messages=messages,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert isinstance(json.loads(res.choices[0].message.content)["n"], int)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="stories",
            messages=messages,
            max_tokens=40,
            temperature=0,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        )
        if c.choices
    )
    assert text == res.choices[0].message.content


def test_structured_outputs_in_completions(client):
    res = client.completions.create(
        model="stories",
        prompt="The cat",
        max_tokens=20,
        temperature=1.0,
        seed=4,
        n=3,
        extra_body={"structured_outputs": {"regex": "[a-c]{2,5}!"}},
    )
    assert all(re.fullmatch("[a-c]{2,5}!", c.text) for c in res.choices)
    stream = client.completions.create(
        model="stories",
        prompt="The cat",
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("red", "green")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"structured_outputs": {"regex": "a(b"}}, "unclosed group"),
        ({"structured_outputs": {"json": {"type": "nope"}}}, "nope"),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ],
)
def test_a_bad_constraint_is_a_400_and_the_server_serves_on(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="stories", prompt="x", max_tokens=4, extra_body=extra)
    assert client.completions.create(model="stories", prompt="x", max_tokens=2).choices[0].text is not None


def test_metrics_count_the_constrained_requests_and_their_masks(client, http):
    client.completions.create(
        model="stories", prompt="Hi", max_tokens=8, extra_body={"structured_outputs": {"regex": "[x-z]{1,4}"}}
    )
    text = http.get("/metrics").text
    values = {
        line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ridge_structured_output")
    }
    assert values["ridge_structured_output_requests_total"] >= 1
    assert values["ridge_structured_output_compiles_total"] >= 1
    assert values["ridge_structured_output_mask_steps_total"] >= 1
    assert values["ridge_structured_output_mask_seconds_total"] > 0
