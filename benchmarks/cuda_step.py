"""Where a GPU decode step's time goes: the captured forward pass alone (a CUDA graph's replay,
timed with device events) against the whole engine step (scheduler, inputs, replay, logits,
sampling, outputs), and the engine's Python functions that take the rest.

    python benchmarks/cuda_step.py --model random:tinyllama-1.1b --batch 1 --batch 32
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from ridge import LLM, SamplingParams


def kernel_table(graph: torch.cuda.CUDAGraph, lines: int) -> None:
    """Each kernel of the graph's replay: calls per replay, total and mean device time."""
    from torch.profiler import ProfilerActivity, profile

    replays = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / replays
    print(f"-- kernels: {total:.1f} us of device time a replay")
    for e in events[:lines]:
        per = e.device_time_total / replays
        calls = e.count / replays
        print(f"   {per:8.1f} us {calls:6.1f} calls {per / max(calls, 1e-9):6.2f} us each  {e.key[:90]}")


def step_trace(llm, prompts, params, steps: int, lines: int) -> None:
    """One generate under torch.profiler (host and device): the device's kernel time a step,
    inside the graph's replay or not, and the CUDA runtime calls a step (launches, copies,
    synchronizations: where the host waits for the device)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    busy = sum(e.device_time_total for e in kernels) / steps
    print(f"-- trace: {busy:.1f} us of device time a step (prefill included, {steps} steps)")
    for e in kernels[:lines]:
        print(f"   {e.device_time_total / steps:8.1f} us {e.count / steps:6.1f} calls  {e.key[:90]}")
    runtime = [e for e in events if e.key.startswith("cuda") and e.device_time_total == 0]
    for e in sorted(runtime, key=lambda e: -e.cpu_time_total)[:lines]:
        print(f"   host {e.cpu_time_total / steps:8.1f} us {e.count / steps:6.1f} calls  {e.key[:60]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:tinyllama-1.1b")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--profile-lines", type=int, default=18)
    ap.add_argument("--kernel-lines", type=int, default=0, help="the replay's costliest kernels (torch.profiler)")
    ap.add_argument("--trace-lines", type=int, default=0, help="a generate's kernels and CUDA calls, a step")
    ap.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None, help="default: on (CUDA)"
    )
    args = ap.parse_args()
    llm = LLM(
        args.model,
        dtype="bfloat16",
        device="cuda",
        max_model_len=args.max_model_len,
        seed=0,
        async_scheduling=args.async_scheduling,
    )
    runner = llm.engine.executor.worker.runner
    results = []
    for batch in args.batch or [1]:
        prompts = [[(17 * i + j) % 1000 + 10 for j in range(128)] for i in range(batch)]
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        short = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, short)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompts, params)
        step_ms = (time.perf_counter() - start - prefill) / (args.new_tokens - 1) * 1e3
        replay_ms = None
        if runner.graphs is not None:
            graph, _ = runner.graphs.graphs[runner.graphs.size_for(batch)]
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            begin.record()
            for _ in range(100):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            replay_ms = begin.elapsed_time(end) / 100
            if args.kernel_lines:
                kernel_table(graph, args.kernel_lines)
        if args.trace_lines:
            step_trace(llm, prompts, params, args.new_tokens, args.trace_lines)
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(prompts, params)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile_lines)
        print(f"== batch {batch}: engine step {step_ms:.3f} ms, graph replay {replay_ms} ms")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-4000:])
        results.append({"batch": batch, "step_ms": step_ms, "replay_ms": replay_ms})
    print(json.dumps({"model": args.model, "device": torch.cuda.get_device_name(), "results": results}))


if __name__ == "__main__":
    main()
