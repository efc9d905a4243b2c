"""``ridge router`` over ``ridge serve`` instances in separate processes, as a user runs them:
prefill on a kv_producer, decode on a kv_consumer, the KV cache moved over gloo; the
``openai`` client gets exactly the colocated outputs; instances killed mid-stream give clean
errors and leave the rotation; bad configurations are one clear line."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ridge.bench.serve import free_port

from ..serve_process import start_router, start_serve, stop, wait_up


def _role(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_role": role, "kv_port": free_port()})]


def _start(model, role: str | None, *flags: str):
    port = free_port()
    kv = _role(role) if role else ()
    # an unreachable peer is reported after the connect timeout: short here
    env = {"RIDGE_KV_CONNECT_TIMEOUT": "3"}
    proc = start_serve(model, port, "--dtype", "float32", "--log-level", "warning", *kv, *flags, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def cluster(stories_dir):
    """A prefill, a decode and a colocated instance, and a router over the first two."""
    procs = []
    try:
        prefill, p_url = _start(stories_dir, "kv_producer")
        decode, d_url = _start(stories_dir, "kv_consumer")
        colocated, c_url = _start(stories_dir, None)
        procs += [prefill, decode, colocated]
        r_port = free_port()
        router = start_router(r_port, "--prefill", p_url, "--decode", d_url)
        procs.append(router)
        r_url = f"http://127.0.0.1:{r_port}"
        for proc, url in [(prefill, p_url), (decode, d_url), (colocated, c_url), (router, r_url)]:
            wait_up(proc, url)
        yield {"router": r_url, "prefill": p_url, "decode": d_url, "colocated": c_url}
    finally:
        stop(*procs)


PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside with her friends."


def _client(base: str):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def test_sixteen_streams_through_the_router_match_the_colocated_outputs(cluster):
    router, colocated = _client(cluster["router"]), _client(cluster["colocated"])

    def completion(client, i):
        kw = dict(model="stories", prompt=f"{PROMPT} Then {i}", max_tokens=24, stream=True)
        kw.update(temperature=0) if i % 2 else kw.update(temperature=0.9, seed=i, top_p=0.95)
        return "".join(c.choices[0].text for c in client.completions.create(**kw))

    def chat(client, i):
        kw = dict(model="stories", messages=[{"role": "user", "content": f"{PROMPT} {i}"}], max_tokens=16, stream=True)
        kw.update(temperature=0) if i % 2 else kw.update(temperature=0.8, seed=i)
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw) if c.choices)

    jobs = [(completion if i % 4 < 2 else chat, i) for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda job: job[0](router, job[1]), jobs))
    expected = [fn(colocated, i) for fn, i in jobs]
    assert got == expected
    assert all(got)
    assert _metric(cluster["decode"], "ridge_kv_transfer_transfers_total") >= 16

    # not streamed: n > 1, logprobs, usage, exactly as the colocated instance answers
    kw = dict(model="stories", prompt=PROMPT, max_tokens=12, n=3, temperature=0.9, seed=11, logprobs=2)
    a, b = router.completions.create(**kw), colocated.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.logprobs.tokens for c in a.choices] == [c.logprobs.tokens for c in b.choices]
    assert a.usage == b.usage
    kw = dict(model="stories", messages=[{"role": "user", "content": PROMPT}], max_tokens=10, temperature=0)
    a, b = router.chat.completions.create(**kw), colocated.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage == b.usage


def test_a_shared_prefix_moves_only_its_new_blocks(cluster):
    router = _client(cluster["router"])
    base = PROMPT * 3  # ~70 tokens: several whole blocks
    router.completions.create(model="stories", prompt=base + " First.", max_tokens=2, temperature=0)
    skipped = _metric(cluster["decode"], "ridge_kv_transfer_blocks_skipped_total")
    blocks = _metric(cluster["decode"], "ridge_kv_transfer_blocks_total")
    router.completions.create(model="stories", prompt=base + " Second, and a longer end.", max_tokens=2, temperature=0)
    assert _metric(cluster["decode"], "ridge_kv_transfer_blocks_skipped_total") - skipped >= 3
    assert _metric(cluster["decode"], "ridge_kv_transfer_blocks_total") - blocks <= 2


def test_the_router_reports_each_instance(cluster):
    time.sleep(1.2)  # a health round reads the instances' transfer counters
    text = httpx.get(f"{cluster['router']}/metrics", timeout=10).text
    d = cluster["decode"]
    assert f'ridge_router_instance_healthy{{instance="{d}",role="decode"}} 1.0' in text
    assert _metric(cluster["router"], f'ridge_router_requests_total{{instance="{d}"') > 0
    assert _metric(cluster["router"], f'ridge_router_kv_bytes_total{{instance="{d}"') > 0
    assert "ridge_router_prefill_seconds_bucket" in text
    info = httpx.get(f"{cluster['prefill']}/kv/info", timeout=10).json()
    assert info["kv_role"] == "kv_producer" and info["peers"]


def test_kv_connect_to_an_unreachable_peer_is_a_clear_400(cluster, monkeypatch):
    peer = {"engine_id": "ridge-gone", "kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": free_port()}
    resp = httpx.post(f"{cluster['decode']}/kv/connect", json=peer, timeout=60)
    assert resp.status_code == 400
    assert "cannot reach the kv_producer at 127.0.0.1" in resp.json()["error"]["message"]


def _stream(base: str, prompt: str, results: list, started: threading.Event) -> None:
    try:
        pieces = []
        for chunk in _client(base).completions.create(
            model="stories", prompt=prompt, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
        ):
            pieces.append(chunk.choices[0].text)
            started.set()
        results.append(("ok", "".join(pieces)))
    except Exception as exc:  # what the client sees
        results.append(("error", str(exc)))


def test_killed_instances_give_clean_errors_and_leave_the_rotation(stories_dir):
    procs = []
    try:
        p1, p1_url = _start(stories_dir, "kv_producer", "--max-model-len", "512")
        p2, p2_url = _start(stories_dir, "kv_producer", "--max-model-len", "512")
        # one sequence at a time: a decode instance's streams are still running when it dies
        slow = ("--max-num-seqs", "1", "--max-model-len", "512")
        d1, d1_url = _start(stories_dir, "kv_consumer", *slow)
        d2, d2_url = _start(stories_dir, "kv_consumer", *slow)
        procs += [p1, p2, d1, d2]
        r_port, bad_port = free_port(), free_port()
        router = start_router(r_port, "--prefill", p1_url, p2_url, "--decode", d1_url, d2_url)
        bad = start_router(bad_port, "--prefill", p1_url, "--decode", p2_url)  # two producers
        procs += [router, bad]
        r_url = f"http://127.0.0.1:{r_port}"
        for proc, url in [(p1, p1_url), (p2, p2_url), (d1, d1_url), (d2, d2_url), (router, r_url)]:
            wait_up(proc, url)
        # the router's /health is up with one instance of each role: wait until its health loop
        # has every instance in rotation, or all the streams below could go to one decode instance
        roles = [(p1_url, "prefill"), (p2_url, "prefill"), (d1_url, "decode"), (d2_url, "decode")]
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"{r_url}/metrics", timeout=10).text
            if all(f'ridge_router_instance_healthy{{instance="{u}",role="{r}"}} 1.0' in text for u, r in roles):
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)

        # a pairing that cannot be: one clear line, 502
        wait_up(bad, f"http://127.0.0.1:{bad_port}", timeout_s=30)
        resp = httpx.post(
            f"http://127.0.0.1:{bad_port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60
        )
        assert resp.status_code in (502, 503)
        assert "own role" in resp.text or "no healthy decode" in resp.text

        # a decode instance dies mid-stream: its clients get an error, the other's finish
        results: list = []
        started = threading.Event()
        threads = [
            threading.Thread(target=_stream, args=(r_url, f"Once upon a time {i}", results, started)) for i in range(12)
        ]
        for t in threads:
            t.start()
        assert started.wait(60)
        deadline = time.monotonic() + 30
        while _metric(d1_url, "ridge_num_requests_running") < 1:  # one of its streams is running
            assert time.monotonic() < deadline, httpx.get(f"{r_url}/metrics", timeout=10).text
            time.sleep(0.02)
        d1.kill()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hung"
        errors = [r for kind, r in results if kind == "error"]
        done = [r for kind, r in results if kind == "ok"]
        assert errors and done, results
        assert all("decode instance" in e and d1_url in e for e in errors), errors
        time.sleep(1.0)
        text = httpx.get(f"{r_url}/metrics", timeout=10).text
        assert f'ridge_router_instance_healthy{{instance="{d1_url}",role="decode"}} 0.0' in text
        client = _client(r_url)
        for i in range(4):  # routed to the live decode instance only
            assert client.completions.create(model="stories", prompt=f"Lily {i}", max_tokens=4).choices[0].text

        # a prefill instance dies: the router stops sending it prompts; requests go on
        p1.kill()
        outcomes = []
        for i in range(6):
            try:
                outcomes.append(
                    client.completions.create(model="stories", prompt=f"Tom {i}", max_tokens=4).choices[0].text
                )
            except Exception as exc:
                outcomes.append(exc)
        assert all(isinstance(o, str) for o in outcomes), outcomes
        time.sleep(1.0)
        text = httpx.get(f"{r_url}/metrics", timeout=10).text
        assert f'ridge_router_instance_healthy{{instance="{p1_url}",role="prefill"}} 0.0' in text
    finally:
        stop(*procs)


def test_bad_flags_are_one_clear_line(stories_dir):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "ridge.cli", *args], capture_output=True, text=True, timeout=120)

    out = run("serve", "--model", str(stories_dir), "--kv-transfer-config", '{"kv_role": "kv_both"}')
    assert out.returncode == 2 and "kv_role must be one of kv_producer, kv_consumer" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = run("router", "--port", str(free_port()), "--prefill", "http://127.0.0.1:1")
    assert out.returncode == 2 and "needs --prefill and --decode" in out.stderr
    out = run("router", "--port", str(free_port()), "--replica", "localhost:8000")
    assert out.returncode == 2 and "http(s) URL" in out.stderr


def test_tensor_parallel_instances_on_both_sides(stories_dir):
    """Each rank of the producer sends its KV heads to the consumer's rank of the same number."""
    procs = []
    try:
        tp = ("--tensor-parallel-size", "2", "--device", "cpu")  # ranks on the CPU, also on a one-GPU machine
        prefill, p_url = _start(stories_dir, "kv_producer", *tp)
        decode, d_url = _start(stories_dir, "kv_consumer", *tp)
        colocated, c_url = _start(stories_dir, None, "--device", "cpu")
        r_port = free_port()
        router = start_router(r_port, "--prefill", p_url, "--decode", d_url)
        procs += [prefill, decode, colocated, router]
        r_url = f"http://127.0.0.1:{r_port}"
        for proc, url in [(prefill, p_url), (decode, d_url), (colocated, c_url), (router, r_url)]:
            wait_up(proc, url)
        layout = httpx.get(f"{d_url}/kv/info", timeout=10).json()["layout"]
        assert layout["tensor_parallel_size"] == 2 and layout["num_heads"] == 2  # its half of 4 KV heads
        for kw in (
            dict(prompt=PROMPT * 2, max_tokens=20, temperature=0),
            dict(prompt=PROMPT, max_tokens=16, temperature=0.8, seed=3, n=2),
        ):
            a = _client(r_url).completions.create(model="stories", **kw)
            b = _client(c_url).completions.create(model="stories", **kw)
            assert [c.text for c in a.choices] == [c.text for c in b.choices]
        assert _metric(d_url, "ridge_kv_transfer_transfers_total") == 3  # 1, then 2 samples (the 2nd: its tail)
    finally:
        stop(*procs)
