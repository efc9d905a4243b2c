"""Structured output (``ridge/structured/``, ``ridge/engine/structured.py``): every constrained
output meets its constraint, whatever the sampling, n, prefix hits or preemption; a constraint
that does not compile is a clear error and the engine serves on."""

from __future__ import annotations

import json
import re

import pytest

from ridge import LLM, SamplingParams
from ridge.structured.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "owner": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"id": {"type": "integer"}}}]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def check_schema(text: str) -> dict:
    """Parses, and holds every rule SCHEMA states."""
    value = json.loads(text)
    assert set(value) <= {"name", "age", "pets", "owner"} and {"name", "age"} <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert all(p in ("cat", "dog") for p in value.get("pets", [])) and len(value.get("pets", [])) <= 3
    owner = value.get("owner")
    assert owner is None or (isinstance(owner, dict) and isinstance(owner.get("id", 0), int))
    return value


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), dtype="float32", num_kv_blocks=48, max_num_seqs=8)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=5, n=3),
        dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=2, logprobs=2),
    ],
)
def test_every_json_output_validates(llm, sampling):
    params = SamplingParams(max_tokens=96, structured_outputs={"json": SCHEMA}, **sampling)
    prompts = ["Once upon a time", "The dog", "Lily went to the park and"] * 2  # repeats: prefix hits
    for out in llm.generate(prompts, params, use_tqdm=False):
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            check_schema(c.text)
            if sampling.get("logprobs"):  # the masked distribution: every sampled token allowed
                assert all(lp[t].logprob > float("-inf") for lp, t in zip(c.logprobs, c.token_ids))


def test_the_other_kinds_hold(llm):
    cases = [
        ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        ({"choice": ["happy", "sad", "sleepy cat"]}, lambda t: t in ("happy", "sad", "sleepy cat")),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),  # any object
        (
            {"grammar": 'start: "yes" | "no" " way" | NUM\nNUM: /[1-9][0-9]?/'},
            lambda t: re.fullmatch(r"yes|no way|[1-9][0-9]?", t),
        ),
    ]
    for constraint, holds in cases:
        params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=200, structured_outputs=constraint)
        for c in llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs:
            if c.finish_reason == "length":  # any object may hold a string longer than max_tokens
                assert "json_object" in constraint and c.text.startswith("{"), (constraint, c.text)
                continue
            assert holds(c.text), (constraint, c.text)


def test_preemption_keeps_every_output_valid(stories_dir):
    tight = LLM(str(stories_dir), dtype="float32", num_kv_blocks=14, max_num_seqs=8, block_size=8)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs={"json": SCHEMA})
    outs = tight.generate([f"Tom had {i} apples" for i in range(8)], params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for out in outs:
        check_schema(out.outputs[0].text)


def test_a_random_model_with_the_byte_tokenizer():
    llm = LLM("random:tiny", dtype="float32")
    params = SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=16, structured_outputs={"choice": ["alpha", "β"]})
    for c in llm.generate(["x"], params, use_tqdm=False)[0].outputs:
        assert c.text in ("alpha", "β")


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"regex": "a(b"}, "unclosed group"),
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
        ({"grammar": "start: ("}, "structured_outputs.grammar"),
        ({"choice": []}, "non-empty list"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"colour": 1}, "unknown key"),
    ],
)
def test_a_bad_constraint_is_refused_and_the_engine_serves_on(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert llm.generate(["x"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_params_name_their_constraint():
    p = StructuredOutputsParams(json='{"type": "integer"}')
    assert p.kind == "json" and p.json == {"type": "integer"}
    assert StructuredOutputsParams(choice=["a"]).grammar_spec() == ("choice", '["a"]')
    assert StructuredOutputsParams.parse({"regex": "x+"}).key != StructuredOutputsParams.parse({"regex": "x*"}).key


def test_a_constraint_compiles_once_and_its_masks_are_counted(llm):
    stats = llm.engine.structured.stats
    before = stats.compiles
    params = SamplingParams(max_tokens=8, structured_outputs={"regex": "[q-s]{2,3}"})
    llm.engine.prepare(params)  # what a server does off the engine loop
    llm.engine.prepare(params)
    assert stats.compiles == before + 1  # the second is a cache hit
    steps = stats.mask_steps
    assert llm.generate(["x"], params, use_tqdm=False)[0].outputs[0].text
    assert stats.compiles == before + 1 and stats.mask_steps > steps
    assert llm.engine.stats().structured.mask_s > 0
    decode = llm.engine.telemetry.phases()["decode"]  # each step's mask time is in the telemetry
    assert decode.mask_steps > 0 and 0 < decode.mask_s < decode.wall_s


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_never_changes_what_a_constrained_sequence_outputs(stories_dir, llm, method):
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    else:  # the model drafts for itself: most drafts are the grammar's and the target's choice
        spec["model"] = str(stories_dir)
    fast = LLM(str(stories_dir), dtype="float32", num_kv_blocks=48, max_num_seqs=8, speculative_config=spec)
    prompt = 'The toy said {"name":"Rex","age":3} and {"name":"Tim","age":4} and'  # JSON to look up
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=9, n=2)):
        params = SamplingParams(max_tokens=80, structured_outputs={"json": SCHEMA}, **sampling)
        got = fast.generate([prompt], params, use_tqdm=False)[0].outputs
        for c in got:
            check_schema(c.text)
        if sampling["temperature"] == 0.0:  # greedy: exactly what the unspeculated engine outputs
            assert [c.text for c in got] == [c.text for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert fast.engine.speculator.stats.num_draft_tokens > 0  # it did speculate, within the grammar
