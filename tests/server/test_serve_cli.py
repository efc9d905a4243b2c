"""``ridge serve`` as a user runs it: a subprocess, curl-style requests, Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import pytest

from ridge.bench.serve import free_port
from ridge.cli import build_parser
from tests.serve_process import start_serve, wait_up


def test_serve_flags():
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "m",
            "--max-num-seqs",
            "8",
            "--scheduler",
            "static",
            "--api-key",
            "k",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "256",
        ]
    )
    assert (args.host, args.port, args.api_key, args.served_model_name) == ("127.0.0.1", 8000, "k", ["a", "b"])
    assert (args.max_num_seqs, args.scheduler, args.max_model_len) == (8, "static", 256)


def test_taken_port_is_one_line_and_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "ridge.cli", "serve", "--model", "random:tiny", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen" in lines[0]


@pytest.mark.slow
def test_serve_answers_then_ctrl_c_stops_it_cleanly(stories_dir):
    port = free_port()
    proc = start_serve(str(stories_dir), port, "--max-num-seqs", "4", "--num-threads", "1")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base)
        res = httpx.post(
            f"{base}/v1/completions",
            json={"model": "stories", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0},
            timeout=60,
        )
        assert res.status_code == 200
        assert res.json()["choices"][0]["text"].startswith(", there was a little girl")
        assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 256
        # a stream in flight when Ctrl-C comes: it finishes (graceful), then the server exits
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            timeout=60,
            json={
                "model": "stories",
                "prompt": "Once upon a time",
                "max_tokens": 60,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
        ) as stream:
            lines = stream.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in (0, 130), err
    assert "Traceback" not in err, err
    assert "ridge serve: stories on http://127.0.0.1:" in err
