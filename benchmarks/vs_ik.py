"""ridge against ik_llama.cpp's ``llama-bench`` on the same GGUF files: pp512 and tg64.

The issue's peer target: ridge's batch-1 decode (tg64) and its 512-token prefill (pp512) at
least what ik_llama.cpp, the fastest CPU engine known, gives on the same file and threads.
Each round runs, per file, ``llama-bench -m FILE -p 512 -n 64 -t THREADS -r 1 -o json`` and then
a fresh ridge process on the same file, alternated so that both see the same machine state
(the bandwidth moves between rounds; compare within a round).

ridge's figures, measured as llama-bench measures its own:
  - pp512: a 512-token prompt prefilled in one step (``max_num_batched_tokens`` 512), its
    step's wall time;
  - tg64: 64 greedy tokens after a 1-token prompt, tokens / the decode passes' wall time
    (``--num-scheduler-steps N``: ridge runs up to N passes a step, as llama-bench's loop runs
    its tokens without a host step between them; 1 by default).
Both after an untimed warm-up. Prompts are random token ids (the file's tokenizer is not used).

Prints per file the per-round figures and the median of the per-round ratios, and records
the run in ``benchmarks/vs_ik.json`` (one entry per CPU; a rerun replaces its entry).

    python benchmarks/vs_ik.py --llama-bench /path/to/ik_llama.cpp/build/bin/llama-bench \\
        --files model-q8_0.gguf,model-q4_k_m.gguf [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import write_cpu_entry

OUT = Path(__file__).with_name("vs_ik.json")


def ridge_worker(path: str, threads: int, steps: int = 1) -> dict:
    """{"pp512": tokens/s, "tg64": tokens/s} for one file, in this process."""
    import torch

    from ridge import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(
        path,
        tokenizer="bytes",
        dtype="bfloat16",
        max_model_len=1024,
        num_kv_blocks=256,
        max_num_seqs=1,
        max_num_batched_tokens=512,
        num_scheduler_steps=steps,
    )
    vocab = llm.engine.model_info.config.vocab_size
    prompt = torch.randint(3, min(vocab, 30000), (512,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:64]], SamplingParams(max_tokens=8, **greedy), use_tqdm=False)  # warm-up
    telemetry = llm.engine.telemetry
    telemetry.reset()
    llm.generate([prompt], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prefill_s = sum(r.wall_s for r in telemetry.recent if r.phase == "prefill")
    telemetry.reset()
    llm.generate([prompt[:1]], SamplingParams(max_tokens=65, **greedy), use_tqdm=False)
    decode = [r.wall_s for r in telemetry.recent if r.phase == "decode"]
    return {"pp512": 512 / prefill_s, "tg64": len(decode) / sum(decode)}


def run_ridge(path: str, threads: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", path, "--threads", str(threads), "--num-scheduler-steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ))
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_ik(binary: str, path: str, threads: int) -> dict:
    cmd = [binary, "-m", path, "-p", "512", "-n", "64", "-t", str(threads), "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    tests = json.loads(done.stdout)
    return {("pp512" if t["n_prompt"] else "tg64"): t["avg_ts"] for t in tests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", help="ik_llama.cpp's llama-bench binary")
    parser.add_argument("--files", help="comma-separated GGUF files")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="ridge's decode passes a step (tg64)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(ridge_worker(args.worker, args.threads, args.num_scheduler_steps)))
        return
    if not args.llama_bench or not args.files:
        parser.error("--llama-bench and --files are required")

    from ridge.roofline.probe import cpu_model

    files = args.files.split(",")
    runs = {f: {"ik": [], "ridge": []} for f in files}
    for r in range(args.rounds):
        for f in files:
            runs[f]["ik"].append(run_ik(args.llama_bench, f, args.threads))
            runs[f]["ridge"].append(run_ridge(f, args.threads, args.num_scheduler_steps))
            ik, ridge = runs[f]["ik"][-1], runs[f]["ridge"][-1]
            print(
                f"round {r + 1} {Path(f).name}: pp512 ik {ik['pp512']:.1f} ridge {ridge['pp512']:.1f}, "
                f"tg64 ik {ik['tg64']:.2f} ridge {ridge['tg64']:.2f} tokens/s",
                flush=True,
            )
    table = {}
    print(f"{cpu_model()}, {args.threads} threads, {args.rounds} rounds: ridge / ik, median of the per-round ratios")
    for f in files:
        entry = {"ik": runs[f]["ik"], "ridge": runs[f]["ridge"]}
        for test in ("pp512", "tg64"):
            ratios = [ridge[test] / ik[test] for ik, ridge in zip(runs[f]["ik"], runs[f]["ridge"])]
            entry[f"{test}_ratio"] = statistics.median(ratios)
            entry[f"{test}_ratios"] = ratios
        table[Path(f).name] = entry
        print(f"  {Path(f).name:32s} pp512 {entry['pp512_ratio']:.2f}x   tg64 {entry['tg64_ratio']:.2f}x")
    record = {
        "threads": args.threads,
        "rounds": args.rounds,
        "num_scheduler_steps": args.num_scheduler_steps,
        "date": time.strftime("%Y-%m-%d"),
        "files": table,
    }
    write_cpu_entry(OUT, cpu_model(), record)


if __name__ == "__main__":
    main()
