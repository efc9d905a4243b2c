"""Tensor parallelism on this machine, one interleaved run: TP=2 (one thread per rank, each
pinned to its own core) against TP=1 (two threads), decode at batch 1 and 32, bf16 and int4.

Every round runs each configuration's TP=1 and TP=2 engines back to back (the machine's
bandwidth drifts: compare within a round). Per configuration it reports the median decode
step, the time rank 0 spent in collectives per step (measured), and the analyzer's
prediction for both: the roofline floor per rank on this machine's probed roofline, and the
collectives on the probed link (gloo over loopback).

    python benchmarks/tensor_parallel.py [--rounds 3] [--model random:tinyllama-1.1b]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from ridge import LLM, SamplingParams
from ridge.distributed.probe import local_link
from ridge.roofline.ops import CostConventions
from ridge.roofline.probe import local_hardware
from ridge.telemetry import TORCH_TO_ROOFLINE_DTYPE

HERE = Path(__file__).parent
OUT = HERE / "tensor_parallel.json"
PROMPT_LEN, OUTPUT_LEN = 16, 40


def decode_steps(llm: LLM, batch: int, tp: int, cores: set[int]) -> dict:
    """Median decode step and collectives per step of one generate call of ``batch`` prompts."""
    # one process hosts both engines: give each its own thread layout while it runs
    os.sched_setaffinity(0, sorted(cores)[:1] if tp > 1 else cores)
    torch.set_num_threads(1 if tp > 1 else len(cores))
    engine = llm.engine
    engine.telemetry.reset()
    prompts = [[3 + (i * 7 + j) % 250 for j in range(PROMPT_LEN)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = [r for r in engine.telemetry.recent if r.phase == "decode" and len(r.decode_contexts) == batch]
    return {
        "step_s": statistics.median(r.wall_s for r in steps),
        "comm_s": statistics.median(r.comm_s for r in steps),
        "steps": len(steps),
        "wall_s": wall,
    }


def predicted(llm: LLM, batch: int, tp: int, hardware, link) -> dict:
    """The analyzer's decode step at mid-generation: roofline floor per rank + collectives."""
    context = PROMPT_LEN + OUTPUT_LEN // 2
    cost = llm.engine.telemetry.pricing.cost_from_counts(
        {(1, context): batch}, conventions=CostConventions(tensor_parallel=tp)
    )
    peak = hardware.peak(TORCH_TO_ROOFLINE_DTYPE[str(llm.engine.dtype)])
    floor = cost.time_s(peak, hardware.bandwidth_bytes_per_s)
    comm = link.time_s(cost.comm)
    return {"floor_s": floor, "comm_s": comm, "step_s": floor + comm, "link_bytes_per_rank": cost.comm.link_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tinyllama-1.1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, action="append", default=None)
    parser.add_argument("--config", action="append", default=None, help="bf16 and/or int4 (default: both)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    batches = args.batch or [1, 32]
    configs = args.config or ["bf16", "int4"]
    cores = os.sched_getaffinity(0)
    hardware, link = local_hardware(), local_link()
    results: dict = {}
    for config in configs:
        options = dict(
            dtype="bfloat16", max_num_seqs=max(batches), max_model_len=256, num_kv_blocks=max(batches) * 16 + 64
        )
        if config == "int4":
            options["quantization"] = "int4"
        single = LLM(args.model, num_threads=len(cores), **options)
        split = LLM(args.model, tensor_parallel_size=2, num_threads=len(cores), **options)
        rounds: dict = {b: {"tp1": [], "tp2": []} for b in batches}
        for r in range(args.rounds):
            for b in batches:
                rounds[b]["tp1"].append(decode_steps(single, b, 1, cores))
                rounds[b]["tp2"].append(decode_steps(split, b, 2, cores))
                one, two = rounds[b]["tp1"][-1], rounds[b]["tp2"][-1]
                print(
                    f"{config} batch {b} round {r}: TP=1 {1e3 * one['step_s']:.1f} ms, "
                    f"TP=2 {1e3 * two['step_s']:.1f} ms (collectives {1e3 * two['comm_s']:.1f} ms, "
                    f"{100 * two['comm_s'] / two['step_s']:.0f}%)",
                    flush=True,
                )
        for b in batches:
            tp1 = statistics.median(x["step_s"] for x in rounds[b]["tp1"])
            tp2 = statistics.median(x["step_s"] for x in rounds[b]["tp2"])
            comm = statistics.median(x["comm_s"] for x in rounds[b]["tp2"])
            results[f"{config}/batch{b}"] = {
                "tp1_step_s": tp1,
                "tp2_step_s": tp2,
                "tp2_comm_s": comm,
                "tp2_comm_share": comm / tp2,
                "tp2_comm_per_token_s": comm / b,
                "speedup": tp1 / tp2,
                "predicted_tp1": predicted(single, b, 1, hardware, link),
                "predicted_tp2": predicted(split, b, 2, hardware, link),
                "rounds": rounds[b],
            }
        split.close()
        del single, split
    os.sched_setaffinity(0, cores)
    payload = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": len(cores), "node": platform.node()},
        "hardware": {"name": hardware.name, "bandwidth_gb_per_s": hardware.bandwidth_bytes_per_s / 1e9},
        "link": {
            "name": link.name,
            "bandwidth_gb_per_s": link.bandwidth_bytes_per_s / 1e9,
            "latency_us": link.latency_s * 1e6,
        },
        "model": args.model,
        "rounds": args.rounds,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    for key, res in results.items():
        p1, p2 = res["predicted_tp1"], res["predicted_tp2"]
        print(
            f"{key}: TP=1 {1e3 * res['tp1_step_s']:.1f} ms (floor {1e3 * p1['step_s']:.1f}), TP=2 "
            f"{1e3 * res['tp2_step_s']:.1f} ms (predicted {1e3 * p2['step_s']:.1f} = floor {1e3 * p2['floor_s']:.1f} + "
            f"collectives {1e3 * p2['comm_s']:.1f}); measured collectives {1e3 * res['tp2_comm_s']:.1f} ms "
            f"({100 * res['tp2_comm_share']:.0f}% of the step); speedup {res['speedup']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
