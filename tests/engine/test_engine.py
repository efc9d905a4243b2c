"""The engine API: bad input stays local, streaming, stop strings, n, logprobs, seeds, abort."""

from __future__ import annotations

import pytest

from ridge import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=16)


def drain(engine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_bad_requests_raise_and_leave_the_others_alone(llm):
    engine = llm.engine
    engine.add_request("good-1", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=12))
    engine.step()  # good-1 is running when the bad ones arrive
    too_long = [5] * engine.max_model_len
    for bad, match in [
        ("", "empty"),
        ([], "empty"),
        (too_long, "context limit"),
        ([1, 99999], "outside the vocabulary"),
        (3.5, "string or a list of token ids"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(None, bad, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good-1", "hi", SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request(None, "hi", {"temperature": 0})
    engine.add_request("good-2", "The dog", SamplingParams(temperature=0.0, max_tokens=12))
    final = drain(engine)
    assert set(final) == {"good-1", "good-2"}
    alone = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert final["good-1"].outputs[0].token_ids == alone.outputs[0].token_ids
    engine.kv.check_integrity()


def engine_state(engine) -> dict:
    """Everything a refused add_request must leave as it was."""
    engine.kv.check_integrity()
    sched = engine.scheduler
    return {
        "requests": {rid: [s.seq_id for s in st.sequences] for rid, st in engine.output_processor.requests.items()},
        "scheduled": sorted(sched.requests),
        "waiting": [r.request_id for r in sched.waiting],
        "running": [r.request_id for r in sched.running],
        "pool": engine.kv.pool.counts(),
    }


def test_every_refused_add_request_leaves_the_engine_whole(llm):
    """Each refusal path of add_request, with requests in flight: nothing changes, and the
    requests in flight finish as if alone (the bug: "a" with n=2, then "a#0", overwrote the
    first request's sequence map and left the engine unfinished forever)."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add_request("a", "Once upon a time", SamplingParams(n=2, temperature=0.0, max_tokens=8))
    engine.add_request("b#1", "The dog", greedy)
    engine.step()
    before = engine_state(engine)
    refusals = [
        (("a", "hi", greedy), "already in use"),
        (("a#0", "hi", greedy), "clashes"),
        (("a#1", [5, 6], greedy), "clashes"),
        (("b", "hi", SamplingParams(n=2)), "clashes"),
        ((None, "hi", {"temperature": 0}), "SamplingParams"),
        ((None, "", greedy), "empty"),
        ((None, [], greedy), "empty"),
        ((None, 3.5, greedy), "string or a list of token ids"),
        ((None, [1, True], greedy), "string or a list of token ids"),
        ((None, [1, 99999], greedy), "outside the vocabulary"),
        ((None, [-1], greedy), "outside the vocabulary"),
        ((None, "Once \ud800 upon", greedy), "lone surrogate U\\+D800"),
        ((None, "Once \udcff upon", greedy), "byte 0xff"),
        ((None, "x" * (engine.max_prompt_chars + 1), greedy), "characters"),
        ((None, [5] * engine.max_model_len, greedy), "context limit"),
    ]
    for args, match in refusals:
        with pytest.raises(ValueError, match=match):
            engine.add_request(*args)
        assert engine_state(engine) == before, args
    final = drain(engine)
    assert set(final) == {"a", "b#1"} and not engine.has_unfinished_requests()
    assert engine.kv.pool.counts()["used"] == 0
    alone = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0]
    assert [c.token_ids for c in final["a"].outputs] == [alone.token_ids] * 2
    assert [c.text for c in final["a"].outputs] == [alone.text] * 2


def test_a_request_over_the_kv_pool_is_refused_atomically(stories_dir):
    small = LLM(str(stories_dir), dtype="float32", num_kv_blocks=4, block_size=4)
    before = engine_state(small.engine)
    with pytest.raises(ValueError, match="KV blocks"):
        small.engine.add_request("x", "Once upon a time", SamplingParams(max_tokens=50))
    assert engine_state(small.engine) == before


def test_untokenizable_text_is_a_value_error_everywhere(llm):
    for bad in ("Once \ud800 upon", "\udcff"):
        with pytest.raises(ValueError, match="not valid"):
            llm.generate(bad, SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="not valid"):
            llm.chat([{"role": "user", "content": bad}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(top_k=-2), dict(n=0)],
)
def test_invalid_sampling_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_a_request_larger_than_the_pool_is_refused(stories_dir):
    small = LLM(str(stories_dir), dtype="float32", num_kv_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate(["Once upon a time"], SamplingParams(max_tokens=50), use_tqdm=False)
    assert not small.engine.has_unfinished_requests()


def test_generate_rejects_the_whole_list_when_one_prompt_is_bad(llm):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_streamed_deltas_add_up_to_the_text(llm):
    engine = llm.engine
    engine.add_request("s", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=30))
    pieces, ids, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].delta_text)
            ids.extend(out.outputs[0].delta_token_ids)
            final = out
    assert "".join(pieces) == final.outputs[0].text
    assert ids == final.outputs[0].token_ids
    m = final.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


@pytest.mark.parametrize("include_stop", [False, True])
def test_text_decoded_at_finish_equals_the_streamed_text(llm, include_stop):
    """Non-streamed requests without stop strings are detokenized once, at the end."""
    engine = llm.engine
    first = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    stop_id = first.outputs[0].token_ids[5]  # ends the request on a token: hidden unless include_stop
    params = SamplingParams(
        temperature=0.0, max_tokens=40, stop_token_ids=[stop_id], include_stop_str_in_output=include_stop
    )
    long_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = []
    for params_ in (params, long_params):
        engine.add_request("streamed", "Once upon a time", params_, stream=True)
        engine.add_request("at-finish", "Once upon a time", params_, stream=False)
        final = drain(engine)
        streamed, at_finish = final["streamed"].outputs[0], final["at-finish"].outputs[0]
        assert at_finish.token_ids == streamed.token_ids
        assert at_finish.text == streamed.text and at_finish.finish_reason == streamed.finish_reason
        assert at_finish.delta_text == at_finish.text  # one output, all of it
        results.append(at_finish)
    stopped, long = results
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_id
    assert long.finish_reason == "length" and len(long.token_ids) == 40 and long.text


def test_stop_string_is_not_returned(llm):
    base = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0]
    assert "Lily" in base.outputs[0].text
    out = llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=30, stop=["Lily"]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Lily"
    assert out.text == base.outputs[0].text.split("Lily")[0]
    kept = llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=0.0, max_tokens=30, stop=["Lily"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == out.text + "Lily"


def test_eos_and_stop_token_ids_end_the_request(llm):
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=400), use_tqdm=False)[0]
    comp = out.outputs[0]
    if comp.finish_reason == "stop":  # the story ended with eos
        assert comp.token_ids[-1] in llm.engine.eos_token_ids
    first = comp.token_ids[3]
    out2 = llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[first]), use_tqdm=False
    )[0].outputs[0]
    assert out2.token_ids[-1] == first and out2.stop_reason == first and out2.finish_reason == "stop"
    assert len(out2.token_ids) == comp.token_ids.index(first) + 1


def test_n_completions_and_logprobs(llm):
    out = llm.generate(
        ["Once upon a time"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, logprobs=2), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for comp in out.outputs:
        assert len(comp.logprobs) == len(comp.token_ids)
        for token, entry in zip(comp.token_ids, comp.logprobs):
            assert token in entry and len(entry) >= 2
            assert all(lp.logprob <= 0 for lp in entry.values())
        assert comp.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs))
        )


def test_seeded_sampling_is_independent_of_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    alone = llm.generate(["The little dog"], sp, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["Once upon a time", "The little dog", "A bird", "Tom and Sue"]
    params = [
        SamplingParams(temperature=1.0, max_tokens=15),
        sp,
        SamplingParams(temperature=0.7, seed=5, max_tokens=25),
        SamplingParams(temperature=0.0, max_tokens=9),
    ]
    together = llm.generate(crowd, params, use_tqdm=False)
    assert together[1].outputs[0].token_ids == alone


def test_abort_frees_the_blocks(llm):
    engine = llm.engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.pool.counts()["used"] > 0
    engine.abort_request("a")
    while engine.has_unfinished_requests():  # a step still out (asynchronous scheduling) is collected first
        engine.step()
    assert engine.kv.pool.counts()["used"] == 0 and not engine.has_unfinished_requests()
    engine.kv.check_integrity()


def test_chat_uses_the_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "Tell me a story"}], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 5
    rendered = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Tell me a story"}])
    assert "Tell me a story" in rendered


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slots_nobody_wrote_never_change_a_result(stories_dir, kernels, dtype):
    """The KV pool is not zero-filled (that took seconds at start-up): a pool full of NaN must
    give the same tokens as a zeroed one, through every read path (padded decode tables,
    block tails past a context, prefill over a cached prefix)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["Once upon a time", "The dog ran to the big red", "A"]
    results = []
    for fill in (0.0, float("nan")):
        llm = LLM(
            str(stories_dir),
            dtype=dtype,
            kernels=kernels,
            num_kv_blocks=64,
            block_size=16,
            device="cpu",
            max_num_batched_tokens=8,
        )  # chunked prefill: chunks read the cached prefix
        for cache in llm.engine.executor.worker.kv_caches:
            cache.k.fill_(fill)
            cache.v.fill_(fill)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]
