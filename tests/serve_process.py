"""``ridge serve`` as a subprocess that a test talks to: start it, wait until it is healthy."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx


def start_serve(model: str, port: int, *flags: str, env: dict | None = None) -> subprocess.Popen:
    """``python -m ridge.cli serve --model MODEL --port PORT --served-model-name stories ...``,
    its stdout and stderr piped (text)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ridge.cli", "serve", "--model", model, "--port", str(port)]
        + ["--served-model-name", "stories", "--max-model-len", "256", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def wait_up(proc: subprocess.Popen, base: str, timeout_s: float = 120) -> None:
    """Until ``GET /health`` answers 200; fails with the server's stderr if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def start_router(port: int, *flags: str) -> subprocess.Popen:
    """``python -m ridge.cli router --port PORT ...``, its stdout and stderr piped (text)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ridge.cli", "router", "--port", str(port), "--health-interval", "0.5", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(*procs: subprocess.Popen) -> None:
    """SIGINT (as Ctrl-C), then a kill for one that lingers; reaps every process."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(2)
    for proc in procs:
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
