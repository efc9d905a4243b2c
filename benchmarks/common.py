"""What several benchmark scripts share (each is run as ``python benchmarks/<script>.py``, whose
folder Python puts on the path, so they import this as ``common``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def cpu_engine_options(args, **options) -> dict:
    """An ``LLM``'s options for a CPU benchmark of one process: bf16 on the CPU, the weights
    ``args.quantization`` gives, ``args.kernels``, ``args.threads`` threads, the bytes tokenizer,
    no prefix cache (each round computes its own tokens), seed 0; ``options`` add or replace."""
    return (
        dict(
            dtype="bfloat16",
            device="cpu",
            quantization=args.quantization,
            kernels=args.kernels,
            tokenizer="bytes",
            num_threads=args.threads,
            enable_prefix_caching=False,
            seed=0,
        )
        | options
    )


def add_kernel_run_args(parser, rounds: int, layers: int, out: Path) -> None:
    """The options of a script that times the CPU kernels alone over layers' weights or pools
    from memory: --rounds, --layers, --threads (2) and --json (``out``)."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--layers", type=int, default=layers, help="layers' weights or pools a pass (from memory)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=out)


def kernel_run_record(args, cpu: str, **fields) -> dict:
    """What such a script records of its run (``add_kernel_run_args``'s options, the CPU, the
    date), then ``fields``."""
    run = {"cpu": cpu, "date": time.strftime("%Y-%m-%d"), "threads": args.threads, "rounds": args.rounds}
    return run | {"layers": args.layers} | fields


def time_alternated(
    names: list[str], rounds: int, prepare: Callable[[str], object], run: Callable[[], object]
) -> dict[str, list[float]]:
    """{name: seconds of ``run()`` after ``prepare(name)`` (untimed), a round each}: every round
    runs every name once, the order rotated each round, so a machine whose speed drifts favours
    none; round 0 warms them all untimed."""
    times = {name: [] for name in names}
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            prepare(name)
            begin = time.perf_counter()
            run()
            if r:
                times[name].append(time.perf_counter() - begin)
    return times


def write_cpu_entry(path: Path, cpu: str, record: dict) -> None:
    """Put ``record`` under ``cpu`` in the JSON file at ``path`` (one entry per CPU: a rerun
    replaces its own CPU's, the others stay) and say so."""
    old = json.loads(path.read_text()) if path.exists() else {}
    old[cpu] = record
    path.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {path}")


def huge_page_fallbacks() -> int | None:
    """How many times the kernel has handed out 4 KiB pages where a region asked for a 2 MiB one
    (``thp_fault_fallback`` in /proc/vmstat, since boot; None where there is none). ridge's CPU
    weights ask for 2 MiB pages (csrc/weight_arena.h); read before and after a load, a rise says
    some of them stream through 4 KiB pages (a TLB miss every 64 lines), so that engine reads
    slow. Why it is asked (stop 96, the 2-core Xeon): in a run of ``compare.py`` over every file,
    with llama.cpp's models loaded beside ridge's in one process, the engine quantized at load to
    int4 decoded at 25.7 ms a step, against 19.1-20.2 in the rerun, in a process of its own and
    beside ridge's engines alone; the system had served 104 such requests with small pages by
    then, and that run did not say which engine's they were."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("thp_fault_fallback "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
