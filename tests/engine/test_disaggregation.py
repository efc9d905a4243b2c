"""Prefill on one engine, decode on another, the KV cache moved between them over gloo
(``engine/disaggregation.py``, ``kv_transfer/``), in one process: the outputs are exactly the
colocated engine's, a shared prefix is not sent twice, and failures end the request clearly."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from ridge.bench.serve import free_port
from ridge.config import EngineConfig
from ridge.engine.engine import LLMEngine
from ridge.kv_transfer.config import KVTransferConfig, KVTransferParams, request_params
from ridge.sampling import SamplingParams

MODEL = "random:tiny"
BASE = dict(dtype="float32", num_kv_blocks=96, block_size=16, seed=0)


def _engine(role: str | None = None, **overrides) -> LLMEngine:
    kv = {"kv_role": role, "kv_port": free_port()} if role else None
    return LLMEngine(EngineConfig(model=MODEL, kv_transfer_config=kv, **{**BASE, **overrides}))


def _pair(producer: LLMEngine, consumer: LLMEngine) -> None:
    """Both sides connect at once (as the router asks them)."""
    errors = []

    def connect():
        try:
            producer.kv_connect(consumer.kv_info())
        except ValueError as exc:
            errors.append(exc)

    thread = threading.Thread(target=connect)
    thread.start()
    try:
        consumer.kv_connect(producer.kv_info())
    finally:
        thread.join()
    if errors:
        raise errors[0]


def _run(engines: list[LLMEngine], request_id: str, target: LLMEngine):
    """Step every engine until ``target``'s request ends; its final output."""
    for _ in range(10_000):
        for engine in engines:
            for out in engine.step():
                if out.request_id == request_id and (out.finished or out.error):
                    return out
    raise AssertionError("the request did not finish")


def _prefill(producer: LLMEngine, transfer_id: str, prompt: list[int], params: SamplingParams) -> KVTransferParams:
    """The producer's leg: the prompt and each sample's first token; what it hands over."""
    first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    producer.add_request(transfer_id, prompt, first, kv_transfer=KVTransferParams(do_remote_decode=True))
    out = _run([producer], transfer_id, producer)
    assert out.finished and out.error is None
    handover = out.kv_handover
    assert set(handover["transfer_ids"]) <= set(producer.scheduler.parked)  # the blocks wait for the consumer
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=producer.engine_id,
        num_prompt_tokens=len(prompt),
        transfer_ids=tuple(handover["transfer_ids"]),
        first_tokens=tuple(c.token_ids[0] for c in out.outputs),
        first_logprobs=tuple(None for _ in out.outputs),
        generator_states=tuple(handover["generator_states"]),
    )


def _decode(producer, consumer, request_id, prompt, params, kv):
    consumer.add_request(request_id, prompt, params, kv_transfer=kv)
    return _run([consumer, producer], request_id, consumer)


def _colocated(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, params)
    return _run([engine], request_id, engine)


def _tokens(out):
    return [c.token_ids for c in out.outputs]


@pytest.fixture(scope="module")
def trio():
    producer, consumer, colocated = _engine("kv_producer"), _engine("kv_consumer"), _engine()
    _pair(producer, consumer)
    yield producer, consumer, colocated
    for engine in (producer, consumer, colocated):
        engine.shutdown()


PROMPTS = {
    "short": list(range(3, 8)),  # inside one block
    "exact": [(7 * i) % 200 + 3 for i in range(48)],  # three whole blocks
    "long": [(11 * i) % 250 + 2 for i in range(87)],
}
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "seeded-n2": SamplingParams(
        temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=10, ignore_eos=True, repetition_penalty=1.2
    ),
}


@pytest.mark.parametrize("prompt_name", sorted(PROMPTS))
@pytest.mark.parametrize("params_name", sorted(PARAMS))
def test_handed_over_requests_give_the_colocated_outputs(trio, prompt_name, params_name):
    producer, consumer, colocated = trio
    prompt, params = PROMPTS[prompt_name], PARAMS[params_name]
    rid = f"{prompt_name}-{params_name}"
    expected = _colocated(colocated, rid, prompt, params)
    kv = _prefill(producer, rid, prompt, params)
    got = _decode(producer, consumer, rid, prompt, params, kv)
    assert got.error is None
    assert _tokens(got) == _tokens(expected)
    assert not producer.scheduler.parked  # the pull released the blocks
    producer.kv.check_integrity()
    consumer.kv.check_integrity()


def test_a_shared_prefix_is_not_sent_again(trio):
    producer, consumer, colocated = trio
    first = [(13 * i) % 240 + 5 for i in range(70)]  # 4 whole blocks, then 6 tokens
    second = first[:64] + [9, 8, 7] * 10  # the same 4 blocks, then 30 new tokens
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    _decode(producer, consumer, "p1", first, params, _prefill(producer, "p1", first, params))
    got = _decode(producer, consumer, "p2", second, params, _prefill(producer, "p2", second, params))
    record = consumer.stats().kv_transfer.recent[-1]
    assert record.request_id == "p2"
    assert record.blocks_skipped == 4  # found in the consumer's prefix cache
    assert record.blocks == 2  # tokens 64 .. 93
    assert record.bytes == 2 * consumer.kv_bytes_per_block
    assert _tokens(got) == _tokens(_colocated(colocated, "p2", second, params))


def test_an_unknown_or_expired_transfer_ends_the_request_with_an_error(trio):
    producer, consumer, _ = trio
    prompt, params = list(range(10, 60)), SamplingParams(max_tokens=4, ignore_eos=True)
    kv = dataclasses.replace(_prefill(producer, "real", prompt, params), transfer_ids=("nope",))
    out = _decode(producer, consumer, "lost", prompt, params, kv)
    assert out.error is not None and "does not hold" in out.error
    kv = _prefill(producer, "late", prompt, params)
    assert producer.kv_transfer.expire(now=time.monotonic() + producer.scheduler.park_timeout) >= 1
    out = _decode(producer, consumer, "late", prompt, params, kv)
    assert out.error is not None and "does not hold" in out.error
    assert not consumer.scheduler.receiving
    consumer.kv.check_integrity()


def test_a_sample_that_ends_on_its_first_token_needs_no_transfer(trio):
    producer, consumer, colocated = trio
    prompt = list(range(20, 70))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    kv = _prefill(producer, "one", prompt, params)
    got = _decode(producer, consumer, "one", prompt, params, kv)
    assert _tokens(got) == _tokens(_colocated(colocated, "one", prompt, params))
    for _ in range(5):  # the consumer's release reaches the producer
        producer.step()
        consumer.step()
    assert "one" not in producer.scheduler.parked
    assert not consumer.has_unfinished_requests()


def test_bad_handover_requests_are_refused_before_anything_changes(trio):
    producer, consumer, _ = trio
    kv = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=producer.engine_id,
        num_prompt_tokens=9,
        transfer_ids=("x",),
        first_tokens=(5,),
        first_logprobs=(None,),
        generator_states=(None,),
    )
    with pytest.raises(ValueError, match="tokenize differently"):
        consumer.add_request("bad1", list(range(5, 15)), SamplingParams(), kv_transfer=kv)
    with pytest.raises(ValueError, match="1 samples for n = 2"):
        consumer.add_request("bad2", list(range(5, 14)), SamplingParams(n=2), kv_transfer=kv)
    with pytest.raises(ValueError, match="lacks the first token's"):
        consumer.add_request("bad3", list(range(5, 14)), SamplingParams(logprobs=2), kv_transfer=kv)
    with pytest.raises(ValueError, match="not a kv_producer"):
        consumer.add_request("bad4", [1, 2, 3], SamplingParams(), kv_transfer=KVTransferParams(do_remote_decode=True))
    with pytest.raises(ValueError, match="not a connected kv_producer"):
        consumer.add_request(
            "bad5", list(range(5, 14)), SamplingParams(), kv_transfer=dataclasses.replace(kv, remote_engine_id="x")
        )
    assert not consumer.has_unfinished_requests() and not producer.has_unfinished_requests()


def test_a_quantized_cache_moves_quantized():
    producer = _engine("kv_producer", kv_cache_dtype="int8")
    consumer = _engine("kv_consumer", kv_cache_dtype="int8")
    colocated = _engine(kv_cache_dtype="int8")
    try:
        _pair(producer, consumer)
        assert producer.kv_info()["layout"]["kv_cache_dtype"] == "int8"
        prompt, params = PROMPTS["long"], PARAMS["greedy"]
        got = _decode(producer, consumer, "q", prompt, params, _prefill(producer, "q", prompt, params))
        assert _tokens(got) == _tokens(_colocated(colocated, "q", prompt, params))
        # codes and scales, one byte a value plus an fp16 scale per token and head
        assert consumer.stats().kv_transfer.bytes == 6 * consumer.kv_bytes_per_block  # 87 tokens
    finally:
        for engine in (producer, consumer, colocated):
            engine.shutdown()


@pytest.mark.parametrize(
    ("consumer_overrides", "message"),
    [
        ({"block_size": 32}, "block size 16"),
        ({"kv_cache_dtype": "fp8"}, "formats must agree"),
        ({"seed": 1}, "another model"),
    ],
)
def test_instances_that_disagree_are_not_paired(consumer_overrides, message):
    producer, consumer = _engine("kv_producer"), _engine("kv_consumer", **consumer_overrides)
    try:
        with pytest.raises(ValueError, match=message):
            _pair(producer, consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_two_producers_are_not_paired(monkeypatch):
    monkeypatch.setenv("RIDGE_KV_CONNECT_TIMEOUT", "2")
    a, b = _engine("kv_producer"), _engine("kv_producer")
    try:
        with pytest.raises(ValueError, match="own role"):
            a.kv_connect(b.kv_info())
    finally:
        a.shutdown()
        b.shutdown()


def test_an_unreachable_peer_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("RIDGE_KV_CONNECT_TIMEOUT", "1")
    consumer = _engine("kv_consumer")
    try:
        peer = {"engine_id": "ridge-gone", "kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": free_port()}
        with pytest.raises(ValueError, match=r"cannot reach the kv_producer at 127\.0\.0\.1:\d+"):
            consumer.kv_connect(peer)
    finally:
        consumer.shutdown()


def test_the_config_and_the_request_params_parse_with_clear_errors():
    assert KVTransferConfig.parse('{"kv_role": "kv_consumer", "kv_port": 14700}').kv_port == 14700
    assert KVTransferConfig.parse({"kv_role": "kv_producer", "kv_rank": 0}).kv_ip == "127.0.0.1"  # vLLM's keys
    assert KVTransferConfig.parse({"kv_role": "kv_consumer", "kv_buffer_device": "cpu"}).kv_buffer_device == "cpu"
    with pytest.raises(ValueError, match="kv_buffer_device must be cuda or cpu"):
        KVTransferConfig.parse({"kv_role": "kv_consumer", "kv_buffer_device": "tpu"})
    for bad, match in [
        ('{"kv_role": "kv_both"}', "kv_role must be one of"),
        ("{", "not valid JSON"),
        ('{"kv_port": 1}', "needs kv_role"),
        ('{"kv_role": "kv_producer", "kv_port": 70000}', "kv_port"),
        ('{"kv_role": "kv_producer", "kv_connector": "NixlConnector"}', "not available"),
        ('{"kv_role": "kv_producer", "colour": 1}', "unknown key"),
    ]:
        with pytest.raises(ValueError, match=match):
            KVTransferConfig.parse(bad)
    assert request_params(None, 1) is None
    assert request_params({"do_remote_decode": True}, 2) == [KVTransferParams(do_remote_decode=True)] * 2
    handover = {"num_prompt_tokens": 3, "transfer_ids": ["a"], "first_tokens": [7], "generator_states": [None]}
    (kv,) = request_params({"do_remote_prefill": True, "remote_engine_id": "e", "prompts": [handover]}, 1)
    assert kv.transfer_ids == ("a",) and kv.first_tokens == (7,) and kv.first_logprobs == (None,)
    with pytest.raises(ValueError, match="hands over 1 prompts for 2"):
        request_params({"do_remote_prefill": True, "remote_engine_id": "e", "prompts": [handover]}, 2)
    with pytest.raises(ValueError, match="n = 2"):
        request_params({"do_remote_prefill": True, "remote_engine_id": "e", "prompts": [handover]}, 1, n=2)


def test_a_producer_of_one_rank_serves_a_pull_while_its_engine_is_busy(trio):
    """Its listener sends the parked blocks at once: the consumer finishes without the producer
    taking a single step (as when the producer is inside a long prefill)."""
    producer, consumer, colocated = trio
    prompt, params = [(17 * i) % 230 + 4 for i in range(60)], PARAMS["greedy"]
    kv = _prefill(producer, "busy", prompt, params)
    consumer.add_request("busy", prompt, params, kv_transfer=kv)
    got = _run([consumer], "busy", consumer)  # the producer does not step
    assert _tokens(got) == _tokens(_colocated(colocated, "busy", prompt, params))
    assert "busy" in producer.scheduler.parked  # freed at its next step, once it learns the blocks were read
    producer.step()
    assert "busy" not in producer.scheduler.parked
    producer.kv.check_integrity()


def test_speculative_decoding_on_the_consumer_keeps_the_outputs(trio):
    producer, _, colocated = trio
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "adaptive": False,
    }
    consumer = _engine("kv_consumer", speculative_config=spec)
    try:
        _pair(producer, consumer)
        prompt = list(range(3, 250))  # every token: the n-gram proposer finds each output token in it
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        got = _decode(producer, consumer, "spec", prompt, params, _prefill(producer, "spec", prompt, params))
        assert _tokens(got) == _tokens(_colocated(colocated, "spec", prompt, params))
        assert consumer.speculator.stats.num_draft_tokens > 0  # it did speculate
    finally:
        consumer.shutdown()


def test_blocks_go_gpu_to_gpu_only_between_two_gpus_that_did_not_ask_to_stage():
    from ridge.kv_transfer.connector import gpu_to_gpu

    a, b = {"gpu": "host/GPU-a", "host_buffer": False}, {"gpu": "host/GPU-b", "host_buffer": False}
    assert gpu_to_gpu(a, b) and gpu_to_gpu(b, a)  # NCCL
    assert not gpu_to_gpu(a, dict(a))  # one GPU for both instances: NCCL refuses the pair
    assert not gpu_to_gpu(a, {"gpu": None, "host_buffer": False})  # a CPU instance
    assert not gpu_to_gpu(a, {**b, "host_buffer": True}) and not gpu_to_gpu({**b, "host_buffer": True}, a)
    assert not gpu_to_gpu({"gpu": None}, {"gpu": None})  # CPU to CPU: gloo
