"""``ridge analyze --disaggregated``: what moving the KV cache costs and what separating
prefill from decode buys, on the roofline."""

from __future__ import annotations

import json

import pytest

from ridge.cli import main as ridge_main
from ridge.roofline import ops
from ridge.roofline.analyze import Workload
from ridge.roofline.disaggregation import ServingPattern, analyze_disaggregation, transfer_time_s
from ridge.roofline.hardware import resolve_hardware
from ridge.roofline.ops import Link, Precision
from ridge.roofline.shapes import load_model_shape

LINK = Link("test link", 10e9, 50e-6, "given")


def _analysis(**pattern):
    model = load_model_shape("tinyllama-1.1b")
    hardware = resolve_hardware("h100-sxm")
    return model, analyze_disaggregation(model, hardware, ServingPattern(**pattern), LINK, Workload())


def test_the_kv_bytes_and_their_transfer_follow_from_the_model_and_the_link():
    model, result = _analysis(prompt_tokens=1024)
    per_token = ops.kv_bytes_per_token(model, Precision().kv_bytes)
    assert result.kv_bytes == pytest.approx(1024 * per_token)  # 22 layers x 2 x 4 heads x 64 x 2 bytes
    assert per_token == 22 * 2 * 4 * 64 * 2
    assert result.transfer_s == pytest.approx(50e-6 + result.kv_bytes / 10e9)
    assert transfer_time_s(0, LINK) == pytest.approx(50e-6)


def test_a_long_prefill_stalls_colocated_decodes_but_not_disaggregated_ones():
    _, result = _analysis(prompt_tokens=8192, arrival_interval_s=0.05, decode_streams=8, chunk_tokens=8200)
    # colocated: the step that carries the prompt is the p99 inter-token latency
    assert result.colocated.itl_p99_s == pytest.approx(result.t_mixed_s)
    assert result.t_mixed_s > 5 * result.t_decode_full_s
    # disaggregated: decode steps alone (on half the machine), plus a transfer's copy now and then
    assert result.disaggregated.itl_p99_s < result.colocated.itl_p99_s
    assert result.p99_itl_ratio > 3
    # the prompt's first token waits for its prefill, the transfer and one decode step
    assert result.disaggregated.ttft_s > result.t_prefill_share_s + result.transfer_s


def test_small_chunks_soften_the_stall():
    _, whole = _analysis(prompt_tokens=4096, chunk_tokens=4104)
    _, chunked = _analysis(prompt_tokens=4096, chunk_tokens=264)
    assert chunked.num_chunks == 16 and whole.num_chunks == 1
    assert chunked.t_mixed_s < whole.t_mixed_s  # the longest stall shrinks (more steps pay a little)


def test_bad_patterns_are_refused():
    with pytest.raises(ValueError, match="prefill_share"):
        ServingPattern(prefill_share=1.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        ServingPattern(decode_streams=8, chunk_tokens=8)


def test_the_cli_prints_json(capsys):
    argv = ["analyze", "--model", "tinyllama-1.1b", "--hardware", "h100-sxm", "--disaggregated"]
    assert ridge_main([*argv, "--prompt-len", "1024", "--link", "ethernet-100g", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes"] == pytest.approx(1024 * 22 * 2 * 4 * 64 * 2)
    assert out["link"]["name"].startswith("100 Gb/s Ethernet")
    assert {"colocated", "disaggregated", "p99_itl_ratio", "transfer_s"} <= set(out)
    assert ridge_main([*argv, "--link", "25:20"]) == 0
    assert "p99 ITL colocated / disaggregated" in capsys.readouterr().out
