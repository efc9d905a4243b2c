"""Which prefetch policy streams the weights fastest on this CPU: the kernels alone, policies
alternated on the same bytes.

The streaming kernels fetch their weights ahead as a per-process policy says (csrc/linear_call.h;
each CPU vendor's table and what it measured in csrc/prefetch.cpp). This times the four matrices
of ``--layers`` TinyLlama-1.1B layers (qkv, o, gate_up, down: 2560x2048, 2048x2048, 11264x2048,
2048x5632; random weights, bf16 activations), far more bytes than the caches hold, per format
and row count, under each policy in turn: every round runs every policy once, in a rotated
order. Reported per format and rows: each policy's median GB/s (packed bytes / time) and the
median over rounds of its speed against the first policy's in the same round.

Policies are ``$RIDGE_PREFETCH``-style texts separated by ``;`` (``amd``, ``zen5``, ``intel``,
``cpu``, or a table with ``key=value`` overrides, e.g. ``amd,quant_near_rows=1``). A policy
that beats this CPU's table by a clear margin in every round belongs in that vendor's table in
csrc/prefetch.cpp. Writes ``benchmarks/prefetch.json`` (one entry per CPU; a rerun replaces it).

A kernel's gain need not survive a whole step (the other ops, the calls' edges: stop 94's
Q8_0 kernel gained 1.03x and its steps 0.98x), so ``--steps`` times batch-1 greedy decode of
GGUF files instead: each file loaded once, ``--tokens`` tokens from a 4-token prompt a run
(``--num-scheduler-steps`` as the targets' runs), the policies alternated the same way, and the
tokens checked to be the same under every policy. Reported per file: each policy's ms a token
and its speed against the first policy's in the same round. Writes
``benchmarks/prefetch_steps.json`` (one entry per CPU).

    python benchmarks/prefetch.py [--policies "amd;intel"] [--formats bf16,int4,q4_k] [--rows 1,8]
    python benchmarks/prefetch.py --policies "amd;amd,quant_far_scales=1" --steps q4_0.gguf,q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import add_kernel_run_args, kernel_run_record, time_alternated, write_cpu_entry

OUT = Path(__file__).with_name("prefetch.json")
OUT_STEPS = Path(__file__).with_name("prefetch_steps.json")
SHAPES = ((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632))  # (N, K) of one layer


def build_layers(ext, name: str, layers: int) -> tuple[list, int, object]:
    """([(packed, N, K) per matrix], packed bytes, the call y = x @ W.T) for ``layers`` layers of
    format ``name`` (``bf16`` or a block format)."""
    from ridge.layers.kernels import QUANT_KERNEL_CODES
    from ridge.quantization.formats import FORMATS
    from ridge.quantization.random_blocks import random_blocks

    mats = []
    for layer in range(layers):
        for i, (n, k) in enumerate(SHAPES):
            seed = layer * len(SHAPES) + i
            if name == "bf16":
                w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
                mats.append((ext.pack_vnni(w), n, k))
            else:
                code = QUANT_KERNEL_CODES[name]
                mats.append((ext.pack_quant(random_blocks(FORMATS[name], n, k, seed=seed), code, n, k), n, k))
    nbytes = sum(p.numel() * p.element_size() for p, _, _ in mats)
    if name == "bf16":
        return mats, nbytes, lambda x, p, n: ext.linear_bf16(x, p, n, None)
    code = QUANT_KERNEL_CODES[name]
    return mats, nbytes, lambda x, p, n: ext.linear_quant(x, p, code, n, None)


def time_policies(ext, policies: list[str], mats: list, call, m: int, rounds: int) -> dict[str, list[float]]:
    """{policy: seconds of one pass over every matrix at ``m`` rows, a round each}, the policies
    alternated (``time_alternated``)."""
    from ridge.layers.cpu_kernels import apply_prefetch

    xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, _, k in mats}}

    def one_pass() -> None:
        for packed, n, k in mats:
            call(xs[k], packed, n)

    return time_alternated(policies, rounds, lambda p: apply_prefetch(ext, p), one_pass)


def time_steps(ext, policies: list[str], path: str, args) -> dict[str, list[float]]:
    """{policy: seconds a token of batch-1 greedy decode of the GGUF file at ``path``, a round
    each}, the policies alternated (``time_alternated``); raises where a policy changed a token."""
    from ridge import LLM, SamplingParams
    from ridge.layers.cpu_kernels import apply_prefetch

    llm = LLM(
        path,
        tokenizer="bytes",
        num_threads=args.threads,
        max_num_seqs=1,
        max_model_len=args.tokens + 16,
        num_kv_blocks=(args.tokens + 16) // 16 + 8,  # one sequence's
        num_scheduler_steps=args.num_scheduler_steps,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    current, first = [policies[0]], []  # the policy set last; the first run's tokens

    def prepare(policy: str) -> None:
        apply_prefetch(ext, policy)
        current[0] = policy

    def run() -> None:
        out = list(llm.generate([[10, 11, 12, 13]], params, use_tqdm=False)[0].outputs[0].token_ids)
        if first and out != first:
            raise SystemExit(f"{path}: policy {current[0]!r} changed the tokens")
        first[:] = out

    times = time_alternated(policies, args.rounds, prepare, run)
    return {p: [t / args.tokens for t in ts] for p, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="amd;zen5;intel", help="RIDGE_PREFETCH-style texts, ';' between")
    parser.add_argument("--formats", default="bf16,int8,int4,iq4_xs,q4_k,q5_k,q6_k,q3_k,q2_k")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--steps", default="", help="GGUF files (',' between): time whole decode steps instead")
    parser.add_argument("--tokens", type=int, default=64, help="--steps: tokens a run")
    parser.add_argument("--num-scheduler-steps", type=int, default=8, help="--steps: ridge's multi-step scheduling")
    add_kernel_run_args(parser, rounds=7, layers=22, out=OUT)
    args = parser.parse_args()
    files = [f for f in args.steps.split(",") if f]
    if files and args.json == OUT:
        args.json = OUT_STEPS

    from ridge.layers.cpu_kernels import apply_prefetch, load_extension
    from ridge.roofline.probe import cpu_model

    torch.set_num_threads(args.threads)
    ext = load_extension()
    start_policy = ext.prefetch_policy()
    policies = [p.strip() for p in args.policies.split(";") if p.strip()]
    resolved = {p: apply_prefetch(ext, p) for p in policies}
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{cpu_model()}, {args.threads} threads; this CPU's table: {dict(ext.prefetch_preset('cpu'))}")
    for p in policies:
        print(f"  {p}: {resolved[p]}")
    if files:
        steps = {}
        for path in files:
            times = time_steps(ext, policies, path, args)
            first, cell = policies[0], {}
            for p in policies:
                ratios = [a / b for a, b in zip(times[first], times[p])]
                cell[p] = {
                    "ms_per_token": statistics.median(times[p]) * 1e3,
                    "vs_first": statistics.median(ratios),
                    "vs_first_range": [min(ratios), max(ratios)],
                }
            steps[Path(path).name] = cell
            line = "  ".join(
                f"{p}: {c['ms_per_token']:6.2f} ms {c['vs_first']:.3f}x ({low:.2f}-{high:.2f})"
                for p, c in cell.items()
                for low, high in [c["vs_first_range"]]
            )
            print(f"{Path(path).name}  {line}", flush=True)
        ext.set_prefetch_policy(start_policy)
        record = kernel_run_record(
            args, cpu_model(), policies=resolved, tokens=args.tokens, num_scheduler_steps=args.num_scheduler_steps
        )
        del record["layers"]  # (whole models: --layers is the kernels' option)
        record["steps"] = steps
        write_cpu_entry(args.json, cpu_model(), record)
        return
    results = {}
    for name in args.formats.split(","):
        mats, nbytes, call = build_layers(ext, name, args.layers)
        results[name] = {"bytes": nbytes, "rows": {}}
        for m in rows:
            times = time_policies(ext, policies, mats, call, m, args.rounds)
            first = policies[0]
            cell = {}
            for p in policies:
                ratios = [a / b for a, b in zip(times[first], times[p])]
                cell[p] = {
                    "gb_per_s": nbytes / statistics.median(times[p]) / 1e9,
                    "vs_first": statistics.median(ratios),
                    "vs_first_range": [min(ratios), max(ratios)],
                }
            results[name]["rows"][str(m)] = cell
            line = "  ".join(
                f"{p}: {c['gb_per_s']:5.1f} GB/s {c['vs_first']:.3f}x ({low:.2f}-{high:.2f})"
                for p, c in cell.items()
                for low, high in [c["vs_first_range"]]
            )
            print(f"{name:7s} {m:2d} rows  {line}", flush=True)
        del mats
    ext.set_prefetch_policy(start_policy)
    record = kernel_run_record(
        args,
        cpu_model(),
        shapes=SHAPES,
        cpu_table=dict(ext.prefetch_preset("cpu")),
        policies=resolved,
        formats=results,
    )
    write_cpu_entry(args.json, cpu_model(), record)


if __name__ == "__main__":
    main()
