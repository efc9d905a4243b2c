"""Speculative decoding end to end: greedy output token for token equal to plain decoding
(n-gram and draft proposers, every architecture, chunked prefill, prefix hits, forced
preemption), and the rollback contracts: stops inside a run, max_tokens, abort, logprobs,
and rejected tokens never reaching the prefix cache."""

from __future__ import annotations

import pytest
import torch

from ridge import LLM, SamplingParams

from ..models.hf_tiny import VARIANTS, build

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    dirs = {}
    for variant in VARIANTS:
        dirs[variant] = tmp_path_factory.mktemp(variant)
        build(variant, dirs[variant], seed=3)
    return dirs


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    directory = tmp_path_factory.mktemp("draft")
    build("llama-gqa", directory, seed=11)
    return directory


def _requests(count=24):
    """Mixed lengths; prompts share prefixes (prefix hits) and repeat themselves (n-gram finds
    continuations); some requests are long enough to be chunked."""
    gen = torch.Generator().manual_seed(0)
    stem = torch.randint(3, 290, (12,), generator=gen).tolist()
    prompts, params = [], []
    for i in range(count):
        own = torch.randint(3, 290, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        prompt = (stem if i % 3 == 0 else []) + own + own[: i % 7]
        prompts.append(prompt)
        params.append(
            SamplingParams(temperature=0.0, max_tokens=int(torch.randint(4, 30, (1,), generator=gen)), ignore_eos=True)
        )
    return prompts, params


def _crowded(model, **options):
    # 48 blocks of 4 tokens cannot hold 24 requests of up to 70 tokens: preemption is forced;
    # a budget of 32 tokens chunks the longer prompts.
    return LLM(
        str(model),
        tokenizer="bytes",
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=48,
        max_num_batched_tokens=32,
        **options,
    )


def _assert_same_as_plain(model, spec):
    prompts, params = _requests()
    plain = _crowded(model).generate(prompts, params, use_tqdm=False)
    llm = _crowded(model, speculative_config=spec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for a, b, sp in zip(plain, outs, params):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == sp.max_tokens
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.speculator.stats.num_accepted_tokens > 0  # speculation really ran and paid
    engine.kv.check_integrity()
    assert engine.kv.pool.counts()["used"] == 0
    return engine


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ngram_greedy_equals_plain(tiny_dirs, variant):
    _assert_same_as_plain(tiny_dirs[variant], NGRAM)


@pytest.mark.parametrize("draft", ["self", "other", "other-block-size"])
def test_draft_model_greedy_equals_plain(tiny_dirs, other_draft, draft):
    target = tiny_dirs["llama-gqa"]
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}
    spec["model"] = str(target if draft == "self" else other_draft)
    if draft == "other-block-size":
        spec["draft_options"] = {"block_size": 8}
    engine = _assert_same_as_plain(target, spec)
    draft_kv = engine.speculator.proposer.kv
    draft_kv.check_integrity()
    assert draft_kv.pool.counts()["used"] == 0  # every shadow freed with its request
    if draft == "self":
        assert engine.speculator.stats.acceptance_rate == 1.0


def test_stories_greedy_equals_plain_with_both_proposers(stories_dir):
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play. Once upon a time, there"
    p = SamplingParams(temperature=0.0, max_tokens=120)
    plain = LLM(str(stories_dir), dtype="float32", device="cpu").generate([prompt, "Tom had a"], p, use_tqdm=False)
    for spec in (
        NGRAM,
        {"method": "draft_model", "model": str(stories_dir), "num_speculative_tokens": 4, "adaptive": False},
    ):
        llm = LLM(str(stories_dir), dtype="float32", device="cpu", speculative_config=spec)
        outs = llm.generate([prompt, "Tom had a"], p, use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in plain]
        assert llm.engine.speculator.stats.mean_accepted_length > 1.3


@pytest.fixture(scope="module")
def looping(tiny_dirs):
    """A target whose greedy output repeats, so n-gram runs are accepted several tokens long."""
    llm = LLM(str(tiny_dirs["llama-gqa"]), tokenizer="bytes", dtype="float32", device="cpu", speculative_config=NGRAM)
    plain = LLM(str(tiny_dirs["llama-gqa"]), tokenizer="bytes", dtype="float32", device="cpu")
    return llm, plain


def test_stop_token_and_max_tokens_inside_an_accepted_run(looping):
    llm, plain = looping
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    full = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    tokens = full[0].outputs[0].token_ids
    stop_at = 17
    stop_token = tokens[stop_at]
    first = tokens.index(stop_token)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == tokens[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    for max_tokens in (1, 2, 5, 13):
        out = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
        )
        assert out[0].outputs[0].token_ids == tokens[:max_tokens]
    assert llm.engine.speculator.stats.mean_accepted_length > 1.5
    llm.engine.kv.check_integrity()


def test_stop_string_inside_an_accepted_run(looping):
    llm, plain = looping
    prompt = [70, 71, 72, 73, 70, 71, 72, 73, 70]
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    text = plain.generate([prompt], p, use_tqdm=False)[0].outputs[0].text
    stop = text[9:11]
    expected = plain.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0]
    got = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0]
    assert got.outputs[0].text == expected.outputs[0].text
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids  # tokens after the stop are dropped
    assert got.outputs[0].finish_reason == "stop"


def test_logprobs_of_accepted_tokens_equal_plain(looping):
    llm, plain = looping
    prompt = [9, 10, 11, 9, 10, 11, 9, 10]
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    a = plain.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    before = llm.engine.speculator.stats.num_accepted_tokens
    b = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    assert llm.engine.speculator.stats.num_accepted_tokens > before
    assert b.token_ids == a.token_ids and len(b.logprobs) == len(a.logprobs) == 20
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        for tid in x:
            assert y[tid].logprob == pytest.approx(x[tid].logprob, abs=1e-4)
            assert y[tid].decoded_token == x[tid].decoded_token


def test_rejected_tokens_never_become_prefix_hits(tiny_dirs):
    """Block size 1: every verified position fills a block, so a rejected draft that reached
    the cache would show up as a hit for a prompt ending in it."""
    llm = LLM(
        str(tiny_dirs["llama-gqa"]),
        tokenizer="bytes",
        dtype="float32",
        device="cpu",
        block_size=1,
        speculative_config=NGRAM,
    )
    prompt = [40, 41, 42, 43, 40, 41, 42]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    kv = llm.engine.kv
    accepted = prompt + out.outputs[0].token_ids
    cached = {b.block_hash for b in kv.pool.blocks if b.block_hash is not None}
    from ridge.kv.manager import hash_block

    named, parent = set(), b""
    for token in accepted:
        parent = hash_block(parent, [token])
        named.add(parent)
    assert cached and cached <= named  # every cached block names a prefix of accepted tokens
    assert llm.engine.speculator.stats.num_draft_tokens > llm.engine.speculator.stats.num_accepted_tokens


def test_abort_while_speculating(looping):
    llm, _ = looping
    engine = llm.engine
    rid = engine.add_request(
        None, [20, 21, 22, 20, 21, 22, 20], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )
    other = engine.add_request(None, [30, 31, 30, 31, 30], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    req = engine.scheduler.requests[rid]
    for _ in range(20):
        engine.step()
        if req.spec_token_ids and engine.kv.block_table(req):
            break
    assert req.spec_token_ids  # drafts are pending for the next step
    engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert other not in engine.scheduler.requests
    engine.kv.check_integrity()
    assert engine.kv.pool.counts()["used"] == 0


def test_telemetry_prices_verify_rows_and_draft_passes(tiny_dirs, other_draft):
    llm = LLM(
        str(tiny_dirs["llama-gqa"]),
        tokenizer="bytes",
        dtype="float32",
        device="cpu",
        speculative_config={
            "method": "draft_model",
            "model": str(other_draft),
            "num_speculative_tokens": 3,
            "adaptive": False,
        },
    )
    telemetry = llm.engine.telemetry
    telemetry.reset()
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    verify_steps = [r for r in telemetry.recent if r.verify_chunks]
    assert verify_steps and all(r.phase == "decode" for r in verify_steps)
    rec = verify_steps[0]
    assert rec.tokens == sum(q for q, _ in rec.verify_chunks) == 4  # the newest token and 3 drafts
    assert len(rec.draft_passes) == 3  # the passes that proposed for the next step
    cost = telemetry.price(rec)
    names = [op.name for op in cost.ops]
    assert any(n.startswith("draft ") for n in names) and any(not n.startswith("draft ") for n in names)
    lm_head = next(op for op in cost.ops if op.name == "lm_head")
    assert lm_head.m == 4  # logits at every verified row
