"""What a quantized decode step of several rows costs against one row, per block format, and
what AMX-INT8 gives where the CPU has it.

The kernel alone (``linear_quant``) over the four matrices of each of ``--layers``
TinyLlama-1.1B layers (qkv, o, gate_up, down: 2560x2048, 2048x2048, 11264x2048, 2048x5632;
22 layers by default, the model's own), bf16 activations, at each row count. The weights are
what a decode step reads, so one row streams them from memory as a step does: a single
layer (``--layers 1``, what this script ran before 2026-11-27) stays in a large L3 (300 MiB
on the Xeon) and makes one row look faster than a step can run, and 2-8 rows dearer against
it. Times are per layer. Each round runs one worker process per path, in turn: the path ridge dispatches
(AMX tiles for 8+ rows where the CPU has AMX-INT8) and, on such CPUs, ``RIDGE_AMX=0`` (the
VNNI loop everywhere). Reported per format and rows: the median over rounds of each worker's
median, the cost against one row (the issue's target: 2-8 rows at most 1.3x one row; the
median of each worker's own ratio), the one-row bandwidth (packed bytes / time), and AMX's
speedup over the VNNI loop (the median of each round's ratio of its two workers). Weights are
random valid blocks (timings do not depend on the values).

``--engine int4,int8`` adds whole steps of ``--model`` quantized at load, per path in the same
rounds: the median decode step at batch 1, 8 and 16 (4-token prompts, 24 tokens each) and a
512-token prefill. Writes ``benchmarks/quant_rows.json`` (one entry per CPU; a rerun replaces
its entry).

    python benchmarks/quant_rows.py [--rounds 3] [--rows 1,2,4,8,16,64,128] [--formats int4,q4_k]
    python benchmarks/quant_rows.py --engine int4,int8 --formats int4 --rows 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import write_cpu_entry

OUT = Path(__file__).with_name("quant_rows.json")
SHAPES = ((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632))  # (N, K) of one layer
SAMPLES = 9  # timed passes over the layers per row count and worker


def run_layers(run, layers, xs) -> None:
    for layer in layers:
        for (packed, n, _), x in zip(layer, xs):
            run(x, packed, n)


def kernel_format(avx2: bool, name: str):
    """(the extension, pack(blocks, n, k) -> the weight as the engine holds it for these kernels,
    run(x, weight, n)) for block format ``name``: the AVX-512 kernels' packed layout, or the
    AVX2 kernels' blocks of 8 rows (``AVX2_PACKED_FORMATS``; the others as loaded), in 2 MiB
    pages as ``Avx2Kernels.place_weight`` puts them."""
    from ridge.layers.cpu_kernels import load_avx2_extension, load_extension
    from ridge.layers.kernels import AVX2_PACKED_FORMATS, QUANT_KERNEL_CODES
    from ridge.quantization.formats import FORMATS

    if not avx2:
        ext, code = load_extension(), QUANT_KERNEL_CODES[name]
        return (
            ext,
            lambda blocks, n, k: ext.pack_quant(blocks, code, n, k),
            lambda x, w, n: ext.linear_quant(x, w, code, n, None),
        )
    ext, ggml_type = load_avx2_extension(), FORMATS[name].ggml_type
    if name in AVX2_PACKED_FORMATS:
        return (
            ext,
            lambda blocks, n, k: ext.huge_page_copy(ext.repack_rows(blocks, ggml_type, True)),
            lambda x, w, n: ext.linear_blocks_packed(x, w, ggml_type, None),
        )
    return (
        ext,
        lambda blocks, n, k: ext.huge_page_copy(blocks),
        lambda x, w, n: ext.linear_blocks(x, w, ggml_type, None),
    )


def worker(formats: list[str], rows: list[int], threads: int, n_layers: int, avx2: bool) -> dict:
    """{format: {rows: ms per layer}} for this process's path, and the packed bytes of a layer per format."""
    from ridge.quantization.formats import FORMATS
    from ridge.quantization.random_blocks import random_blocks

    torch.set_num_threads(threads)
    times, sizes = {}, {}
    for name in formats:
        ext, pack, run = kernel_format(avx2, name)
        blocks = [(random_blocks(FORMATS[name], n, k, seed=i), n, k) for i, (n, k) in enumerate(SHAPES)]
        # each layer packed from the same blocks: distinct memory where the engine puts weights
        # (2 MiB pages; a clone would not be), and timings do not depend on the values
        layers = [[(pack(b, n, k), n, k) for b, n, k in blocks] for _ in range(n_layers)]
        layer = layers[0]
        sizes[name] = sum(p.numel() for p, _, _ in layer)
        xs = {m: [torch.randn(m, k).bfloat16() for _, _, k in layer] for m in rows}
        samples = {m: [] for m in rows}
        for i in range(SAMPLES + 1):  # the row counts in turn, so that a drift in speed meets them all
            for m in rows:
                start = time.perf_counter()
                run_layers(run, layers, xs[m])
                if i:  # pass 0 warms
                    samples[m].append((time.perf_counter() - start) / n_layers)
        times[name] = {str(m): statistics.median(samples[m]) * 1e3 for m in rows}
        del layers, layer
    return {"ms": times, "bytes": sizes, "amx_int8": not avx2 and bool(ext.amx_int8_ready())}


def engine_worker(model: str, quantization: str, threads: int, kernels: str) -> dict:
    """Median decode step (ms) at batch 1, 8 and 16 and a 512-token prefill (ms), this path."""
    from ridge import LLM, SamplingParams

    torch.set_num_threads(threads)
    engine = LLM(model, dtype="bfloat16", quantization=quantization, max_num_seqs=16, kernels=kernels).engine

    def decode(batch: int, tokens: int = 24) -> float:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
        for i in range(batch):
            engine.add_request(None, [10 + i, 11, 12, 13], params)
        walls = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        return statistics.median(walls[2:]) * 1e3  # past the prefill steps

    def prefill(n: int) -> float:
        engine.add_request(None, [(7 * i) % 30000 + 5 for i in range(n)], SamplingParams(max_tokens=1))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return (time.perf_counter() - start) * 1e3

    decode(1, 4)  # warm
    prefill(64)
    return {"b1": decode(1), "b8": decode(8), "b16": decode(16), "pp512": prefill(512)}


def run_worker(path: str, args, engine: str | None = None) -> dict:
    env = dict(os.environ, RIDGE_AMX="0" if path == "vnni" else os.environ.get("RIDGE_AMX", "1"))
    cmd = [sys.executable, __file__, "--worker", "--formats", args.formats, "--rows", args.rows]
    cmd += ["--threads", str(args.threads), "--layers", str(args.layers), "--model", args.model]
    cmd += ["--kernels", args.kernels]
    if engine:
        cmd += ["--engine", engine]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="int8,int4,int4_asym,iq4_nl,iq4_xs,q4_k,q5_k,q6_k,q3_k,q2_k")
    parser.add_argument("--rows", default="1,2,4,8,16,64,128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=22, help="layers of weights the kernel walks (TinyLlama: 22)")
    parser.add_argument("--engine", default="", help="quantizations whose whole steps to time too")
    parser.add_argument("--model", default="random:tinyllama-1.1b")
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "avx2"),
        help="auto: the AVX-512 kernels, or the AVX2 ones on a CPU without AVX-512 BF16; avx2: the AVX2 kernels",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    formats, rows = args.formats.split(","), [int(r) for r in args.rows.split(",")]
    quantizations = [q for q in args.engine.split(",") if q]
    from ridge.layers.cpu_kernels import cpu_has_avx512_bf16

    avx2 = args.kernels == "avx2" or not cpu_has_avx512_bf16()
    if args.worker:
        if quantizations:
            print(json.dumps(engine_worker(args.model, quantizations[0], args.threads, "avx2" if avx2 else "auto")))
        else:
            print(json.dumps(worker(formats, rows, args.threads, args.layers, avx2)))
        return

    from ridge.roofline.probe import cpu_model

    cpu_entry = f"{cpu_model()}, AVX2 kernels" if avx2 else cpu_model()

    first = run_worker("dispatched", args)
    paths = ["dispatched", "vnni"] if first["amx_int8"] else ["dispatched"]
    runs = {p: [] for p in paths}
    runs["dispatched"].append(first["ms"])
    for r in range(args.rounds):
        for p in paths:
            if r == 0 and p == "dispatched":
                continue
            runs[p].append(run_worker(p, args)["ms"])
    steps = {q: {p: [] for p in paths} for q in quantizations}
    for _ in range(args.rounds):
        for q in quantizations:
            for p in paths:
                steps[q][p].append(run_worker(p, args, engine=q))

    def median(p: str, name: str, m: int) -> float:
        return statistics.median(run[name][str(m)] for run in runs[p])

    def ratio(name: str, m: int, over: str, under: str, under_m: int) -> float:
        """The median of same-run ratios: path ``over``'s worker at m rows against, in the same
        worker (``under`` == ``over``) or the one run beside it in that round, ``under_m`` rows.
        (A worker's whole speed swung by up to a third from process to process on the Xeon.)"""
        return statistics.median(a[name][str(m)] / b[name][str(under_m)] for a, b in zip(runs[over], runs[under]))

    table = {}
    print(f"{cpu_entry}, {args.threads} threads, AMX-INT8: {first['amx_int8']}, {args.layers} layers")
    head = "format     rows ms/layer x one row" + ("   VNNI ms  AMX speedup" if len(paths) == 2 else "")
    print(head)
    for name in formats:
        one = median("dispatched", name, rows[0])
        entry = {"bytes": first["bytes"][name], "one_row_gb_per_s": first["bytes"][name] / one / 1e6, "rows": {}}
        for m in rows:
            ms, cost = median("dispatched", name, m), ratio(name, m, "dispatched", "dispatched", rows[0])
            cell = {"ms": ms, "vs_one_row": cost}
            line = f"{name:10s} {m:4d} {ms:7.2f}  {cost:5.2f}x"
            if len(paths) == 2:
                vnni, speedup = median("vnni", name, m), ratio(name, m, "vnni", "dispatched", m)
                cell |= {"vnni_ms": vnni, "amx_speedup": speedup}
                line += f"   {vnni:7.2f}  {speedup:5.2f}x"
            entry["rows"][str(m)] = cell
            print(line)
        table[name] = entry
    engine = {}
    for q in quantizations:
        engine[q] = {p: {k: [run[k] for run in steps[q][p]] for k in steps[q][p][0]} for p in paths}
        for k in steps[q]["dispatched"][0]:
            cells = "  ".join(f"{p} {statistics.median(engine[q][p][k]):7.1f} ms" for p in paths)
            print(f"{args.model} {q} {k}: {cells}")
    record = {
        "cpu": cpu_model(),
        "kernels": "avx2" if avx2 else "avx512",
        "machine": platform.machine(),
        "threads": args.threads,
        "layers": args.layers,
        "amx_int8": first["amx_int8"],
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
        "shapes": SHAPES,
        "formats": table,
        "engine": {"model": args.model, "runs": engine} if engine else None,
    }
    write_cpu_entry(OUT, cpu_entry, record)


if __name__ == "__main__":
    main()
