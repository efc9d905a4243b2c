"""A client that leaves has its request aborted and its KV blocks freed (the pool whole once idle)."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import STORIES_NAME


def _aborts(http) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == "ridge_request_success_total" and s.labels["finished_reason"] == "abort":
                return s.value
    raise AssertionError("no abort counter")


def _long(**fields) -> dict:
    body = {
        "model": STORIES_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
    }
    return {**body, **fields}


def _holds_blocks(server) -> bool:
    state = server.pool_state()
    return state["used"] > 0 and state["unfinished"] > 0


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_frees_blocks(server, http, endpoint):
    server.wait_idle()
    before = _aborts(http)
    body = _long(stream=True)
    if endpoint.endswith("chat/completions"):
        body.pop("prompt")
        body["messages"] = [{"role": "user", "content": "Once upon a time"}]
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with client.stream("POST", endpoint, json=body) as res:
            assert res.status_code == 200
            lines = res.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few events in: the request is running
            assert any('"text"' in g or '"content"' in g for g in got)
            assert _holds_blocks(server)
        # leaving the block closes the connection mid-stream
    start = time.monotonic()
    state = server.wait_idle(timeout=10)
    assert state["used"] == 0 and state["free"] + state["cached"] == state["total"]
    assert time.monotonic() - start < 5  # aborted, not run to its 480 tokens
    assert _aborts(http) == before + 1


def test_disconnect_while_waiting_for_a_full_response(server, http):
    server.wait_idle()
    before = _aborts(http)
    # 0.1 s: far less than 2 x 480 tokens take anywhere (a 2-core Zen 5 ran them in under 0.5 s)
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=0.1)) as client:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            client.post("/v1/completions", json=_long(n=2))
    state = server.wait_idle(timeout=10)
    assert state["used"] == 0
    assert _aborts(http) == before + 2  # both sequences of the n=2 request


def test_many_disconnects_leave_the_pool_whole(server, http):
    server.wait_idle()
    clients = [httpx.Client(base_url=server.base_url, timeout=60) for _ in range(8)]
    streams = []
    try:
        for i, c in enumerate(clients):
            cm = c.stream("POST", "/v1/completions", json=_long(stream=True, prompt=f"Story number {i}:"))
            res = cm.__enter__()
            next(res.iter_lines())
            streams.append(cm)
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
        for c in clients:
            c.close()
    state = server.wait_idle(timeout=10)
    assert state["used"] == 0 and state["running"] == 0 and state["waiting"] == 0
    # and the server still answers
    res = http.post(
        "/v1/completions", json={"model": STORIES_NAME, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    )
    assert res.status_code == 200 and res.json()["choices"][0]["text"]
