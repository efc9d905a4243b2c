"""A real ridge server on a free loopback port, run by uvicorn in a background thread.

``RunningServer`` binds port 0 (the OS picks a free port, no race), serves the app built by
``build_app`` and stops it (uvicorn's shutdown, then the engine loop) on ``stop()``. Test
modules build one per module (module-scoped fixtures) so the suite stays fast.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
import uvicorn

from ridge.config import EngineConfig
from ridge.engine.engine import LLMEngine
from ridge.server.app import build_app
from ridge.server.cli import bind_socket
from ridge.server.serving import ServerConfig

STORIES_NAME = "stories"


class RunningServer:
    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.app = build_app(engine, config)
        self.state = self.app.state.ridge
        self._sock = bind_socket("127.0.0.1", 0)
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="uvicorn-test", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def url(self, path: str = "") -> str:
        return self.base_url + path

    def pool_state(self, timeout: float = 10.0) -> dict:
        """The engine's stats, taken on the engine thread between steps."""
        stats = self.state.engine.stats_threadsafe().result(timeout)
        return {
            **stats.kv_blocks,
            "unfinished": stats.num_unfinished_requests,
            "running": stats.num_running,
            "waiting": stats.num_waiting,
        }

    def wait_idle(self, timeout: float = 15.0) -> dict:
        """Poll until no request is left and no KV block is held; returns the pool counts."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.pool_state()
            if state["unfinished"] == 0 and state["used"] == 0:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not go idle within {timeout} s: {state}")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()
        assert not self._thread.is_alive(), "uvicorn did not stop"
        assert not self.state.engine.is_alive, "the engine loop did not stop"
        self.engine.kv.check_integrity()  # the loop is gone: the engine is this thread's now


# One torch thread: the tests check behaviour, not speed, and on a shared 2-core machine two
# OpenMP threads next to a busy neighbour can make a tiny model's step 100x slower.
TEST_THREADS = 1


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    """The engine sets torch's (process-wide) thread count; give the rest of the suite its own back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def stories_engine(stories_dir, **options) -> LLMEngine:
    opts = {"dtype": "float32", "max_num_seqs": 32, "seed": 0, "num_threads": TEST_THREADS, **options}
    return LLMEngine(EngineConfig.from_kwargs(str(stories_dir), **opts))


@pytest.fixture(scope="module")
def server(stories_dir):
    srv = RunningServer(
        stories_engine(stories_dir), ServerConfig((STORIES_NAME, "stories260K"), model_root=str(stories_dir))
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.engine.tokenizer
