"""Continuous vs static batching, served over HTTP: the same workload, both schedulers, side by side.

    .venv/bin/python benchmarks/serve_continuous_vs_static.py          # ~1.5 min per repeat, 2 CPU cores
    .venv/bin/python benchmarks/serve_continuous_vs_static.py --model ../shared/models/stories260K \
        --dtype float32 --max-num-seqs 16

For each scheduler it starts ``ridge serve --scheduler {continuous,static}`` in a subprocess,
sends the same requests with ``ridge bench serve``'s client (all at once by default, mixed
output lengths, ``ignore_eos`` so every request produces exactly the tokens asked for, greedy),
stops the server, and then prints both runs with their ratio and writes a PNG.

Why continuous batching wins: a static batch is admitted only when the previous one has
fully finished, so every slot idles from the moment its request ends until the longest
request of its batch ends, and a short request waits behind every long one admitted before
it. With output lengths uniform in 8..448 a batch of 8 runs for the longest of its 8 draws
(~400 steps) while its requests average ~230 tokens. Continuous batching refills a slot at
the next step.

That idle slot costs throughput only where a step costs about the same whatever the batch:
where decode is memory-bound, every step reading all the weights. So the default model is
``synthetic-50m``: a Llama with random weights (hidden 768, 8 layers, 50M parameters, 100 MB
in bfloat16, far beyond the caches), built here in a temporary directory, with the byte
tokenizer; with ``max_num_seqs`` 8 its step costs 7.6 ms for one sequence and 11.7 ms for
eight on one core. stories260K (1 MB of weights, inside L2) is the opposite case: its step
cost grows in proportion to the batch, so static batching loses latency but hardly any
throughput there.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import sys
import tempfile
from pathlib import Path

from ridge.bench.serve import (
    BenchConfig,
    LengthSpec,
    build_workload,
    load_bench_tokenizer,
    ridge_server,
    run_benchmark,
)

REPO = Path(__file__).resolve().parents[1]

SYNTHETIC = "synthetic-50m"
# The synthetic model: Llama shapes with 50M parameters (vocab 512 covers the byte tokenizer).
SYNTHETIC_CONFIG = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
SCHEDULERS = ("continuous", "static")

# (label, key in the summary, stat, higher is better)
ROWS = [
    ("duration (s)", "duration_s", None, False),
    ("requests / s", "request_throughput", None, True),
    ("output tokens / s", "output_throughput", None, True),
    ("TTFT mean (ms)", "ttft_ms", "mean", False),
    ("TTFT median (ms)", "ttft_ms", "median", False),
    ("TTFT p99 (ms)", "ttft_ms", "p99", False),
    ("TPOT median (ms)", "tpot_ms", "median", False),
    ("TPOT p99 (ms)", "tpot_ms", "p99", False),
    ("ITL median (ms)", "itl_ms", "median", False),
    ("E2E latency mean (ms)", "e2el_ms", "mean", False),
    ("E2E latency median (ms)", "e2el_ms", "median", False),
    ("E2E latency p99 (ms)", "e2el_ms", "p99", False),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=SYNTHETIC, help=f"{SYNTHETIC} (built here), a model directory, or random:<preset>"
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=LengthSpec.parse, default=LengthSpec(16, 48))
    p.add_argument("--output-len", type=LengthSpec.parse, default=LengthSpec(8, 448))
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson (default: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="the server's torch threads (1 leaves the other core to the HTTP side and the client)",
    )
    p.add_argument("--png", default=str(REPO / "benchmarks" / "continuous_vs_static.png"))
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per scheduler, alternating; the table shows medians (a shared machine is noisy)",
    )
    p.add_argument("--json-out", default=None, help="also write every run's summary here")
    return p.parse_args()


def build_synthetic_model(path: Path) -> None:
    """A random-weight Llama directory (config + safetensors) with SYNTHETIC_CONFIG's shapes."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SYNTHETIC_CONFIG))
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def run(args: argparse.Namespace, model: str, extra_flags: list[str]) -> dict[str, list[dict]]:
    """Every run's summary, per scheduler; the schedulers alternate so drifting noise hits both."""
    tokenizer = load_bench_tokenizer("bytes" if "--tokenizer" in extra_flags else model)
    workload = build_workload(args.num_prompts, args.input_len, args.output_len, args.seed, tokenizer)
    results: dict[str, list[dict]] = {s: [] for s in SCHEDULERS}
    for repeat in range(args.repeats):
        for scheduler in SCHEDULERS:
            flags = [
                "--scheduler",
                scheduler,
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--dtype",
                args.dtype,
                "--num-threads",
                str(args.num_threads),
                *extra_flags,
            ]
            print(
                f"[{scheduler} {repeat + 1}/{args.repeats}] ridge serve {' '.join(flags)}", file=sys.stderr, flush=True
            )
            with ridge_server(model, flags) as url:
                config = BenchConfig(
                    base_url=url, num_prompts=len(workload), request_rate=args.request_rate, seed=args.seed
                )
                s = asyncio.run(run_benchmark(config, workload, tokenizer))
            print(
                f"    {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.1f} s, "
                f"{s['output_throughput']:.0f} output tok/s",
                file=sys.stderr,
                flush=True,
            )
            if s["failed"]:
                raise SystemExit(f"{scheduler}: {s['failed']} requests failed: {s['errors']}")
            results[scheduler].append(s)
    return results


def median_run(runs: list[dict]) -> dict:
    """The table's numbers: each metric's median over the runs; per-request rows of the median-throughput run."""
    import statistics

    ordered = sorted(runs, key=lambda r: r["output_throughput"])
    out = {**ordered[(len(ordered) - 1) // 2]}
    for _, key, stat, _ in ROWS:
        if stat is None:
            out[key] = statistics.median(r[key] for r in runs)
        else:
            out[key] = {**out[key], stat: statistics.median(r[key][stat] for r in runs)}
    return out


def value(summary: dict, key: str, stat: str | None) -> float:
    return summary[key] if stat is None else summary[key][stat]


def print_table(results: dict[str, dict], args: argparse.Namespace) -> str:
    """Prints the comparison (rich) and returns it as markdown for the README."""
    from rich.console import Console
    from rich.table import Table

    c, s = results["continuous"], results["static"]
    table = Table(title="continuous vs static batching (same workload)")
    for col, justify in (
        ("metric", "left"),
        ("continuous", "right"),
        ("static", "right"),
        ("continuous / static", "right"),
    ):
        table.add_column(col, justify=justify)
    md = ["| metric | continuous | static | continuous / static |", "|---|---:|---:|---:|"]
    for label, key, stat, higher_better in ROWS:
        vc, vs = value(c, key, stat), value(s, key, stat)
        ratio = vc / vs if vs else float("nan")
        better = (ratio > 1) == higher_better
        cells = (f"{vc:.1f}", f"{vs:.1f}", f"{ratio:.2f}x")
        table.add_row(label, *cells[:2], f"[{'green' if better else 'red'}]{cells[2]}[/]")
        md.append(f"| {label} | {cells[0]} | {cells[1]} | {cells[2]} |")
    Console().print(table)
    return "\n".join(md)


def plot(results: dict[str, dict], args: argparse.Namespace, path: str, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"continuous": "tab:blue", "static": "tab:orange"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))

    ax = axes[0]
    names = list(SCHEDULERS)
    tput = [results[n]["output_throughput"] for n in names]
    bars = ax.bar(names, tput, color=[colors[n] for n in names])
    for bar, v in zip(bars, tput):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom")
    ax.set_ylabel("output tokens / s")
    ratio = tput[0] / tput[1] if tput[1] else float("nan")
    ax.set_title(f"throughput: continuous = {ratio:.2f}x static")

    ax = axes[1]
    for n in names:
        lat = sorted(r["e2el_ms"] / 1000 for r in results[n]["requests"] if r["ok"])
        ax.step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post", color=colors[n], label=n)
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("fraction of requests done")
    ax.set_title("latency CDF")
    ax.legend()

    ax = axes[2]
    for n in names:
        rows = results[n]["requests"]  # in send order: the engine admits them first come, first served
        ax.plot(range(len(rows)), [r["ttft_ms"] / 1000 for r in rows], marker=".", ms=4, lw=1, color=colors[n], label=n)
    ax.set_xlabel("request (send order)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("admission: a static batch waits for its slowest member")
    ax.legend()

    fig.suptitle(subtitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.model == SYNTHETIC:
        with tempfile.TemporaryDirectory(prefix="ridge-synthetic-") as tmp:
            print(f"building {SYNTHETIC} (random weights) in {tmp} ...", file=sys.stderr, flush=True)
            build_synthetic_model(Path(tmp))
            runs = run(args, tmp, ["--tokenizer", "bytes"])
    else:
        runs = run(args, args.model, [])
    results = {s: median_run(r) for s, r in runs.items()}
    model = Path(args.model).name if os.path.isdir(args.model) else args.model
    rate = "all at once" if math.isinf(args.request_rate) else f"Poisson {args.request_rate:g} req/s"
    medians = f"medians of {args.repeats} runs each, " if args.repeats > 1 else ""
    subtitle = (
        f"{model}, {args.num_prompts} requests ({rate}), {medians}prompt {args.input_len} tokens, "
        f"output {args.output_len} tokens, max_num_seqs {args.max_num_seqs}, {args.dtype}, "
        f"{args.num_threads} torch thread(s), "
        f"{os.cpu_count()}-core {platform.machine()} CPU, {datetime.date.today().isoformat()}"
    )
    print(subtitle)
    md = print_table(results, args)
    print("\nmarkdown:\n" + md)
    plot(results, args, args.png, subtitle)
    print(f"\nplot: {args.png}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"setup": subtitle, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
