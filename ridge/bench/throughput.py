"""``ridge bench throughput``: offline serving of many requests of mixed lengths.

All requests are submitted at once (``LLM.generate``); the figure is tokens per second in
(prompt) and out (generated), plus the roofline fraction per phase from the telemetry.
``--scheduler static`` gives the baseline continuous batching is measured against.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

from ridge.bench.common import dump_json, machine, parse_range, random_prompts
from ridge.engine.args import add_engine_args, engine_options


def register(subparsers) -> None:
    p = subparsers.add_parser("throughput", help="offline throughput over many mixed-length requests")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="16:256", help="prompt tokens: N or LO:HI (uniform)")
    p.add_argument("--output-len", default="8:256", help="new tokens: N or LO:HI")
    p.add_argument(
        "--output-dist",
        choices=OUTPUT_DISTRIBUTIONS,
        default="uniform",
        help="how output lengths spread over LO:HI: uniform, or log-uniform (many short, a long "
        "tail, like chat traffic)",
    )
    p.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="JSONL with 'prompt' or 'prompt_token_ids', and 'output_len' (or 'max_tokens')",
    )
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(func=run)


OUTPUT_DISTRIBUTIONS = ("uniform", "log-uniform")


def draw_lengths(rng: random.Random, lo: int, hi: int, count: int, dist: str = "uniform") -> list[int]:
    """``count`` integers in [lo, hi]: uniform, or log-uniform (uniform in log length)."""
    if dist == "uniform":
        return [rng.randint(lo, hi) for _ in range(count)]
    if dist == "log-uniform":
        return [min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))) for _ in range(count)]
    raise ValueError(f"unknown length distribution {dist!r}; choose from {', '.join(OUTPUT_DISTRIBUTIONS)}")


def make_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list, list[int]]:
    """(prompts, output lengths), from the JSONL dataset or uniform random ranges."""
    if args.dataset is not None:
        prompts, outputs = [], []
        for n, line in enumerate(args.dataset.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompts.append(row["prompt_token_ids"] if "prompt_token_ids" in row else row["prompt"])
                outputs.append(int(row.get("output_len", row.get("max_tokens", 128))))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{args.dataset}:{n + 1}: bad row ({exc})") from None
        if not prompts:
            raise ValueError(f"{args.dataset}: no requests in the file")
        return prompts[: args.num_prompts], outputs[: args.num_prompts]
    rng = random.Random(args.workload_seed)
    (in_lo, in_hi), (out_lo, out_hi) = parse_range(args.input_len), parse_range(args.output_len)
    in_lens = draw_lengths(rng, in_lo, in_hi, args.num_prompts)
    out_lens = draw_lengths(rng, out_lo, out_hi, args.num_prompts, args.output_dist)
    return random_prompts(args.num_prompts, in_lens, vocab_size, args.workload_seed), out_lens


def bench_throughput(llm, prompts: list, output_lens: list[int]) -> dict:
    from ridge.sampling import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.engine.telemetry.reset()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "requests": len(outputs),
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(outputs) / elapsed,
        "input_tokens_per_s": prompt_tokens / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "telemetry": llm.engine.telemetry.report(),
        "speculation": llm.engine.speculator.report() if llm.engine.speculator else None,
    }


def run(args: argparse.Namespace) -> int:
    from ridge.engine.llm import LLM

    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    parse_range(args.input_len), parse_range(args.output_len)  # bad flags fail before the model loads
    llm = LLM(args.model, **engine_options(args))
    prompts, output_lens = make_workload(args, llm.engine.model_config.vocab_size)
    result = bench_throughput(llm, prompts, output_lens)
    engine = llm.engine
    payload = {
        "model": args.model,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "device": str(engine.device),
        "scheduler": args.scheduler,
        "max_num_seqs": args.max_num_seqs,
        "machine": machine(),
        "workload": {
            "num_prompts": len(prompts),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "output_dist": args.output_dist,
            "dataset": str(args.dataset) if args.dataset else None,
            "seed": args.workload_seed,
        },
        **result,
    }
    if args.json:
        print(dump_json(payload))
    else:
        print(
            f"ridge bench throughput: {args.model} {payload['dtype']} on {payload['device']}, "
            f"{args.scheduler} batching, max_num_seqs {args.max_num_seqs}"
        )
        print(
            f"  {result['requests']} requests in {result['elapsed_s']:.2f} s: "
            f"{result['requests_per_s']:.2f} req/s, {result['input_tokens_per_s']:.1f} tok/s in, "
            f"{result['output_tokens_per_s']:.1f} tok/s out"
        )
        print(engine.telemetry.format())
        if engine.speculator is not None:
            print(engine.speculator.format())
    return 0
