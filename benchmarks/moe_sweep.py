"""MoE decode from batch 1 to 64: measured step time and experts touched beside the analyzer's
prediction, and the same model as a GGUF file against llama.cpp.

Part 1 (the sweep). The Qwen3-MoE-shaped random model (``random:qwen3-moe-4b``: 32 experts,
top-4) in bf16 and int4, the formats interleaved at each batch size, each round between two
bandwidth probes. Per decode step of the whole batch the engine records its wall time and the
distinct experts each MoE layer read (mean over layers). Beside them:

- expected experts: the analyzer's E (1 - (1 - k/E)^B) for B tokens (uniform routing);
- predicted step: the analyzer's roofline time of that step (each operator at max(bytes /
  bandwidth of the round, FLOPs / the engine's peak), summed: ``StepCost.time_s``) with the
  *expected* experts: its prediction made without looking at the router;
- floor: the same roofline time with the experts the step actually touched (what the
  telemetry reports).

Part 2 (llama.cpp). The same weights written as a qwen3moe GGUF (bf16, and Q4_0 by
llama.cpp's own quantizer); ridge and llama.cpp each load the file and decode batches of 1
and 32 sequences, interleaved per round (``ridge.bench.peers``' runners: each step timed, greedy).

    python benchmarks/moe_sweep.py --json benchmarks/moe_sweep.json --png benchmarks/moe_sweep.png
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ridge import LLM
from ridge.bench.common import machine, random_prompts
from ridge.roofline.probe import ProbeSettings, probe_read_bandwidth
from ridge.sampling import SamplingParams

QUANTIZATION = {"bf16": None, "int4": "int4", "int8": "int8"}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def bandwidth() -> float:
    return probe_read_bandwidth(ProbeSettings(bandwidth_bytes=512 * 1024**2, bandwidth_repeats=3)).high


def sweep_point(llm, batch: int, args, seed: int) -> dict:
    """One generate of ``batch`` sequences; the decode steps of the whole batch, priced."""
    engine, telemetry = llm.engine, llm.engine.telemetry
    prompts = random_prompts(batch, [args.input_len] * batch, engine.model_config.vocab_size, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    bw_before = bandwidth()
    telemetry.reset()
    llm.generate(prompts, params, use_tqdm=False)
    bw = max(bw_before, bandwidth())
    peak = telemetry.ceiling.peak_flops
    pricing = telemetry.pricing
    steps = [r for r in telemetry.recent if r.phase == "decode" and len(r.decode_contexts) == batch]
    rows = []
    for r in steps:
        priced = {}
        for label, touched in (("predicted", None), ("floor", r.experts_touched)):
            cost = pricing.cost((), r.decode_contexts, experts_touched=touched)
            priced[label] = cost.time_s(peak, bw)  # each op at its own bound, summed (ridge's one floor)
        rows.append((r.wall_s, r.experts_touched, priced["predicted"], priced["floor"]))
    expected = pricing.model.moe.expected_experts_touched(batch)
    return {
        "batch": batch,
        "bandwidth_gb_per_s": bw / 1e9,
        "ms_per_step": statistics.median(w for w, *_ in rows) * 1e3,
        "predicted_ms": statistics.median(p for *_, p, _ in rows) * 1e3,
        "floor_ms": statistics.median(f for *_, f in rows) * 1e3,
        "experts_touched": statistics.mean(t for _, t, *_ in rows),
        "experts_expected": expected,
        "steps": len(rows),
    }


def run_sweep(args) -> list[dict]:
    engines = {}
    for fmt in args.formats:
        log(f"loading {args.model} ({fmt})")
        engines[fmt] = LLM(
            args.model,
            dtype="bfloat16",
            quantization=QUANTIZATION[fmt],
            num_kv_blocks=max(args.batches) * (args.input_len + args.output_len) // 16 + 64,
            max_num_seqs=max(args.batches),
            max_num_batched_tokens=max(2048, args.input_len * max(args.batches)),
            seed=0,
        )
    for llm in engines.values():  # warm-up: kernels, allocator, page faults of the KV pool
        sweep_point(llm, max(args.batches), args, seed=1)
    points = {(fmt, b): [] for fmt in args.formats for b in args.batches}
    for round_index in range(args.rounds):
        for batch in args.batches:
            for fmt, llm in engines.items():  # interleaved: both formats see the same machine state
                point = sweep_point(llm, batch, args, seed=100 * round_index + batch)
                points[(fmt, batch)].append(point)
                log(
                    f"round {round_index} {fmt} batch {batch}: {point['ms_per_step']:.1f} ms "
                    f"(predicted {point['predicted_ms']:.1f}), experts {point['experts_touched']:.2f} "
                    f"(expected {point['experts_expected']:.2f})"
                )
    del engines
    gc.collect()
    rows = []
    for (fmt, batch), runs in points.items():
        med = {k: statistics.median(p[k] for p in runs) for k in runs[0] if k not in ("batch",)}
        rows.append(
            {
                "format": fmt,
                "batch": batch,
                **med,
                "tokens_per_s": batch * 1e3 / med["ms_per_step"],
                "predicted_over_measured": med["predicted_ms"] / med["ms_per_step"],
                "floor_over_measured": med["floor_ms"] / med["ms_per_step"],
                "experts_touched_over_expected": med["experts_touched"] / med["experts_expected"],
            }
        )
    return rows


def export_gguf(args) -> dict[str, Path]:
    """The model's weights as qwen3moe GGUF files (bf16; Q4_0 by llama.cpp's quantizer), cached."""
    from ridge.bench.peers import quantize_gguf
    from ridge.models.export import hf_state_dict, write_gguf

    directory = Path(args.gguf_dir)
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "model-bf16.gguf"
    if not source.is_file():
        log(f"writing {source}")
        # torch kernels: the weights stay as loaded, so the export reads them without a copy
        llm = LLM(args.model, dtype="bfloat16", kernels="torch", num_kv_blocks=16, seed=0)
        tmp = source.with_suffix(".tmp")
        write_gguf(hf_state_dict(llm), llm.engine.hf_config, tmp)
        tmp.rename(source)
        del llm
        gc.collect()
    files = {"bf16": source}
    for fmt in args.gguf_formats:
        if fmt != "bf16":
            files[fmt] = quantize_gguf(source, fmt, threads=torch.get_num_threads())
    return files


def run_llama_cpp(args) -> list[dict]:
    from ridge.bench.peers import LlamaCppRunner, RidgeRunner

    files = export_gguf(args)
    results = []
    for fmt in args.gguf_formats:
        path = files[fmt]
        log(f"{fmt}: ridge and llama.cpp on {path.name}")
        runners = [
            RidgeRunner(
                LLM(
                    str(path),
                    tokenizer="bytes",
                    num_kv_blocks=max(args.gguf_batches) * (args.input_len + args.output_len) // 16 + 64,
                    max_num_seqs=max(args.gguf_batches),
                    max_num_batched_tokens=max(2048, args.input_len * max(args.gguf_batches)),
                ),
                "ridge",
            ),
            LlamaCppRunner(path, threads=torch.get_num_threads(), context_per_seq=args.input_len + args.output_len),
        ]
        vocab = 32000
        times: dict[tuple[str, int], list[float]] = {}
        agreement: dict[int, list[float]] = {}
        for round_index in range(args.rounds + 1):  # the first round warms up
            for batch in args.gguf_batches:
                prompts = random_prompts(batch, [args.input_len] * batch, vocab, seed=7 * round_index + batch)
                tokens = {}
                for runner in runners:
                    timed = runner.run_batch(prompts, args.output_len)
                    tokens[runner.name] = timed.tokens
                    if round_index:
                        times.setdefault((runner.name, batch), []).append(statistics.median(timed.decode_s) * 1e3)
                pairs = [(a, b) for x, y in zip(tokens["ridge"], tokens["llama.cpp"]) for a, b in zip(x, y)]
                agreement.setdefault(batch, []).append(sum(a == b for a, b in pairs) / len(pairs))
                log(
                    f"{fmt} batch {batch}: "
                    + ", ".join(f"{n} {v[-1]:.1f} ms" for (n, b), v in times.items() if b == batch)
                )
        for runner in runners:
            runner.close()
        del runners
        gc.collect()
        for batch in args.gguf_batches:
            ridge_ms = statistics.median(times[("ridge", batch)])
            llama_ms = statistics.median(times[("llama.cpp", batch)])
            results.append(
                {
                    "format": fmt,
                    "batch": batch,
                    "ridge_ms_per_step": ridge_ms,
                    "llama_cpp_ms_per_step": llama_ms,
                    "ridge_speedup": llama_ms / ridge_ms,
                    "greedy_token_agreement": statistics.mean(agreement[batch]),
                }
            )
    return results


def format_report(payload: dict) -> str:
    lines = [f"{payload['model']} on {payload['machine'].get('processor', '?')} ({payload['threads']} threads)"]
    lines.append("format batch  ms/step  predicted  floor  pred/meas  experts  expected  ratio")
    for r in payload["sweep"]:
        lines.append(
            f"{r['format']:>6} {r['batch']:>5} {r['ms_per_step']:8.1f} {r['predicted_ms']:10.1f} {r['floor_ms']:6.1f}"
            f" {r['predicted_over_measured']:10.2f} {r['experts_touched']:8.2f} {r['experts_expected']:9.2f}"
            f" {r['experts_touched_over_expected']:6.3f}"
        )
    if payload.get("llama_cpp"):
        lines.append("GGUF   batch  ridge ms  llama.cpp ms  ridge speedup  token agreement")
        for r in payload["llama_cpp"]:
            lines.append(
                f"{r['format']:>6} {r['batch']:>5} {r['ridge_ms_per_step']:9.1f} {r['llama_cpp_ms_per_step']:13.1f}"
                f" {r['ridge_speedup']:14.2f} {r['greedy_token_agreement']:16.2f}"
            )
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"bf16": "tab:blue", "int4": "tab:orange", "int8": "tab:green"}
    for fmt in dict.fromkeys(r["format"] for r in payload["sweep"]):
        rows = [r for r in payload["sweep"] if r["format"] == fmt]
        b = [r["batch"] for r in rows]
        c = colors.get(fmt, None)
        ax1.plot(b, [r["ms_per_step"] for r in rows], "o-", color=c, label=f"{fmt} measured")
        ax1.plot(b, [r["predicted_ms"] for r in rows], "--", color=c, label=f"{fmt} analyzer (expected experts)")
        ax2.plot(b, [r["experts_touched"] for r in rows], "o", color=c, label=f"{fmt} measured")
    rows = [r for r in payload["sweep"] if r["format"] == payload["sweep"][0]["format"]]
    ax2.plot([r["batch"] for r in rows], [r["experts_expected"] for r in rows], "k--", label="E(1-(1-k/E)^B)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch (sequences)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("ms per decode step")
    ax1.set_title(f"{payload['model']}: step time vs the analyzer")
    ax2.set_ylabel("distinct experts per MoE layer per step")
    ax2.set_title("experts touched (32 experts, top-4)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:qwen3-moe-4b")
    parser.add_argument("--formats", default="bf16,int4")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf-formats", default="bf16,q4_0")
    parser.add_argument("--gguf-batches", default="1,32")
    parser.add_argument("--gguf-dir", default="/tmp/ridge-moe-gguf")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/moe_sweep.json"))
    parser.add_argument("--png", type=Path, default=Path("benchmarks/moe_sweep.png"))
    args = parser.parse_args(argv)
    args.formats = args.formats.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.gguf_formats = args.gguf_formats.split(",")
    args.gguf_batches = [int(b) for b in args.gguf_batches.split(",")]
    torch.set_num_threads(args.threads)

    payload = {
        "model": args.model,
        "machine": machine(),
        "threads": args.threads,
        "args": vars(args) | {"json": None, "png": None},
    }
    if args.json.is_file():  # keep the other part when only one is rerun
        previous = json.loads(args.json.read_text())
        payload["sweep"], payload["llama_cpp"] = previous.get("sweep"), previous.get("llama_cpp")
    if not args.skip_sweep:
        payload["sweep"] = run_sweep(args)
    if not args.skip_llama_cpp:
        payload["llama_cpp"] = run_llama_cpp(args)
    args.json.write_text(json.dumps(payload, indent=2, default=str))
    print(format_report(payload))
    if args.png and payload.get("sweep"):
        plot(payload, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
