"""``ridge bench serve``: its workload and statistics, and a run against the live server."""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest

from ridge.bench.serve import (
    BenchConfig,
    LengthSpec,
    RequestResult,
    arrival_offsets,
    build_workload,
    load_dataset,
    ordinary_token_ids,
    summarize,
)
from ridge.cli import main


def test_length_spec():
    assert LengthSpec.parse("32") == LengthSpec(32, 32)
    assert LengthSpec.parse("8:512") == LengthSpec(8, 512)
    rng = random.Random(0)
    draws = [LengthSpec(8, 12).sample(rng) for _ in range(200)]
    assert min(draws) == 8 and max(draws) == 12
    for bad in ("0", "5:3", "x", "1:y"):
        with pytest.raises(argparse.ArgumentTypeError):
            LengthSpec.parse(bad)


def test_arrivals():
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    offsets = arrival_offsets(4000, 20.0, 1)
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert offsets[-1] / len(offsets) == pytest.approx(1 / 20, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets(10, 5.0, 3) == arrival_offsets(10, 5.0, 3)


def test_workload_is_seeded_and_exact(tokenizer, tmp_path):
    a = build_workload(10, LengthSpec(4, 9), LengthSpec(8, 512), 7, tokenizer)
    b = build_workload(10, LengthSpec(4, 9), LengthSpec(8, 512), 7, tokenizer)
    assert [(r.prompt, r.max_tokens) for r in a] == [(r.prompt, r.max_tokens) for r in b]
    assert all(4 <= len(r.prompt) == r.prompt_len <= 9 and 8 <= r.max_tokens <= 512 for r in a)
    specials = set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    assert not specials & set(ordinary_token_ids(tokenizer))
    words = build_workload(3, LengthSpec(5, 5), LengthSpec(2, 2), 0)
    assert all(len(r.prompt.split()) == 5 for r in words)
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi there", "max_tokens": 3}\n\n{"prompt": [5, 6], "output_len": 4}\n')
    rows = load_dataset(str(path))
    assert [(r.prompt, r.max_tokens, r.prompt_len) for r in rows] == [("hi there", 3, None), ([5, 6], 4, 2)]
    path.write_text('{"prompt": "", "max_tokens": 3}\n')
    with pytest.raises(ValueError):
        load_dataset(str(path))


def test_summary_statistics():
    results = [
        RequestResult(ok=True, prompt_len=10, output_len=11, ttft=0.1, e2el=1.1, itl=[0.1] * 10),
        RequestResult(ok=True, prompt_len=10, output_len=11, ttft=0.5, e2el=2.5, itl=[0.2] * 10),
        RequestResult(ok=False, error="HTTP 400: no"),
    ]
    s = summarize(results, 2.0, BenchConfig(base_url="http://x", slo_ttft_ms=200, slo_tpot_ms=150))
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 400: no"]
    assert s["total_output_tokens"] == 22 and s["output_throughput"] == 11.0
    assert s["request_throughput"] == 1.0
    assert s["tpot_ms"]["median"] == pytest.approx(150.0)  # (100 ms + 200 ms) / 2
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 400 * 0.99)
    assert s["good_requests"] == 1 and s["goodput"] == 0.5  # the second misses the TTFT SLO


def _bench(capsys, *args) -> dict:
    rc = main(["bench", "serve", *args, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_bench_against_the_running_server(server, capsys):
    s = _bench(
        capsys,
        "--base-url",
        server.base_url,
        "--num-prompts",
        "12",
        "--input-len",
        "8:24",
        "--output-len",
        "16:48",
        "--tokenizer",
        server.config.model_root,
        "--slo-ttft-ms",
        "60000",
        "--slo-tpot-ms",
        "60000",
        "--request-rate",
        "50",
        "--per-request",
    )
    assert s["completed"] == 12 and s["failed"] == 0 and s["model"] == "stories"
    rows = s["requests"]
    assert s["total_output_tokens"] == sum(r["output_len"] for r in rows)
    assert all(16 <= r["output_len"] <= 48 and 8 <= r["prompt_len"] <= 24 for r in rows)  # exact: ids, ignore_eos
    assert 0 < s["duration_s"] < 120
    assert s["request_throughput"] == pytest.approx(12 / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # generous SLOs: everyone is good
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = s[key]
        assert 0 < stats["median"] <= stats["p90"] <= stats["p99"]
    assert s["ttft_ms"]["median"] < s["e2el_ms"]["median"]
    assert s["e2el_ms"]["p99"] < s["duration_s"] * 1000 + 1
    assert max(r["start_s"] for r in rows) > 0  # Poisson arrivals spread the sends
    server.wait_idle()


def test_bench_chat_endpoint_with_text_prompts(server, capsys):
    s = _bench(
        capsys,
        "--base-url",
        server.base_url,
        "--endpoint",
        "chat",
        "--num-prompts",
        "4",
        "--input-len",
        "6",
        "--output-len",
        "10",
    )
    assert s["completed"] == 4 and s["total_output_tokens"] == 40 and s["total_input_tokens"] > 4 * 6
    assert s["goodput"] is None and "requests" not in s


def test_bench_reports_failures(server, capsys):
    rc = main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "2", "--output-len", "600", "--json"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 1 and s["completed"] == 0 and s["failed"] == 2
    assert "context_length_exceeded" in s["errors"][0] or "context length" in s["errors"][0]


def test_bench_needs_one_target(capsys):
    assert main(["bench", "serve", "--num-prompts", "1"]) == 2
    assert "exactly one of --base-url" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_starts_its_own_server(capsys):
    """--model: ridge serve in a subprocess with the engine flags given, stopped afterwards."""
    s = _bench(
        capsys,
        "--model",
        "random:tiny",
        "--max-num-seqs",
        "4",
        "--scheduler",
        "static",
        "--num-threads",
        "1",
        "--num-prompts",
        "6",
        "--input-len",
        "4",
        "--output-len",
        "5",
    )
    assert s["completed"] == 6 and s["total_output_tokens"] == 30
