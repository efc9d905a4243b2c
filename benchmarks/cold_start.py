"""Cold start: time from process start to the first generated token, first and warm runs.

    .venv/bin/python benchmarks/cold_start.py                          # random:tinyllama-1.1b bf16
    .venv/bin/python benchmarks/cold_start.py --model /tmp/stories-1.1b --runs 3

Each run is a fresh ``ridge generate --max-tokens 1`` process; the time is taken when its
first line of output (the prompt and the first token) arrives. The *first* run starts from
nothing cached: a fresh ``RIDGE_CACHE_DIR`` (so the CPU kernels compile, as on a new
machine) and, for a checkpoint directory, its files dropped from the page cache
(``posix_fadvise(DONTNEED)``) so they are read from disk. The warm runs reuse both.
The inflated TinyLlama-shaped checkpoint comes from ``../shared/tools/inflate_stories.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def drop_from_page_cache(directory: Path) -> int:
    """Evict a checkpoint's files from the page cache (no root needed for clean pages)."""
    dropped = 0
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += path.stat().st_size
        finally:
            os.close(fd)
    return dropped


def time_to_first_token(model: str, dtype: str, cache_dir: str, extra: list[str]) -> tuple[float, str]:
    cmd = [
        sys.executable,
        "-m",
        "ridge.cli",
        "generate",
        "--model",
        model,
        "--dtype",
        dtype,
        "--max-tokens",
        "1",
        "--prompt",
        "Once upon a time",
        *extra,
    ]
    env = {**os.environ, "RIDGE_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = proc.stdout.readline()
    elapsed = time.monotonic() - start
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    return elapsed, err


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tinyllama-1.1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=3, help="warm runs after the first")
    p.add_argument("--device", default=None, help="passed to ridge generate (default: auto)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--setup-done",
        action="store_true",
        help="first run with the kernels setup compiled (the default cache): only the checkpoint is cold",
    )
    args = p.parse_args(argv)
    extra = ["--device", args.device] if args.device else []
    with tempfile.TemporaryDirectory(prefix="ridge-cold-") as fresh_cache:
        if args.setup_done:
            from ridge.config import default_cache_dir

            fresh_cache = str(default_cache_dir())
        dropped = 0
        if not args.model.startswith("random:"):
            dropped = drop_from_page_cache(Path(args.model))
        first, first_log = time_to_first_token(args.model, args.dtype, fresh_cache, extra)
        warm = [time_to_first_token(args.model, args.dtype, fresh_cache, extra)[0] for _ in range(args.runs)]
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "first_run_s": round(first, 2),
        "first_run_compiled_kernels": "compiling the CPU kernels" in first_log,
        "first_run_bytes_dropped_from_page_cache": dropped,
        "warm_runs_s": [round(w, 2) for w in warm],
        "warm_median_s": round(statistics.median(warm), 2),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
