"""The decode plan against op by op: what a decode step spends outside its matmuls.

Loads each model twice in one process, planned (the default) and with ``enforce_eager``, and
alternates them round by round: greedy decode of ``--tokens`` tokens after a 4-token prompt
at batch ``--batch``. Per engine and round: the median step and the median of each step's
wall time minus the matmul time the telemetry measured (CPU kernels time their matmuls), and
the median of each kind of op the kernels timed (the telemetry's step parts: attention, norms,
rope_kv, ...; matmul_setup and matmul_wait lie within the matmuls' time).
Prints a table and records the run in ``benchmarks/decode_plan.json`` (one entry per model,
weights, KV cache and batch; a rerun replaces its entry).

    python benchmarks/decode_plan.py --model /path/to/model-Q4_K_M.gguf [--kv-cache-dtype int8]
    python benchmarks/decode_plan.py --model random:qwen3-moe-4b --quantization int4
    python benchmarks/decode_plan.py --model random:qwen3-moe-4b --quantization int4 --kernels avx2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from common import cpu_engine_options

from ridge import LLM, SamplingParams
from ridge.roofline.probe import cpu_model

OUT = Path(__file__).with_name("decode_plan.json")


def decode_round(llm: LLM, tokens: int, batch: int) -> tuple[float, float, dict[str, float]]:
    """(median step, median step outside the matmuls, {part: median seconds}) over the decode
    steps."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(None, [10 + i, 11, 12, 13], params)
    walls, outside, parts = [], [], {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        record = engine.telemetry.recent[-1]
        if record.phase == "decode" and record.matmul_s is not None:
            walls.append(wall)
            outside.append(wall - record.matmul_s)
            for part, s in (record.step_parts or {}).items():
                parts.setdefault(part, []).append(s)
    return statistics.median(walls), statistics.median(outside), {p: statistics.median(v) for p, v in parts.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a GGUF file, an HF directory or random:<preset>")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", default="auto", help="auto, or avx2: the AVX2 kernels' plan on an AVX-512 CPU too")
    p.add_argument("--json", type=Path, default=OUT)
    args = p.parse_args()

    options = cpu_engine_options(
        args,
        kv_cache_dtype=args.kv_cache_dtype,
        num_kv_blocks=max(64, args.batch * (args.tokens + 4) // 16 + 8),
        max_num_seqs=max(4, args.batch),
    )
    engines = {"planned": LLM(args.model, **options), "eager": LLM(args.model, enforce_eager=True, **options)}
    for llm in engines.values():  # warm-up: the plan is built, the allocator and pages settle
        decode_round(llm, 8, args.batch)
    planned = engines["planned"].engine.executor.worker.model
    if getattr(planned, "_plan", None) is None:
        print("note: this model runs op by op either way (the plan does not cover it)")
    rounds = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():  # alternated: both see the same machine state
            step_s, outside_s, parts = decode_round(llm, args.tokens, args.batch)
            parts_ms = {part: s * 1e3 for part, s in parts.items()}
            rounds[name].append({"step_ms": step_s * 1e3, "outside_matmul_ms": outside_s * 1e3, "parts_ms": parts_ms})
    print(f"{args.model} (batch {args.batch}, {args.tokens} tokens, kv {args.kv_cache_dtype}), ms per decode step:")
    for name, rows in rounds.items():
        cells = ", ".join(f"{r['step_ms']:.2f} ({r['outside_matmul_ms']:.2f} outside matmuls)" for r in rows)
        print(f"  {name:8s} {cells}")
    for name, rows in rounds.items():
        names = [part for part in rows[0]["parts_ms"] if any(r["parts_ms"].get(part, 0.0) > 0 for r in rows)]
        if names:
            cells = ", ".join(f"{part} {statistics.median(r['parts_ms'][part] for r in rows):.3f}" for part in names)
            print(f"  {name:8s} by part (median ms/step): {cells}")
    speedups = [e["step_ms"] / p["step_ms"] for p, e in zip(rounds["planned"], rounds["eager"])]
    print(f"  planned / eager speed per round: {', '.join(f'{s:.2f}x' for s in speedups)}")
    result = {
        "config": vars(args) | {"json": str(args.json)},
        "machine": {"cpu": cpu_model(), "python": platform.python_version()},
        "measured_at": time.strftime("%Y-%m-%d"),
        "rounds": rounds,
        "speedup_per_round": speedups,
    }
    runs = json.loads(args.json.read_text()) if args.json.is_file() else {}
    runs[run_key(args)] = result
    args.json.write_text(json.dumps(runs, indent=1) + "\n")
    print(f"wrote {args.json}")


def run_key(args) -> str:
    weights = args.quantization or "as loaded"
    key = f"{Path(args.model).name} weights={weights} kv={args.kv_cache_dtype} batch={args.batch}"
    return key if args.kernels == "auto" else f"{key} kernels={args.kernels}"


if __name__ == "__main__":
    main()
