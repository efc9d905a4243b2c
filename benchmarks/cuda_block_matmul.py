"""The GPU's block-format matmul (``triton_kernels.block_matmul``, Q8_0 and Q4_0) against the
bf16 matmul (torch's, cuBLAS) on Llama-shaped layers: achieved weight bandwidth and the ratio
to bf16, for the default tile configuration and, with ``--sweep``, others.

Each timing replays a CUDA graph of ``--calls`` launches that cycle over enough copies of the
weight to overflow the L2, so what is measured is HBM and the kernel, not launch overhead or
the cache (a decode step runs these layers inside a CUDA graph too).

    python benchmarks/cuda_block_matmul.py [--rows 1 --rows 32] [--sweep] [--budget-s 90]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import multiprocessing
import time

import torch

from ridge.layers import triton_kernels as tk
from ridge.quantization.formats import FORMATS

# (name, N, K): the projections of a decode step (q/k/v and gate/up merged as ridge runs them)
SHAPES = [
    ("tinyllama qkv", 2560, 2048),
    ("tinyllama o", 2048, 2048),
    ("tinyllama gate_up", 11264, 2048),
    ("tinyllama down", 2048, 5632),
    ("llama-8b qkv", 6144, 4096),
    ("llama-8b o", 4096, 4096),
    ("llama-8b gate_up", 28672, 4096),
    ("llama-8b down", 4096, 14336),
]
L2_BYTES = 256 << 20  # copies of a weight until this many bytes (several times any L2)


def graph_ms(fn, weights: list[torch.Tensor], calls: int) -> float:
    """Median ms of one call fn(w): a graph of ``calls`` calls cycling over ``weights``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # compile and warm outside capture
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def quant_matmul(x, name, n, config, packed):
    return tk.block_matmul(x, packed, name, n, None, config)


def configs(m: int) -> list[tuple[str, int, int, int, int]]:
    """(kernel, BLOCK_M, BLOCK_N, BLOCK_K, num_warps) to try at m rows: the GEMVs up to
    ``GEMV_MAX_ROWS`` (x as int8 codes or as floats, the float one's best first), else the int8
    tiles' best of the last sweep and the dequantizing tiles (W the right operand or the left)."""
    if m <= tk.GEMV_MAX_ROWS:
        q8 = itertools.product([tk.GEMV_Q8], [m], [4, 8, 16], [1024, 2048], [2, 4, 8])
        return [(tk.GEMV_F32, 1, 4, 1024, 2), *q8]
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    int8_tile = (tk.TILE_Q8, block_m, 64, 128, 4)
    return [int8_tile, *itertools.product([tk.TILE, tk.TILE_T], [block_m], [32, 64, 128], [128, 256], [4, 8])]


def _compile(job: tuple[int, str, tuple]) -> str | None:
    """Compile one config into Triton's cache (a worker process): a small problem with the
    sweep's divisibility (Triton specializes integers on it), so the timed calls find it."""
    m, fmt_name, config = job
    fmt, n, k = FORMATS[fmt_name], 256, 4096
    blocks = fmt.quantize(torch.randn(n, k)).cuda()
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    try:
        tk.block_matmul(x, tk.pack_blocks(fmt.name, blocks, n, k), fmt.name, n, None, config)
        torch.cuda.synchronize()
    except Exception as e:  # a tile that does not fit: reported again when timed
        return f"{config}: {type(e).__name__}"
    return None


def precompile(jobs: list[tuple[int, str, tuple]], workers: int) -> None:
    """Compile the sweep's configs in parallel processes (compiling, not timing, is most of a
    sweep's time); the timing loop then runs alone on the GPU."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for failed in pool.map(_compile, jobs):
            if failed:
                print(f"  compile: {failed}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, action="append")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--sweep", action="store_true", help="try other tile configurations too")
    ap.add_argument("--sweep-shapes", default="tinyllama o,llama-8b gate_up,llama-8b down", help="or 'all'")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=90.0, help="stop sweeping after this long")
    ap.add_argument("--json")
    ap.add_argument("--jobs", type=int, default=0, help="compile the sweep's configs first in this many processes")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows_list = args.rows or [1, 32]
    sweep_shapes = [name for name, _, _ in SHAPES] if args.sweep_shapes == "all" else args.sweep_shapes.split(",")
    if args.sweep and args.jobs:
        begin = time.perf_counter()
        jobs = [(m, f, c) for m in rows_list for f in args.formats.split(",") for c in [None, *configs(m)]]
        precompile(jobs, args.jobs)
        print(f"compiled {len(jobs)} configs in {time.perf_counter() - begin:.0f} s", flush=True)
    start = time.perf_counter()
    results = []
    for (name, n, k), m in itertools.product(SHAPES, rows_list):
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        dense_bytes = n * k * 2
        copies = max(2, min(16, L2_BYTES // dense_bytes + 1))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
        bf16 = graph_ms(functools.partial(torch.nn.functional.linear, x), ws, args.calls)
        row = {"shape": name, "n": n, "k": k, "rows": m, "bf16_ms": bf16, "bf16_gbs": dense_bytes / bf16 / 1e6}
        for fmt_name in args.formats.split(","):
            fmt = FORMATS[fmt_name]
            blocks = fmt.quantize(ws[0].float()).to(dev)
            packed = tk.pack_blocks(fmt.name, blocks, n, k)
            nbytes = packed.numel()
            qcopies = max(2, min(32, L2_BYTES // nbytes + 1))
            packs = [packed] + [packed.clone() for _ in range(qcopies - 1)]
            want = torch.nn.functional.linear(x.float(), fmt.dequantize(blocks, k).float())
            got = tk.block_matmul(x, packed, fmt.name, n, None).float()
            err = ((got - want).norm() / want.norm()).item()
            tried = [None]
            if args.sweep and name in sweep_shapes:
                tried += configs(m)
            best = None
            for config in tried:
                if config is not None and time.perf_counter() - start > args.budget_s:
                    break
                try:
                    ms = graph_ms(functools.partial(quant_matmul, x, fmt.name, n, config), packs, args.calls)
                except Exception as e:  # a tile that does not fit (shared memory, registers)
                    print(f"  {name} m={m} {fmt_name} {config}: {type(e).__name__}")
                    continue
                key = "default" if config is None else str(config)
                row[f"{fmt_name}_{key}_ms"] = ms
                if best is None or ms < best[1]:
                    best = (key, ms)
            default = row[f"{fmt_name}_default_ms"]
            row[f"{fmt_name}_err"] = err
            row[f"{fmt_name}_gbs"] = nbytes / default / 1e6
            row[f"{fmt_name}_vs_bf16"] = bf16 / default
            row[f"{fmt_name}_best"] = best
        results.append(row)
        line = f"{name:>18} m={m:<3} bf16 {bf16 * 1e3:7.1f} us ({row['bf16_gbs']:5.0f} GB/s)"
        for fmt_name in args.formats.split(","):
            line += (
                f" | {fmt_name} {row[f'{fmt_name}_default_ms'] * 1e3:7.1f} us ({row[f'{fmt_name}_gbs']:5.0f} GB/s,"
                f" x{row[f'{fmt_name}_vs_bf16']:.2f}, err {row[f'{fmt_name}_err']:.1e})"
            )
            best = row[f"{fmt_name}_best"]
            if best and best[0] != "default":
                line += f" best {best[0]} {best[1] * 1e3:.1f} us"
        print(line, flush=True)
    doc = {"device": torch.cuda.get_device_name(), "calls": args.calls, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
