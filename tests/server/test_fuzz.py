"""A robustness campaign that keeps running: schemathesis against the server's own
``/openapi.json``. Every endpoint gets a bounded number of generated requests, valid and
invalid; any 5xx, or a reply that breaks the schema the server publishes, fails. Afterwards
the engine must be idle with every KV block back in the pool.

Derandomized in CI (the Hypothesis profile in ``tests/conftest.py``), a fresh random search
locally.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ridge.server.serving import ServerConfig
from tests.server.conftest import STORIES_NAME, RunningServer, stories_engine

EXAMPLES_PER_OPERATION = 30
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def fuzz_server(stories_dir):
    # A short context bounds what any generated request can cost (n up to 128, max_tokens
    # anything); a small body limit lets the fuzzer reach the 413 path.
    srv = RunningServer(
        stories_engine(stories_dir, max_model_len=48, max_num_seqs=16),
        ServerConfig((STORIES_NAME,), max_request_bytes=64 * 1024),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url("/openapi.json"))


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx_or_breaks_the_schema(case, fuzz_server):
    case.call_and_validate(base_url=fuzz_server.base_url, checks=CHECKS, timeout=60)


def test_the_engine_is_whole_after_the_campaign(fuzz_server):
    state = fuzz_server.wait_idle(timeout=60)
    assert state["used"] == 0 and state["unfinished"] == 0
