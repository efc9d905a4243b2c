"""Bad input gets its status and an OpenAI error object, never a 500; the engine keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from ridge.server.serving import ServerConfig
from tests.server.conftest import STORIES_NAME, RunningServer, stories_engine

API_KEY = "sk-test-123"
BODY_LIMIT = 16 * 1024
GOOD = {"model": STORIES_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
CHAT = {"model": STORIES_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def guarded(stories_dir):
    """A server with an API key and a small body limit."""
    srv = RunningServer(
        stories_engine(stories_dir, max_num_seqs=8),
        ServerConfig((STORIES_NAME,), api_key=API_KEY, max_request_bytes=BODY_LIMIT),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api(guarded):
    with httpx.Client(base_url=guarded.base_url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def _assert_error(res: httpx.Response, status: int, param: str | None = "*", code: str | None = "*") -> dict:
    assert res.status_code == status, res.text
    assert res.headers["content-type"].startswith("application/json")
    body = res.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param != "*":
        assert err["param"] == param, err
    if code != "*":
        assert err["code"] == code, err
    return err


def comp(**fields) -> dict:
    return {**GOOD, **fields}


def chat(**fields) -> dict:
    return {**CHAT, **fields}


# (path, body, status, param, code); "*" = any.
CASES = [
    # malformed JSON and schema errors
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, "invalid_json"),
    ("/v1/completions", b"not json at all", 400, None, "invalid_json"),
    ("/v1/completions", b"", 422, "*", "missing"),
    ("/v1/completions", b"[1, 2]", 422, "*", "*"),
    ("/v1/completions", comp(temperature="hot"), 422, "temperature", "*"),
    ("/v1/completions", comp(max_tokens="ten"), 422, "max_tokens", "*"),
    ("/v1/completions", comp(stop=5), 422, "*", "*"),
    ("/v1/completions", comp(prompt={"text": "hi"}), 422, "*", "*"),
    ("/v1/completions", comp(prompt=[1, "a"]), 422, "*", "*"),
    ("/v1/completions", comp(stream="yes please"), 422, "stream", "*"),
    ("/v1/completions", comp(temprature=0.5), 422, "temprature", "extra_forbidden"),
    ("/v1/completions", {"model": STORIES_NAME}, 422, "prompt", "missing"),
    ("/v1/chat/completions", {"model": STORIES_NAME}, 422, "messages", "missing"),
    ("/v1/chat/completions", chat(messages="hi"), 422, "messages", "*"),
    ("/v1/chat/completions", chat(messages=[{"content": "hi"}]), 422, "*", "missing"),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]),
        422,
        "*",
        "*",
    ),
    # empty or too-long prompts, max_tokens beyond the context
    ("/v1/completions", comp(prompt=""), 400, "prompt", None),
    ("/v1/completions", comp(prompt=[]), 400, "prompt", None),
    ("/v1/completions", comp(prompt=["ok", ""]), 400, "prompt", None),
    ("/v1/completions", comp(prompt=[[]]), 400, "prompt", None),
    ("/v1/completions", comp(prompt="word " * 600), 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", comp(prompt=[5] * 512), 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", comp(max_tokens=600), 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", comp(prompt=[5] * 500, max_tokens=13), 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", chat(max_tokens=10**9), 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", chat(max_completion_tokens=512), 400, "max_completion_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages", None),
    ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages", None),
    ("/v1/completions", comp(prompt=[1, 2, 512]), 400, "prompt", None),
    ("/v1/completions", comp(prompt=[-1]), 400, "prompt", None),
    # out-of-range sampling values
    ("/v1/completions", comp(temperature=-0.5), 400, "temperature", None),
    ("/v1/completions", comp(top_p=0), 400, "top_p", None),
    ("/v1/completions", comp(top_p=1.5), 400, "top_p", None),
    ("/v1/completions", comp(top_k=-5), 400, "top_k", None),
    ("/v1/completions", comp(min_p=2), 400, "min_p", None),
    ("/v1/completions", comp(presence_penalty=3), 400, "presence_penalty", None),
    ("/v1/completions", comp(frequency_penalty=-2.5), 400, "frequency_penalty", None),
    ("/v1/completions", comp(repetition_penalty=0), 400, "repetition_penalty", None),
    ("/v1/completions", comp(max_tokens=0), 400, "max_tokens", None),
    ("/v1/completions", comp(max_tokens=-3), 400, "max_tokens", None),
    ("/v1/completions", comp(n=0), 400, "n", None),
    ("/v1/completions", comp(n=1000), 400, "n", None),
    ("/v1/completions", comp(logprobs=50), 400, "logprobs", None),
    ("/v1/completions", comp(seed=2**70), 400, "seed", None),
    ("/v1/completions", comp(stop=[""]), 400, "stop", None),
    ("/v1/completions", comp(min_tokens=20), 400, "min_tokens", None),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", None),
    ("/v1/chat/completions", chat(top_logprobs=3), 400, "top_logprobs", None),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("/v1/chat/completions", chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    # unsupported features and the unknown model
    ("/v1/completions", comp(suffix="end"), 400, "suffix", None),
    ("/v1/completions", comp(logit_bias={"5": 10}), 400, "logit_bias", None),
    ("/v1/completions", comp(stream_options={"include_usage": True}), 400, "stream_options", None),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice", None),
    ("/v1/chat/completions", chat(response_format={"type": "yaml"}), 400, "response_format", None),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema"}), 400, "response_format", None),
    ("/v1/completions", comp(structured_outputs={"regex": "a(b"}), 400, "structured_outputs", None),
    # text that is not valid Unicode (lone surrogates are legal JSON), and prompts longer
    # than the context could hold, refused before tokenizing
    ("/v1/completions", b'{"prompt": "Once \\ud800 upon", "max_tokens": 4}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 4}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": "\\ud800", "stream": true}', 400, "prompt", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a \\ud800"}]}', 400, "messages", None),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "stop": "\\ud800", "model": "\\ud83d"}',
        404,
        "model",
        "model_not_found",
    ),
    ("/v1/completions", comp(prompt="x" * (BODY_LIMIT - 200)), 400, "prompt", "context_length_exceeded"),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "x" * (BODY_LIMIT - 200)}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("/v1/completions", comp(model="gpt-4o"), 404, "model", "model_not_found"),
    ("/v1/chat/completions", chat(model="llama"), 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("path,body,status,param,code", CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_bad_input(api, path, body, status, param, code):
    if isinstance(body, bytes):
        res = api.post(path, content=body, headers={"content-type": "application/json"})
    else:
        res = api.post(path, json=body)
    _assert_error(res, status, param, code)


@pytest.mark.parametrize("seed", [2**64 - 1, -1, 0])
def test_any_seed_in_range_is_served(api, seed):
    """2**64 - 1 with n=2 was refused, quoting 2**64 (the second sample's seed) as the prompt's
    fault; -1 is llama.cpp's "random"."""
    res = api.post("/v1/completions", json=comp(seed=seed, n=2, temperature=1.0))
    assert res.status_code == 200, res.text
    assert len(res.json()["choices"]) == 2


def test_a_body_without_content_type_is_read_as_json(guarded):
    """curl -d sends no JSON content type; the body is JSON all the same (it was a 422)."""
    with httpx.Client(base_url=guarded.base_url, timeout=60) as raw:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        for content_type in (None, "application/x-www-form-urlencoded", "text/plain"):
            hdrs = {**headers, **({"content-type": content_type} if content_type else {})}
            res = raw.post("/v1/completions", content=json.dumps(GOOD).encode(), headers=hdrs)
            assert res.status_code == 200, (content_type, res.text)
            assert res.json()["choices"][0]["text"]


def test_streaming_bad_input_is_an_error_reply_not_a_stream(api):
    res = api.post("/v1/completions", json=comp(stream=True, temperature=-1))
    _assert_error(res, 400, "temperature")
    res = api.post("/v1/chat/completions", json=chat(stream=True, max_tokens=100000))
    _assert_error(res, 400, "max_tokens", "context_length_exceeded")


def test_api_key(guarded, api):
    with httpx.Client(base_url=guarded.base_url, timeout=30) as anon:
        _assert_error(anon.post("/v1/completions", json=GOOD), 401, code="invalid_api_key")
        _assert_error(anon.get("/v1/models"), 401, code="invalid_api_key")
        wrong = anon.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer sk-wrong"})
        _assert_error(wrong, 401, code="invalid_api_key")
        assert anon.get("/health").status_code == 200  # health and metrics stay open (probes)
        assert anon.get("/metrics").status_code == 200
    assert api.post("/v1/completions", json=GOOD).status_code == 200

    import openai

    client = openai.OpenAI(base_url=guarded.url("/v1"), api_key=API_KEY, max_retries=0)
    assert client.completions.create(**GOOD).choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url("/v1"), api_key="nope", max_retries=0).models.list()


def test_body_too_large(api):
    big = comp(prompt="x" * (BODY_LIMIT + 10))
    _assert_error(api.post("/v1/completions", json=big), 413, code="request_too_large")

    def chunked():  # no Content-Length: counted as it arrives
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 4096):
            yield payload[i : i + 4096]

    res = api.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    _assert_error(res, 413, code="request_too_large")


def test_routes_and_methods(api):
    _assert_error(api.get("/v1/nothing-here"), 404)
    _assert_error(api.get("/v1/completions"), 405)
    _assert_error(api.get("/v1/models/other"), 404, "model", "model_not_found")


def test_still_serving_after_the_errors(guarded, api):
    res = api.post("/v1/completions", json=GOOD)
    assert res.status_code == 200
    assert res.json()["choices"][0]["text"].startswith(", there was")
    guarded.wait_idle()
    errors = [
        line
        for line in api.get("/metrics").text.splitlines()
        if line.startswith("ridge_http_errors_total") and 'status="500"' in line
    ]
    assert errors == []


def test_a_failing_step_fails_its_requests_only(guarded, api):
    """A step that raises (an engine bug) fails the requests in flight with an error; the next ones are served."""
    real_step = guarded.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_step()

    guarded.engine.step = flaky_step  # one attribute store: the engine loop's next call takes it
    try:
        res = api.post("/v1/completions", json=comp(max_tokens=20))
        err = _assert_error(res, 500)
        assert "injected failure" in err["message"]
        guarded.wait_idle()
        calls["n"] = 0  # again, in a stream: an error event, then [DONE]
        with api.stream("POST", "/v1/completions", json=comp(max_tokens=20, stream=True)) as stream:
            assert stream.status_code == 200
            lines = [line for line in stream.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert "injected failure" in events[-1]["error"]["message"]
        assert all("choices" in e for e in events[:-1])
        guarded.wait_idle()
    finally:
        del guarded.engine.step
    assert api.post("/v1/completions", json=GOOD).status_code == 200
    guarded.wait_idle()
