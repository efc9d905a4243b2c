"""Decode attention over paged caches read from memory: jobs of one KV head against jobs of
several, alternated on the same pools.

The decode kernels (AVX-512: csrc/decode_ops.cpp, csrc/decode_attention_quant.cpp; AVX2 with
``--kernels avx2``: csrc/avx2_ops.cpp, on an AVX-512 CPU too) give a job several KV heads of a
sequence where the batch's mean context is past a bound (``kv_head_jobs`` in
csrc/paged_rows.h; 1 MiB of K and V, never for the AVX-512 kernels on Zen 4), and one head
otherwise (an fp8 cache always one: ``--kinds fp8`` shows the settings alike). This times
one call per layer over ``--layers`` layers' pools (far more bytes than the caches hold; blocks
of 16 tokens handed out in a shuffled order, as a busy server's pool has them; each pool in
the memory the engine gives one, ``kv_cache.pool_empty``'s 2 MiB pages) per cache kind
and shape, under each setting of the bound in turn: ``default``, ``never`` (one head a job) and
``always`` (several whenever the threads allow). Every round runs every setting once, the order
rotated. Reported per kind and shape: each setting's median ms a layer, GB/s of K and V (codes
and scales), and the median over rounds of its speed against ``never`` in the same round. The
outputs are checked equal bit for bit (the jobs never change a result). Writes
``benchmarks/decode_attention.json`` (one entry per CPU and kernel set; a rerun replaces it).

    python benchmarks/decode_attention.py [--kinds bf16,int8] [--shapes 16x4096,1x512:32:8:128] [--kernels avx2]

A shape is ``BxCONTEXT`` (TinyLlama's 32 query heads on 4 KV heads of 64 dims) or
``BxCONTEXT:HQ:HKV:D``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import add_kernel_run_args, kernel_run_record, time_alternated, write_cpu_entry

OUT = Path(__file__).with_name("decode_attention.json")
BLOCK = 16  # tokens a block
SETTINGS = {"never": 1 << 62, "always": 0}  # and "default": the extension's own


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``BxCONTEXT[:HQ:HKV:D]`` -> (B, context, Hq, Hkv, D)."""
    head, *heads = text.split(":")
    batch, context = (int(v) for v in head.split("x"))
    hq, hkv, dim = (int(v) for v in heads) if heads else (32, 4, 64)
    return batch, context, hq, hkv, dim


def build(ext, kind: str, shape: tuple, layers: int, avx2: bool, seed: int = 0):
    """(call(pools) -> output, [pools of each layer], bytes of K and V a layer) for one shape."""
    from ridge.kv import cache as kv_cache

    batch, context, hq, hkv, dim = shape
    width = -(-context // BLOCK)
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(batch * width, generator=gen).view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, hq, dim, generator=gen).bfloat16()
    scale = dim**-0.5

    def placed(t: torch.Tensor) -> torch.Tensor:  # where the engine's pools live
        return kv_cache.pool_empty(t.shape, t.dtype, t.device).copy_(t)

    def pool():
        x = torch.randn(batch * width, BLOCK, hkv, dim, generator=gen).bfloat16()
        return (placed(x),) if kind == "bf16" else tuple(placed(t) for t in kv_cache.quantize(x, kind))

    pools = [(*pool(), *pool()) for _ in range(layers)]
    if kind == "bf16":
        dense = ext.paged_decode_attention if avx2 else ext.paged_decode_attention_bf16

        def call(p):
            return dense(q, p[0], p[1], tables, lens, scale)

        row_bytes = 2 * dim
    else:

        def call(p):
            (k, ks, v, vs), fp8 = p, kind == "fp8"
            return ext.paged_decode_attention_quant(q, k, v, ks, vs, tables, lens, scale, fp8)

        row_bytes = dim + 2 * kv_cache.scale_groups(dim)
    return call, pools, 2 * batch * context * hkv * row_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="bf16,int8")
    parser.add_argument(
        "--shapes",
        default="1x512,4x1024,1x2048,1x4096,16x2048,16x4096,8x1024:32:8:128,1x4096:32:8:128,4x2048:28:4:128",
    )
    parser.add_argument("--kernels", default="auto", help="auto, or avx2: the AVX2 kernels on an AVX-512 CPU too")
    add_kernel_run_args(parser, rounds=7, layers=8, out=OUT)
    args = parser.parse_args()

    from ridge.layers.cpu_kernels import load_avx2_extension, load_extension
    from ridge.roofline.probe import cpu_model

    torch.set_num_threads(args.threads)
    avx2 = args.kernels == "avx2"
    ext = load_avx2_extension() if avx2 else load_extension()
    entry = f"{cpu_model()}, AVX2 kernels" if avx2 else cpu_model()
    default = ext.kv_grouped_bytes()
    settings = {"default": default, **SETTINGS}
    names = list(settings)
    print(f"{entry}, {args.threads} threads; default bound {default} bytes of K and V a sequence")
    results = {}
    try:
        for kind in args.kinds.split(","):
            results[kind] = {}
            for text in args.shapes.split(","):
                call, pools, nbytes = build(ext, kind, parse_shape(text), args.layers, avx2)
                outputs = {}
                for name in names:
                    ext.set_kv_grouped_bytes(settings[name])
                    outputs[name] = call(pools[0])
                assert all(torch.equal(outputs[n], outputs["never"]) for n in names), f"{kind} {text}: results differ"

                def one_pass(pools=pools, call=call) -> None:
                    for p in pools:
                        call(p)

                times = time_alternated(names, args.rounds, lambda n: ext.set_kv_grouped_bytes(settings[n]), one_pass)
                times = {n: [t / len(pools) for t in ts] for n, ts in times.items()}  # a layer's
                cell = {}
                for name in names:
                    ratios = [a / b for a, b in zip(times["never"], times[name])]
                    ms = statistics.median(times[name]) * 1e3
                    cell[name] = {
                        "ms_per_layer": ms,
                        "gb_per_s": nbytes / ms / 1e6,
                        "vs_never": statistics.median(ratios),
                        "vs_never_range": [min(ratios), max(ratios)],
                    }
                results[kind][text] = cell
                line = "  ".join(
                    f"{n}: {c['ms_per_layer']:.3f} ms ({c['gb_per_s']:4.1f} GB/s) {c['vs_never']:.3f}x"
                    for n, c in cell.items()
                )
                print(f"{kind:4s} {text:18s} {line}", flush=True)
                del pools
    finally:
        ext.set_kv_grouped_bytes(default)
    record = kernel_run_record(
        args, cpu_model(), kernels=args.kernels, block_size=BLOCK, default_bound_bytes=default, results=results
    )
    write_cpu_entry(args.json, entry, record)


if __name__ == "__main__":
    main()
