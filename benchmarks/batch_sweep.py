"""Decode throughput versus batch size, measured by ridge and predicted by its analyzer.

For each batch size the engine decodes ``--output-len`` tokens per sequence (bf16 random
TinyLlama-shaped model by default); the analyzer prices the same steps on this machine's
roofline (bandwidth probed in the same round, peak from the local probe), so the two curves
can be compared point by point, knee included. Writes a table, JSON and a PNG.

    python benchmarks/batch_sweep.py --batches 1,2,4,8,16,32,64 --png benchmarks/batch_sweep.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ridge import LLM
from ridge.bench.latency import bench_latency
from ridge.telemetry import StepRecord


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tinyllama-1.1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/batch_sweep.json"))
    parser.add_argument("--png", type=Path, default=Path("benchmarks/batch_sweep.png"))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_kv_blocks=max(batches) * (args.input_len + args.output_len) // 16 + 64,
        max_num_seqs=max(batches),
        num_threads=args.threads,
    )
    rows = []
    for batch in batches:
        r = bench_latency(llm, batch, args.input_len, args.output_len, args.rounds, warmup_rounds=1)
        d = r["decode"]
        measured = batch * 1e3 / d["ms_per_step"]["median"]
        predicted = batch * 1e3 / d["floor_ms"]["median"]
        rows.append(
            {
                "batch": batch,
                "measured_tokens_per_s": measured,
                "predicted_tokens_per_s": predicted,
                "ratio": measured / predicted,
                "ms_per_step": d["ms_per_step"]["median"],
                "floor_ms": d["floor_ms"]["median"],
                "bandwidth_gb_per_s": r["bandwidth_gb_per_s"]["median"],
                "peak_gflop_per_s": r["peak_gflop_per_s"],
            }
        )
        print(
            f"batch {batch:>3}: measured {measured:8.1f} tok/s, roofline {predicted:8.1f} tok/s "
            f"({100 * measured / predicted:5.1f}%), {d['ms_per_step']['median']:.1f} ms/step "
            f"(floor {d['floor_ms']['median']:.1f} ms at {r['bandwidth_gb_per_s']['median']:.1f} GB/s)",
            flush=True,
        )

    peak = rows[0]["peak_gflop_per_s"] * 1e9
    knee = _knee(llm, peak, rows[0]["bandwidth_gb_per_s"] * 1e9, args.input_len + args.output_len // 2)
    payload = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "analyzer_knee_batch": knee,
        "rows": rows,
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    _plot(rows, knee, args.png, args.model)
    print(f"analyzer: decode turns compute-bound at batch {knee}; wrote {args.json} and {args.png}")
    return 0


def _knee(llm, peak: float, bandwidth: float, context: int) -> int:
    """Smallest batch whose decode step is compute-bound on this roofline (the analyzer's knee)."""
    for batch in range(1, 513):
        cost = llm.engine.telemetry.price(StepRecord((), (context,) * batch, 0.0))
        if cost.flops / peak >= cost.bytes / bandwidth:
            return batch
    return -1


def _plot(rows, knee: int, path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    b = [r["batch"] for r in rows]
    ax.plot(b, [r["predicted_tokens_per_s"] for r in rows], "o--", label="analyzer: roofline (this machine)")
    ax.plot(b, [r["measured_tokens_per_s"] for r in rows], "s-", label="ridge: measured")
    ax.fill_between(
        b,
        [0.8 * r["predicted_tokens_per_s"] for r in rows],
        [r["predicted_tokens_per_s"] for r in rows],
        alpha=0.15,
        label="within 20% of the roofline",
    )
    if knee > 0:
        ax.axvline(knee, color="gray", lw=1)
        ax.text(knee, ax.get_ylim()[1] * 0.05, f" knee (batch {knee})", color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (decoding sequences)")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"Decode throughput vs batch: {model}, bf16, 2 threads")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
