"""The ridge command line, run as a user would (a subprocess)."""

from __future__ import annotations

import subprocess
import sys


def ridge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ridge.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_on_stories(stories_dir):
    res = ridge("generate", "--model", str(stories_dir), "--prompt", "Once upon a time", "--max-tokens", "20")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Once upon a time, there was a little girl named Lily.")


def test_generate_in_runs_of_passes_says_the_same(stories_dir):
    """--num-scheduler-steps: the same text, the scheduler's runs of several passes."""
    args = ("generate", "--model", str(stories_dir), "--prompt", "Once upon a time", "--max-tokens", "20")
    res = ridge(*args, "--num-scheduler-steps", "4")
    assert res.returncode == 0, res.stderr
    assert res.stdout == ridge(*args).stdout
    bad = ridge(*args, "--num-scheduler-steps", "0")
    assert bad.returncode == 2 and "num_scheduler_steps must be a positive integer" in bad.stderr


def test_demo_runs_and_summarizes():
    res = ridge("demo", "--num-requests", "6")
    assert res.returncode == 0, res.stderr
    for needle in ("summary", "time to first token", "time per out token", "generated tok/s"):
        assert needle in res.stdout


def test_bad_model_path_is_one_line_and_exit_2(tmp_path):
    res = ridge("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0]


def test_invalid_sampling_value_exit_2():
    res = ridge("generate", "--model", "random:tiny", "--prompt", "hi", "--top-p", "1.5")
    assert res.returncode == 2 and "top_p" in res.stderr


def test_undecodable_prompt_bytes_are_one_line_and_exit_2(stories_dir):
    """printf 'Once \\xff upon': the shell hands over a byte that is not UTF-8 (it was a traceback)."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ridge.cli",
            "generate",
            "--model",
            str(stories_dir),
            "--prompt",
            b"Once \xff upon",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        timeout=300,
    )
    assert res.returncode == 2
    # besides the start-up log ("ridge: ..." lines), the error is one line
    lines = [line for line in res.stderr.decode().strip().splitlines() if not line.startswith("ridge: ")]
    assert len(lines) == 1 and "0xff" in lines[0] and "not valid UTF-8" in lines[0], lines


def test_max_model_len_beyond_the_model_is_refused(stories_dir):
    res = ridge("generate", "--model", str(stories_dir), "--prompt", "hi", "--max-model-len", "100000")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_position_embeddings 512" in lines[0], lines


def test_logprob_tokens_keep_their_spaces(stories_dir):
    res = ridge(
        "generate", "--model", str(stories_dir), "--prompt", "Once upon a time", "--max-tokens", "4", "--logprobs", "1"
    )
    assert res.returncode == 0, res.stderr
    assert "' there'" in res.stdout, res.stdout
