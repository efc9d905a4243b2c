"""The OpenAI-compatible endpoints, driven by the official ``openai`` client on stories260K."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ridge.engine.tokenizer import render_plain_chat
from tests.server.conftest import STORIES_NAME, TEST_THREADS

PROMPT = "Once upon a time"
GREEDY_START = ", there was a little girl named Lily. She loved to play outside in the park."


def test_health_and_models(http, client, server):
    assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [STORIES_NAME, "stories260K"]
    assert models.data[0].owned_by == "ridge"
    assert http.get("/v1/models/stories260K").json()["max_model_len"] == 512
    assert http.get("/v1/models/nope").status_code == 404


def test_completion_greedy_and_usage(client, tokenizer):
    res = client.completions.create(model=STORIES_NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    (choice,) = res.choices
    assert res.object == "text_completion" and res.id.startswith("cmpl-") and res.model == STORIES_NAME
    assert GREEDY_START.startswith(choice.text)  # 20 tokens in, "Lily. She loved..." follows
    assert choice.text.startswith(", there was a little girl named Lily.")
    assert choice.finish_reason == "length"
    assert res.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert res.usage.completion_tokens == 20
    assert res.usage.total_tokens == res.usage.prompt_tokens + 20


def test_any_served_name_and_no_model(http):
    for body in (
        {"model": "stories260K", "prompt": PROMPT, "max_tokens": 3, "temperature": 0},
        {"prompt": PROMPT, "max_tokens": 3, "temperature": 0},
    ):
        res = http.post("/v1/completions", json=body)
        assert res.status_code == 200, res.text
        assert res.json()["model"] == STORIES_NAME


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(model=STORIES_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    chunks = list(
        client.completions.create(
            model=STORIES_NAME,
            prompt=PROMPT,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert len(chunks) > 10  # streamed, not one blob
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and not chunks[-1].choices
    assert usage_chunks[0].usage.model_dump() == full.usage.model_dump()


def test_stream_ends_with_done(http):
    body = {"model": STORIES_NAME, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as res:
        assert res.headers["content-type"].startswith("text/event-stream")
        events = [line for line in res.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["object"] for e in events[:-1]] == ["text_completion"] * (len(events) - 1)
    # the published schema describes one event as a client parses it (schemathesis checks each)
    reply = http.get("/openapi.json").json()["paths"]["/v1/completions"]["post"]["responses"]["200"]
    event_schema = reply["content"]["text/event-stream"]["schema"]
    for e in events:
        jsonschema.validate({"data": e[6:], "event": "message"}, event_schema)


def test_n_and_several_prompts(client):
    res = client.completions.create(
        model=STORIES_NAME, prompt=PROMPT, n=3, max_tokens=10, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in res.choices) == [0, 1, 2]
    assert res.usage.completion_tokens == 30  # ignore_eos: every choice runs to max_tokens
    assert len({c.text for c in res.choices}) > 1  # each sample its own stream

    res = client.completions.create(
        model=STORIES_NAME,
        prompt=[PROMPT, "The cat"],
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    by_index = {c.index: c.text for c in res.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: both samples agree
    assert by_index[0] != by_index[2]  # prompt i's choices are i*n .. i*n+n-1
    assert res.usage.completion_tokens == 24


def test_n_streaming(client):
    chunks = list(
        client.completions.create(
            model=STORIES_NAME, prompt=[PROMPT, "The cat"], n=2, max_tokens=8, temperature=0, stream=True
        )
    )
    texts: dict[int, str] = {}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2, 3}
    full = client.completions.create(model=STORIES_NAME, prompt=[PROMPT, "The cat"], n=2, max_tokens=8, temperature=0)
    assert texts == {c.index: c.text for c in full.choices}


def test_stop_strings(client):
    res = client.completions.create(model=STORIES_NAME, prompt=PROMPT, max_tokens=40, temperature=0, stop=["Lily"])
    (choice,) = res.choices
    assert choice.text == ", there was a little girl named "
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "Lily"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=STORIES_NAME, prompt=PROMPT, max_tokens=40, temperature=0, stop="Lily", stream=True
        )
        if c.choices
    )
    assert streamed == choice.text


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return (
            client.completions.create(
                model=STORIES_NAME, prompt=PROMPT, max_tokens=30, temperature=1.0, top_p=0.95, seed=seed
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))
    chat = [
        client.chat.completions.create(
            model=STORIES_NAME,
            messages=[{"role": "user", "content": "Tell a story"}],
            max_tokens=20,
            temperature=0.9,
            seed=42,
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert chat[0] == chat[1]


def test_completion_logprobs(client):
    res = client.completions.create(
        model=STORIES_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0
        assert 3 <= len(top) <= 4
        assert token_lp == pytest.approx(max(top.values()))  # greedy takes the most likely
    assert lp.text_offset == sorted(lp.text_offset)
    # The tokens join into the text, with SentencePiece's spaces (they came back as
    # [',', 'there', 'was', ...]), and each offset is where its token starts.
    text = res.choices[0].text
    assert "".join(lp.tokens) == text and any(t.startswith(" ") for t in lp.tokens)
    assert all(text[off:].startswith(tok) for tok, off in zip(lp.tokens, lp.text_offset))
    assert all(tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model=STORIES_NAME,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    ]
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs)


def test_echo_and_token_id_prompt(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=STORIES_NAME, prompt=ids, max_tokens=10, temperature=0)
    by_text = client.completions.create(model=STORIES_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(model=STORIES_NAME, prompt=PROMPT, max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=STORIES_NAME, prompt=PROMPT, max_tokens=10, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == echoed.choices[0].text


def test_echo_with_logprobs_and_no_tokens_scores_the_prompt(client, tokenizer, stories_dir):
    """What lm-evaluation-harness's local-completions backend sends for log-likelihoods."""
    from ridge import LLM, SamplingParams

    scored = client.completions.create(
        model=STORIES_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    choice = scored.choices[0]
    ids = tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == PROMPT and lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(ids))]
    reference = LLM(str(stories_dir), num_kv_blocks=32).generate(
        [PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )[0]
    for k in range(1, len(ids)):
        assert lp.token_logprobs[k] == pytest.approx(reference.prompt_logprobs[k][ids[k]].logprob, abs=1e-5)
        assert 2 <= len(lp.top_logprobs[k]) <= 3
    # with generated tokens: the prompt's entries, then the completion's, offsets running on
    both = client.completions.create(model=STORIES_NAME, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1)
    c = both.choices[0]
    assert len(c.logprobs.tokens) == len(ids) + 4 and c.text.startswith(PROMPT)
    assert c.logprobs.text_offset[len(ids)] == len(PROMPT)


def test_chat(client, tokenizer, server):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}]
    res = client.chat.completions.create(model=STORIES_NAME, messages=messages, max_tokens=24, temperature=0)
    (choice,) = res.choices
    assert res.object == "chat.completion" and res.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = tokenizer.encode(render_plain_chat(messages, True))  # with bos, as generate gives any prompt
    assert prompt_ids[0] == tokenizer.bos_token_id
    assert res.usage.prompt_tokens == len(prompt_ids)
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens

    # the same tokens through the engine directly: the chat template is the plain fallback
    from ridge import LLM, SamplingParams

    llm = LLM(server.config.model_root, dtype="float32", num_threads=TEST_THREADS)
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert choice.message.content == ref.text
    assert res.usage.completion_tokens == len(ref.token_ids)


def test_chat_stream_and_content_parts(client):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Once upon "}, {"type": "text", "text": "a time"}]}
    ]
    full = client.chat.completions.create(model=STORIES_NAME, messages=messages, max_tokens=30, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=STORIES_NAME,
            messages=messages,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    plain = client.chat.completions.create(
        model=STORIES_NAME, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=30, temperature=0
    )
    assert plain.choices[0].message.content == full.choices[0].message.content


def test_chat_logprobs_n_and_max_completion_tokens(client):
    res = client.chat.completions.create(
        model=STORIES_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        temperature=0.8,
        seed=3,
        max_tokens=50,
        max_completion_tokens=6,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in res.choices) == [0, 1]
    assert res.usage.completion_tokens == 12  # max_completion_tokens wins over max_tokens
    for choice in res.choices:
        content = choice.logprobs.content
        assert len(content) == 6
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.bytes == list(entry.token.encode())
        assert "".join(e.token for e in content) == choice.message.content  # spaces kept (token '' before)
    chunks = list(
        client.chat.completions.create(
            model=STORIES_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_completion_tokens=5,
            temperature=0,
            logprobs=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(streamed) == 5


def test_max_tokens_default_runs_to_stop_or_context(client):
    res = client.chat.completions.create(
        model=STORIES_NAME, messages=[{"role": "user", "content": "Once upon a time"}], temperature=0
    )
    assert res.choices[0].finish_reason in ("stop", "length")
    assert res.usage.total_tokens <= 512


def test_each_choice_ends_once_in_a_stream(http):
    """With n > 1 a choice that had ended was sent again, empty, with its finish reason, in
    every event until the others ended. The stop string ends the choices at different steps."""
    common = {
        "model": STORIES_NAME,
        "stream": True,
        "n": 3,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 7,
        "stop": [" "],
    }
    for path, body in (
        ("/v1/completions", {**common, "prompt": "Once upon a time"}),
        ("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "Hi"}]}),
    ):
        ends: dict[int, int] = {}
        with http.stream("POST", path, json=body) as res:
            for line in res.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice.get("finish_reason"):
                            ends[choice["index"]] = ends.get(choice["index"], 0) + 1
        assert ends == {0: 1, 1: 1, 2: 1}, (path, ends)
