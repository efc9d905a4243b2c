"""Many clients at once: every stream complete and equal to ``LLM.generate``; bad requests harm no one."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from ridge import LLM, SamplingParams
from ridge.server.serving import ServerConfig
from tests.server.conftest import STORIES_NAME, TEST_THREADS, RunningServer, stories_engine

PROMPTS = [
    "Once upon a time",
    "The cat",
    "Lily and Ben",
    "One day, a little dog",
    "The sun was",
    "Tom had a red ball",
    "In the park",
    "The bird sang",
    "Mom said",
    "There was a big tree",
    "A small boy",
    "The girl wanted",
    "Sue liked to",
    "The fish",
    "It was a rainy day",
    "Max the dog",
    "The car went",
    "Anna saw a",
    "Tim and his dad",
    "The old man",
]


@pytest.fixture(scope="module")
def reference(server):
    """Greedy texts from the offline API for the same prompts (a separate engine)."""
    llm = LLM(server.config.model_root, dtype="float32", max_num_seqs=4, num_threads=TEST_THREADS)
    params = [SamplingParams(temperature=0, max_tokens=24 + 4 * i) for i in range(len(PROMPTS))]
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


async def _stream(client, prompt: str, max_tokens: int) -> tuple[str, str | None, int]:
    text, finish, chunks = "", None, 0
    stream = await client.completions.create(
        model=STORIES_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
            chunks += 1
    return text, finish, chunks


def test_twenty_concurrent_streams_match_llm_generate(server, reference):
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(_stream(client, p, 24 + 4 * i) for i, p in enumerate(PROMPTS)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 20
    for (text, finish, chunks), ref in zip(results, reference):
        assert finish == ref.finish_reason  # every stream ran to its end
        assert text == ref.text
        assert chunks >= 1
    server.wait_idle()


# One of each kind of bad input, for the burst (method, path, body-or-bytes, expected status).
BAD = [
    ("/v1/completions", b'{"prompt": "Once', 400),
    ("/v1/completions", {"prompt": "hi", "temperature": "warm"}, 422),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 2.0}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, 400),
    ("/v1/completions", {"prompt": "word " * 700}, 400),
    ("/v1/chat/completions", {"model": STORIES_NAME}, 422),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400),
    ("/v1/completions", b'{"prompt": "Once \\ud800 upon"}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc80"}], "stream": true}', 400),
]


def test_burst_of_bad_requests_between_good_ones(server, reference):
    async def good(client, i):
        body = {"model": STORIES_NAME, "prompt": PROMPTS[i], "max_tokens": 24 + 4 * i, "temperature": 0, "stream": True}
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as res:
            assert res.status_code == 200
            async for line in res.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["text"]
        return text

    async def bad(client, path, body, status):
        await asyncio.sleep(0.01)
        if isinstance(body, bytes):
            res = await client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            res = await client.post(path, json=body)
        err = res.json()["error"]
        return res.status_code, status, err

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            goods = [asyncio.ensure_future(good(client, i)) for i in range(0, 20, 2)]
            bads = [bad(client, *b) for b in BAD * 3]
            bad_results = await asyncio.gather(*bads)
            more_goods = [asyncio.ensure_future(good(client, i)) for i in range(1, 20, 2)]
            return await asyncio.gather(*goods), await asyncio.gather(*more_goods), bad_results

    first, second, bad_results = asyncio.run(main())
    for got, want, err in bad_results:
        assert got == want, err
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    for i, text in zip(range(0, 20, 2), first):
        assert text == reference[i].text
    for i, text in zip(range(1, 20, 2), second):
        assert text == reference[i].text
    server.wait_idle()


@pytest.fixture(scope="module")
def short_context_server(stories_dir):
    srv = RunningServer(stories_engine(stories_dir, max_model_len=64, max_num_seqs=4), ServerConfig((STORIES_NAME,)))
    yield srv
    srv.stop()


def test_a_huge_prompt_is_refused_at_once_and_stalls_no_one(short_context_server):
    """7 MiB of prompt to a 64-token context: refused before tokenizing (it took 9 s, and a
    concurrent "hi" waited 7.7 s behind it on the one tokenizer thread)."""
    srv = short_context_server
    huge = {"prompt": "Once upon a time. " * (7 * 2**20 // 18), "max_tokens": 4}
    small = {"prompt": "hi", "max_tokens": 4, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
            start = time.monotonic()
            big = asyncio.ensure_future(client.post("/v1/completions", json=huge))
            await asyncio.sleep(0.05)
            small_start = time.monotonic()
            res = await client.post("/v1/completions", json=small)
            small_s = time.monotonic() - small_start
            big_res = await big
            return res, small_s, big_res, time.monotonic() - start

    res, small_s, big_res, total_s = asyncio.run(main())
    assert res.status_code == 200 and small_s < 1.0, small_s
    assert big_res.status_code == 400 and big_res.json()["error"]["code"] == "context_length_exceeded"
    assert total_s < 5.0, total_s
    srv.wait_idle()


def test_twenty_concurrent_streams_on_a_quantized_model_match_each_request_alone(stories_dir):
    import openai

    # bfloat16: every matmul then runs on ridge's CPU kernels, which give a row the same result
    # in any batch (float32 F.linear, for the layers that stay unquantized at K = 172, does not;
    # nor do the GPU's, whose kernel and rounding of x change with the rows: the CPU's here)
    options = {"quantization": "int8", "dtype": "bfloat16", "device": "cpu"}
    srv = RunningServer(
        stories_engine(stories_dir, **options), ServerConfig((STORIES_NAME, "stories260K"), model_root=str(stories_dir))
    )
    try:
        alone = LLM(str(stories_dir), max_num_seqs=1, num_threads=TEST_THREADS, **options)
        params = [SamplingParams(temperature=0, max_tokens=24 + 4 * i) for i in range(len(PROMPTS))]
        reference = [o.outputs[0] for o in alone.generate(PROMPTS, params, use_tqdm=False)]

        async def main():
            client = openai.AsyncOpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=120)
            try:
                return await asyncio.gather(*(_stream(client, p, 24 + 4 * i) for i, p in enumerate(PROMPTS)))
            finally:
                await client.close()

        results = asyncio.run(main())
        for (text, finish, _), ref in zip(results, reference):
            assert (text, finish) == (ref.text, ref.finish_reason)
        srv.wait_idle()
    finally:
        srv.stop()
