"""The router's request path against instances simulated with httpx's MockTransport (the
processes themselves: tests/distributed/test_disaggregated_serve.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ridge.router.app import Router, RouterConfig, RouterError

P1, P2, D1 = "http://p1:1", "http://p2:1", "http://d1:1"


def _router(handler) -> Router:
    router = Router(RouterConfig(prefill=(P1, P2), decode=(D1,)))
    for i, inst in enumerate(router.instances):
        inst.healthy = True
        inst.kv_info = {"engine_id": f"engine-{i}"}
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    router.policy.choose = lambda candidates, text: candidates[0]  # P1 first while it is a candidate
    return router


def test_a_prefill_instance_that_died_unseen_fails_its_pairing_and_the_request_goes_to_another():
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        sent.append((url, request.url.path))
        if url == P1:  # killed: the health loop has not noticed yet
            raise httpx.ReadError("connection reset", request=request)
        if request.url.path == "/kv/connect":
            return httpx.Response(200, json={})
        if url == P2:
            return httpx.Response(200, json={"kv_transfer_params": {"transfer_id": "t"}})
        return httpx.Response(200, json={"choices": [{"text": " from d1"}]})

    router = _router(handler)
    answer = asyncio.run(router._disaggregated("/v1/completions", {"prompt": "Tom", "max_tokens": 4}, {}, "Tom"))
    assert answer.status_code == 200 and b"from d1" in answer.body
    p1 = router.instances[0]
    assert not p1.healthy and "ReadError" in p1.last_error  # out of rotation for the next requests
    assert (P2, "/v1/completions") in sent and (D1, "/v1/completions") in sent


def test_a_pairing_the_instances_refuse_still_answers_502_with_their_reason():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/kv/connect":
            return httpx.Response(400, json={"error": {"message": "a different model"}})
        return httpx.Response(500)

    router = _router(handler)
    with pytest.raises(RouterError) as refused:  # the instance's reason, and no retry: both are healthy
        asyncio.run(router._disaggregated("/v1/completions", {"prompt": "Tom"}, {}, "Tom"))
    assert refused.value.status == 502 and "a different model" in refused.value.message
