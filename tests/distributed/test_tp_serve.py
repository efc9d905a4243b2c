"""``ridge serve --tensor-parallel-size 2`` as a user runs it (a subprocess that starts its own
second rank), a rank killed mid-stream, and bad configurations: one clear line each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ridge import LLM, SamplingParams
from ridge.bench.serve import free_port, ridge_server

from ..models.hf_tiny import COMMON, VARIANTS, build
from ..serve_process import start_serve, wait_up

# ranks on the CPU over gloo, also on a GPU machine (one GPU cannot hold two ranks)
CPU_TP = ("--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2")


def _serve(model: str, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return start_serve(model, port, *CPU_TP, *extra, env=env)


def _rank_processes(pid: int) -> list[int]:
    """The server's spawned ranks (children running multiprocessing's spawn entry)."""
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            out.append(int(child))
    return out


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.communicate()


def test_serve_tp2_answers_the_openai_client(stories_dir):
    import openai

    expected = (
        LLM(str(stories_dir), dtype="float32", device="cpu")
        .generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    flags = ["--served-model-name", "stories", *CPU_TP]
    with ridge_server(str(stories_dir), flags, timeout_s=120) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        res = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=16, temperature=0)
        assert res.choices[0].text == expected  # the single-process text
        text = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="stories", prompt="Once upon a time", max_tokens=16, temperature=0, stream=True
            )
        )
        assert text == expected
        res = client.completions.create(
            model="stories", prompt="The cat", max_tokens=8, n=2, temperature=0.8, seed=1, logprobs=2
        )
        assert len(res.choices) == 2
        assert all(len(c.logprobs.top_logprobs) == len(c.logprobs.tokens) for c in res.choices)
        chat = client.chat.completions.create(
            model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'tensor_parallel_size="2"' in metrics


def test_a_rank_killed_mid_stream_fails_cleanly_and_the_server_exits(stories_dir):
    port = free_port()
    proc = _serve(str(stories_dir), port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base)
        (rank,) = _rank_processes(proc.pid)
        body = {
            "model": "stories",
            "prompt": "Once upon a time",
            "max_tokens": 240,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        start = time.monotonic()
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(rank, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])["error"]
        assert "rank" in error["message"]
        assert time.monotonic() - start < 20  # an error within seconds, never a hang
        try:  # new requests: 503 until the server is gone
            res = httpx.post(f"{base}/v1/completions", json={**body, "stream": False}, timeout=10)
            assert res.status_code == 503
        except httpx.TransportError:
            pass  # already exiting
        proc.wait(timeout=30)
    finally:
        out, err = _stop(proc)
    assert proc.returncode == 1, err
    assert "the engine failed" in err


@pytest.fixture(scope="module")
def three_heads(tmp_path_factory) -> Path:
    """A model whose 3 attention heads cannot be split over 2 ranks."""
    directory = tmp_path_factory.mktemp("three-heads")
    config_cls, model_cls, _ = VARIANTS["llama-gqa"]
    config = config_cls(**{**COMMON, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1})
    model_cls(config).save_pretrained(directory)
    return directory


def _generate(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ridge.cli", "generate", "--prompt", "hi", "--max-tokens", "2", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _one_error_line(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ridge generate: error:"), res.stderr
    for needle in needles:
        assert needle in last, last


def test_heads_that_do_not_divide(three_heads):
    res = _generate("--model", str(three_heads), "--tokenizer", "bytes", "--device", "cpu", "-tp", "2")
    _one_error_line(res, "cannot be split over 2 ranks", "attention heads (3)")


def test_more_ranks_than_cores():
    res = _generate("--model", "random:tiny", "--device", "cpu", "-tp", str((os.cpu_count() or 1) + 1))
    _one_error_line(res, "larger than the", "CPU cores")


def test_an_unreachable_master(tiny_model):
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),  # nobody listens there
        "RIDGE_TP_CONNECT_TIMEOUT": "3",
    }
    start = time.monotonic()
    res = _generate("--model", str(tiny_model), "--tokenizer", "bytes", "--device", "cpu", "-tp", "2", env=env)
    _one_error_line(res, "cannot reach the master at 127.0.0.1:")
    assert time.monotonic() - start < 60


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    build("llama-gqa", directory, seed=1)
    return directory


def test_a_hung_rank_ends_the_engine_at_the_collective_timeout(stories_dir):
    """A rank stopped while the server is idle (it never takes the next plan) or mid-step: the
    request fails at the 3 s timeout, never a hang, and the server exits."""
    port = free_port()
    proc = _serve(str(stories_dir), port, env={"RIDGE_TP_TIMEOUT": "3"})
    base = f"http://127.0.0.1:{port}"
    rank = None
    try:
        wait_up(proc, base)
        (rank,) = _rank_processes(proc.pid)
        os.kill(rank, signal.SIGSTOP)  # alive, but never answers again
        body = {"model": "stories", "prompt": "Once", "max_tokens": 40, "temperature": 0, "stream": True}
        start = time.monotonic()
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as stream:
            lines = [line for line in stream.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and "rank" in json.loads(lines[-2][len("data: ") :])["error"]["message"]
        assert time.monotonic() - start < 30  # the 3 s timeout, not a hang
        proc.wait(timeout=30)
    finally:
        if rank is not None:
            try:
                os.kill(rank, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = _stop(proc)
    assert proc.returncode == 1, err


def test_torchrun_starts_one_ridge_per_rank(stories_dir):
    """Rank 0 runs the engine and prints; rank 1 serves as a worker and leaves when it ends."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.is_file():
        pytest.skip("torchrun is not beside this python")
    args = ["--model", str(stories_dir), "--device", "cpu", "--prompt", "Once upon a time", "--max-tokens", "20"]
    single = subprocess.run(
        [sys.executable, "-m", "ridge.cli", "generate", *args], capture_output=True, text=True, timeout=120
    )
    res = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "ridge.cli",
            "generate",
            *args,
            "--tensor-parallel-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert single.returncode == 0 and single.stdout.strip()
    assert res.stdout.strip() == single.stdout.strip()  # one output (rank 0's), the single-process text
