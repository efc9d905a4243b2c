"""Prefill attention on ridge's CPU kernels against torch's path, in whole prefills.

The CPU kernels run a prompt's attention as each query's decode over the context up to it
(``CpuKernels.prefill_attention``, ``Avx2Kernels.prefill_attention``); torch's path is
scaled_dot_product_attention over the gathered context. Loads the model twice in one process,
one engine with its kernels' prefill attention and one with torch's in its place (every other
op the same), and alternates them round by round: a ``--tokens``-token prompt (a new one each
round, no prefix cache), one token out. Per engine: the median prefill and the median time
inside prefill attention. Prints a table and records the run in
``benchmarks/prefill_attention.json`` (one entry per CPU, model, weights, kernels and length).

    python benchmarks/prefill_attention.py --model /path/to/model-Q4_K_M.gguf --kernels avx2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import types
from pathlib import Path

from common import cpu_engine_options

from ridge import LLM, SamplingParams
from ridge.layers.kernels import TorchKernels
from ridge.roofline.probe import cpu_model

OUT = Path(__file__).with_name("prefill_attention.json")


def timed_attention(kernels, torch_path: bool) -> list[float]:
    """Time each prefill_attention call of these kernels (torch's path in their place where asked)."""
    spent = [0.0]
    run = types.MethodType(TorchKernels.prefill_attention, kernels) if torch_path else kernels.prefill_attention

    def timed(q, k, v, cache, chunk):
        start = time.perf_counter()
        out = run(q, k, v, cache, chunk)
        spent[0] += time.perf_counter() - start
        return out

    kernels.prefill_attention = timed
    return spent


def prefill_round(llm: LLM, spent: list[float], tokens: int, seed: int) -> tuple[float, float]:
    """(prefill seconds, seconds in prefill attention) of one new prompt."""
    engine = llm.engine
    spent[0] = 0.0
    engine.add_request(None, [(7 * i + 1009 * seed) % 30000 + 5 for i in range(tokens)], SamplingParams(max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start, spent[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a GGUF file, an HF directory or random:<preset>")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kernels", default="auto", help="auto, or avx2: the AVX2 kernels on an AVX-512 CPU too")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=OUT)
    args = p.parse_args()
    options = cpu_engine_options(args, num_kv_blocks=args.tokens // 16 + 16, max_num_batched_tokens=args.tokens)
    engines, spent = {}, {}
    for name in ("kernels", "torch"):
        engines[name] = LLM(args.model, **options)
        spent[name] = timed_attention(engines[name].engine.executor.worker.model.kernels, name == "torch")
        prefill_round(engines[name], spent[name], 64, seed=999)  # warm-up
    rounds = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():  # alternated: both see the same machine state
            wall, attention = prefill_round(llm, spent[name], args.tokens, seed=r)
            rounds[name].append({"prefill_ms": wall * 1e3, "attention_ms": attention * 1e3})
    kernels = type(engines["kernels"].engine.executor.worker.model.kernels).__name__
    print(f"{args.model} ({kernels}, {args.tokens}-token prefill), ms:")
    for name, rows in rounds.items():
        prefill = statistics.median(r["prefill_ms"] for r in rows)
        attention = statistics.median(r["attention_ms"] for r in rows)
        print(f"  {name:8s} prefill {prefill:.0f}, of it attention {attention:.0f}")
    speedups = [t["prefill_ms"] / k["prefill_ms"] for k, t in zip(rounds["kernels"], rounds["torch"])]
    print(f"  kernels / torch prefill speed per round: {', '.join(f'{s:.2f}x' for s in speedups)}")
    result = {
        "config": vars(args) | {"json": str(args.json)},
        "machine": {"cpu": cpu_model(), "kernels": kernels, "python": platform.python_version()},
        "measured_at": time.strftime("%Y-%m-%d"),
        "rounds": rounds,
        "speedup_per_round": speedups,
    }
    runs = json.loads(args.json.read_text()) if args.json.is_file() else {}
    weights = args.quantization or "as loaded"
    runs[f"{cpu_model()} {Path(args.model).name} weights={weights} {kernels} {args.tokens}"] = result
    args.json.write_text(json.dumps(runs, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
