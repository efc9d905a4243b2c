"""``ridge/bench/peers.py``: the comparison's runners answer greedy tokens and time what they say.

ridge's runner against transformers' on the real stories260K model in float32 (the same
weights: the same greedy tokens), and each runner's timings in the shape the comparison reads:
a prefill, then one decode time per token after the first. llama.cpp's runner is exercised by
the GGUF tests where llama-cpp-python is installed (``tests/models/gguf_files.py``).
"""

from __future__ import annotations

import pytest
import torch

from ridge import LLM
from ridge.bench.peers import RidgeRunner, Timed, TransformersRunner

PROMPTS = [[1, 400, 30, 72, 19], [1, 52, 98, 7, 311]]  # equal lengths: transformers' batch takes no padding


@pytest.fixture(scope="module")
def ridge_runner(stories_dir):
    runner = RidgeRunner(LLM(str(stories_dir), dtype="float32", num_kv_blocks=64, seed=0))
    yield runner
    runner.close()


def test_ridge_and_transformers_runners_agree_on_greedy_tokens(stories_dir, ridge_runner):
    ours = ridge_runner.run_batch(PROMPTS, 6)
    theirs = TransformersRunner(stories_dir, torch.float32, static_batch=2).run_batch(PROMPTS, 6)
    for timed in (ours, theirs):
        assert isinstance(timed, Timed)
        assert [len(t) for t in timed.tokens] == [6, 6]
        assert timed.prefill_s > 0 and len(timed.decode_s) == 5 and all(s > 0 for s in timed.decode_s)
    assert ours.tokens == theirs.tokens


def test_a_multi_step_run_times_each_pass(stories_dir, ridge_runner):
    """Under --num-scheduler-steps a step makes several tokens a request: one decode time a
    token still, each an equal share of its step, and the single-step runner's tokens."""
    multi = RidgeRunner(LLM(str(stories_dir), dtype="float32", num_kv_blocks=64, seed=0, num_scheduler_steps=4))
    timed = multi.run_batch(PROMPTS, 11)
    assert len(timed.decode_s) == 10 and all(s > 0 for s in timed.decode_s)
    assert len(set(timed.decode_s[:4])) == 1  # the first run's 4 passes share its time
    assert timed.tokens == ridge_runner.run_batch(PROMPTS, 11).tokens


def test_run_offline_serves_every_request_to_its_length(ridge_runner):
    assert ridge_runner.run_offline([[1, 5, 6], [1, 7], [1, 8, 9, 10]], [3, 1, 4]) > 0
    assert ridge_runner.weight_bytes_per_param == pytest.approx(4.0)  # float32 matrices
