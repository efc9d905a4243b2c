"""``/metrics`` parses as Prometheus text and its counters match what was served."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ridge.engine.stats import EngineStats
from ridge.server.metrics import STATE_SOURCES, Sample, ServerMetrics
from tests.server.conftest import STORIES_NAME


def scrape(http) -> dict[tuple[str, tuple], float]:
    res = http.get("/metrics")
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(res.text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == STORIES_NAME
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
    return samples


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def delta(after, before, name, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_match_what_was_served(server, http, client):
    server.wait_idle()
    before = scrape(http)

    usages = []
    reasons = []
    # 3 completions to their length, one stopped by a stop string, one chat with n=2, one stream
    for prompt in ("Once upon a time", "The cat", "Lily and Ben"):
        r = client.completions.create(
            model=STORIES_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        usages.append(r.usage)
        reasons += [c.finish_reason for c in r.choices]
    r = client.completions.create(
        model=STORIES_NAME, prompt="Once upon a time", max_tokens=40, temperature=0, stop=["Lily"]
    )
    usages.append(r.usage)
    reasons += [c.finish_reason for c in r.choices]
    r = client.chat.completions.create(
        model=STORIES_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=7,
        temperature=0.7,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    usages.append(r.usage)
    reasons += [c.finish_reason for c in r.choices]
    chunks = list(
        client.completions.create(
            model=STORIES_NAME,
            prompt="The dog",
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usages.append(chunks[-1].usage)
    reasons.append([c.choices[0].finish_reason for c in chunks if c.choices][-1])
    assert reasons == ["length"] * 3 + ["stop"] + ["length"] * 3
    assert http.post("/v1/completions", json={"prompt": "", "model": STORIES_NAME}).status_code == 400

    server.wait_idle()
    after = scrape(http)
    requests = 6
    assert delta(after, before, "ridge_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta(after, before, "ridge_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta(after, before, "ridge_request_success_total", finished_reason="length") == 6
    assert delta(after, before, "ridge_request_success_total", finished_reason="stop") == 1
    assert delta(after, before, "ridge_request_success_total", finished_reason="abort") == 0
    for hist in (
        "ridge_time_to_first_token_seconds",
        "ridge_e2e_request_latency_seconds",
        "ridge_request_queue_time_seconds",
    ):
        assert delta(after, before, f"{hist}_count") == requests
        assert delta(after, before, f"{hist}_sum") > 0
        assert value(after, f"{hist}_bucket", le="+Inf") == value(after, f"{hist}_count")
    # one gap per token after the first of each request (the n=2 chat steps both samples at once)
    itl = delta(after, before, "ridge_inter_token_latency_seconds_count")
    stopped_tokens = usages[3].completion_tokens
    assert stopped_tokens > 1
    assert itl == (12 - 1) * 3 + (stopped_tokens - 1) + (7 - 1) + (9 - 1)
    assert delta(after, before, "ridge_engine_step_seconds_count") >= 12
    errors_before = before.get(("ridge_http_errors_total", (("status", "400"),)), 0)
    assert value(after, "ridge_http_errors_total", status="400") - errors_before == 1

    # engine state, read at scrape time: idle now
    assert value(after, "ridge_num_requests_running") == 0
    assert value(after, "ridge_num_requests_waiting") == 0
    assert value(after, "ridge_kv_cache_usage_ratio") == 0
    assert value(after, "ridge_kv_cache_blocks", state="used") == 0
    total = sum(value(after, "ridge_kv_cache_blocks", state=s) for s in ("free", "used", "cached"))
    assert total == server.engine.num_kv_blocks
    assert 0 <= value(after, "ridge_prefix_cache_hit_rate") <= 1
    assert delta(after, before, "ridge_prefix_cache_queries_total") >= sum(u.prompt_tokens for u in usages) - 1
    assert value(after, "ridge_num_preemptions_total") >= 0
    info = [k for k in after if k[0] == "ridge_engine_info"]
    assert dict(info[0][1])["scheduler"] == "continuous"


def test_running_gauges_while_busy(server, http):
    import threading

    import httpx

    server.wait_idle()
    body = {
        "model": STORIES_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    seen = {}

    def stream():
        with (
            httpx.Client(base_url=server.base_url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if line and not seen:
                    s = scrape(http)
                    seen.update(
                        running=value(s, "ridge_num_requests_running"), usage=value(s, "ridge_kv_cache_usage_ratio")
                    )
                    break

    t = threading.Thread(target=stream)
    t.start()
    t.join(60)
    assert seen["running"] == 1 and seen["usage"] > 0
    server.wait_idle()


def test_state_sources_are_pluggable():
    """The roofline telemetry hook: an extra source's samples appear at the next publish."""

    def telemetry(stats):
        return [
            Sample(
                "ridge_achieved_bandwidth_bytes_per_second", "Achieved bandwidth.", 1.5e9, labels={"phase": "decode"}
            )
        ]

    metrics = ServerMetrics("m", state_sources=(telemetry,))
    metrics.publish_state(metrics.read_state(EngineStats()))
    text = metrics.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["ridge_achieved_bandwidth_bytes_per_second"].samples
    assert sample.labels == {"model_name": "m", "phase": "decode"} and sample.value == pytest.approx(1.5e9)
    assert STATE_SOURCES  # the defaults stay available to extend


def test_roofline_telemetry_per_phase(server, http, client):
    """The steps' achieved rates come from the analyzer; the fraction appears once the roofline is known."""
    from ridge.roofline.hardware import resolve_hardware

    client.completions.create(
        model=STORIES_NAME, prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    samples = scrape(http)
    assert value(samples, "ridge_steps_total", phase="decode") >= 7
    assert value(samples, "ridge_step_achieved_bandwidth_bytes_per_second", phase="decode") > 0
    assert value(samples, "ridge_step_achieved_flops_per_second", phase="decode") > 0
    fraction = ("ridge_step_outside_matmul_fraction", (("phase", "decode"),))
    if torch.cuda.is_available():  # the GPU's matmuls are not timed one by one (graphs): a CPU figure only
        assert fraction not in samples
    else:
        assert 0 < value(samples, fraction[0], phase="decode") < 1  # CPU: measured
    # the ops the CPU kernels timed, by kind (none timed: no part)
    parts = {dict(labels)["part"]: v for (name, labels), v in samples.items() if name == "ridge_step_part_fraction"}
    assert all(0 <= v < 1 for v in parts.values())
    assert not parts or {"attention", "norms", "matmul_setup", "matmul_wait"} <= parts.keys()
    telemetry = server.engine.telemetry  # the test's own engine object, not the server's view
    if not telemetry.hardware_resolved:  # as `ridge serve` does at start-up; a preset keeps the test fast
        telemetry._hardware = resolve_hardware("h100-sxm")
    client.completions.create(
        model=STORIES_NAME, prompt="The cat", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    fraction = value(scrape(http), "ridge_step_roofline_fraction", phase="decode")
    assert 0 < fraction < 1
