"""Disaggregated against colocated serving on this 2-core machine, one interleaved run.

    colocated       one ``ridge serve`` with both cores (two threads)
    disaggregated   a kv_producer pinned to core 0 and a kv_consumer pinned to core 1 (one
                    thread each), behind ``ridge router``

Each round sends both the same load, one after the other (the order alternates by round):
``--streams`` greedy streams decode all the time (short prompts, long outputs, cut once the
last long prompt has finished) while a ``--prompt-len``-token prompt arrives every
``--interval`` seconds (``--prompts`` of them, ``--long-output`` tokens each). Per
configuration: the decode users' inter-token
latency (gaps between their streamed tokens while the long prompts are in the system), the
long prompts' time to first token, the streams' decode throughput, whether the greedy outputs
of the same requests agree, and each KV transfer's measured time (the consumer's ``/kv/info``)
beside the analyzer's estimate (``ridge.roofline.disaggregation``, this machine's probed
roofline and gloo link).

    python benchmarks/disaggregated.py [--rounds 2] [--model random:tinyllama-1.1b] [--quantization int4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ridge.bench.common import summarize
from ridge.bench.serve import free_port, wait_healthy
from ridge.distributed.probe import local_link
from ridge.roofline.analyze import Workload
from ridge.roofline.disaggregation import ServingPattern, analyze_disaggregation
from ridge.roofline.ops import Precision
from ridge.roofline.probe import local_hardware
from ridge.roofline.shapes import load_model_shape
from ridge.stats import percentile

HERE = Path(__file__).parent
OUT = HERE / "disaggregated.json"


def serve(args, port: int, cores: set[int], threads: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ridge.cli", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--num-threads", str(threads), "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    cmd += ["--disable-access-log", *(["--quantization", args.quantization] if args.quantization else []), *flags]
    return subprocess.Popen(cmd, preexec_fn=lambda: os.sched_setaffinity(0, cores), stderr=subprocess.DEVNULL)


async def stream_once(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, record: dict) -> None:
    """One streamed completion into ``record``: when each token's event arrived, and the text
    (filled as it comes, so a stream cancelled midway keeps what it got)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    record.update(prompt=prompt, start=time.monotonic(), times=[], text=[], done=False)
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"]:  # one event per step that produced a token (its text may be held back)
                record["times"].append(time.monotonic())
                record["text"].append(chunk["choices"][0]["text"])
    record["done"] = True


async def run_load(url: str, args, round_no: int) -> dict:
    """The round's load against one front: ``streams`` long decodes run while the long
    prompts arrive; the decodes are cancelled once the last long prompt has finished."""
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=limits) as client:
        decoded = [{} for _ in range(args.streams)]
        longs = [{} for _ in range(args.prompts)]
        decoders = [
            asyncio.create_task(stream_once(client, url, f"Round {round_no} stream {i}: ", args.stream_output, rec))
            for i, rec in enumerate(decoded)
        ]

        async def long_prompt(j: int) -> None:
            await asyncio.sleep(args.warmup + j * args.interval)
            # new text every round and prompt: nothing in the prefix cache
            filler = "".join(chr(97 + (round_no * 5 + j * 7 + n * 13) % 26) for n in range(args.prompt_len - 24))
            await stream_once(client, url, f"Round {round_no} long {j}: {filler}", args.long_output, longs[j])

        start = time.monotonic()
        await asyncio.gather(*(long_prompt(j) for j in range(args.prompts)))
        end = time.monotonic()
        for task in decoders:
            task.cancel()
        await asyncio.gather(*decoders, return_exceptions=True)
    if not all(r.get("done") for r in longs) or any(len(r.get("times", ())) < 2 for r in decoded):
        raise RuntimeError("a stream failed or never produced tokens: the window is too short")
    window = (start + args.warmup, max(r["times"][-1] for r in longs))
    # every gap between two tokens of a stream that overlaps the window (a stall included)
    gaps = [b - a for r in decoded for a, b in zip(r["times"], r["times"][1:]) if b >= window[0] and a <= window[1]]
    tokens = sum(1 for r in decoded for t in r["times"] if window[0] <= t <= window[1])
    itl = summarize(gaps) | {"p99": percentile(gaps, 99), "mean": statistics.fmean(gaps) if gaps else float("nan")}
    return {
        "itl_s": itl,
        "ttft_s": [r["times"][0] - r["start"] for r in longs],
        "decode_tokens_per_s": tokens / (window[1] - window[0]),
        "window_s": window[1] - window[0],
        "wall_s": end - start,
        "outputs": {r["prompt"]: (r["text"], r["done"]) for r in longs + decoded},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tinyllama-1.1b")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument(
        "--stream-output",
        type=int,
        default=1500,
        help="tokens a decode stream asks for (it is cut at the window's end)",
    )
    parser.add_argument("--prompts", type=int, default=3, help="long prompts per round")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--long-output", type=int, default=8)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of decoding before the first prompt")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    ports = {name: free_port() for name in ("colocated", "prefill", "decode", "router")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    kv = lambda role: json.dumps({"kv_role": role, "kv_port": free_port()})  # noqa: E731
    procs = {
        "colocated": serve(args, ports["colocated"], set(cores[:2]), 2),
        "prefill": serve(args, ports["prefill"], {cores[0]}, 1, "--kv-transfer-config", kv("kv_producer")),
        "decode": serve(args, ports["decode"], {cores[1]}, 1, "--kv-transfer-config", kv("kv_consumer")),
    }
    router_cmd = [sys.executable, "-m", "ridge.cli", "router", "--port", str(ports["router"]), "--log-level", "warning"]
    router_cmd += ["--prefill", url["prefill"], "--decode", url["decode"]]
    procs["router"] = subprocess.Popen(router_cmd, stderr=subprocess.DEVNULL)
    results: dict = {"colocated": [], "disaggregated": []}
    try:
        for name in ("colocated", "prefill", "decode", "router"):
            wait_healthy(url[name], procs[name], timeout_s=900)
        for r in range(args.rounds):
            order = ["colocated", "disaggregated"] if r % 2 == 0 else ["disaggregated", "colocated"]
            for config in order:
                front = url["colocated" if config == "colocated" else "router"]
                res = asyncio.run(run_load(front, args, r))
                results[config].append(res)
                itl = res["itl_s"]
                print(
                    f"round {r} {config}: ITL p50 {itl['median'] * 1e3:.0f} ms, p99 {itl['p99'] * 1e3:.0f} ms, "
                    f"max {itl['max'] * 1e3:.0f} ms; TTFT {[round(t, 1) for t in res['ttft_s']]} s; "
                    f"decode {res['decode_tokens_per_s']:.1f} tok/s",
                    flush=True,
                )
        transfers = httpx.get(f"{url['decode']}/kv/info", timeout=10).json()["recent_transfers"]
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    # the same requests, the same greedy outputs: whole for finished requests, token by token
    # over what both streams got for the decodes cancelled at the end of the window
    agree = total = compared_tokens = 0
    for co, dis in zip(results["colocated"], results["disaggregated"]):
        for prompt, (tokens_a, done_a) in co["outputs"].items():
            tokens_b, done_b = dis["outputs"][prompt]
            n = len(tokens_a) if done_a and done_b else min(len(tokens_a), len(tokens_b))
            total += 1
            compared_tokens += n
            agree += tokens_a[:n] == tokens_b[:n] and (not (done_a and done_b) or len(tokens_a) == len(tokens_b))

    shape = load_model_shape(args.model.removeprefix("random:"))
    precision = Precision.for_weight_format(args.quantization, 16, 16) if args.quantization else Precision(16, 16, 16)
    pattern = ServingPattern(args.prompt_len, args.interval, args.streams, decode_context=256)
    hardware, link = local_hardware(), local_link(transport="gloo")
    predicted = analyze_disaggregation(shape, hardware, pattern, link, Workload(precision=precision))
    long_transfers = [t for t in transfers if t["blocks"] >= args.prompt_len // 32]

    def med(config: str, key: str) -> float:
        return statistics.median(x["itl_s"][key] for x in results[config])

    summary = {
        "itl_p50_ms": {c: med(c, "median") * 1e3 for c in results},
        "itl_p99_ms": {c: med(c, "p99") * 1e3 for c in results},
        "itl_p99_ratio": med("colocated", "p99") / med("disaggregated", "p99"),
        "ttft_median_s": {c: statistics.median(t for x in results[c] for t in x["ttft_s"]) for c in results},
        "decode_tokens_per_s": {c: statistics.median(x["decode_tokens_per_s"] for x in results[c]) for c in results},
        "greedy_outputs_identical": f"{agree}/{total} requests ({compared_tokens} tokens compared)",
        "transfer_ms": [t["seconds"] * 1e3 for t in long_transfers],
        "transfer_mb": [t["bytes"] / 1e6 for t in long_transfers],
        "predicted": {
            "kv_mb": predicted.kv_bytes / 1e6,
            "transfer_ms": predicted.transfer_s * 1e3,
            "itl_p99_ms": {
                "colocated": predicted.colocated.itl_p99_s * 1e3,
                "disaggregated": predicted.disaggregated.itl_p99_s * 1e3,
            },
            "ttft_s": {"colocated": predicted.colocated.ttft_s, "disaggregated": predicted.disaggregated.ttft_s},
            "link": {
                "name": link.name,
                "gb_per_s": link.bandwidth_bytes_per_s / 1e9,
                "latency_us": link.latency_s * 1e6,
            },
        },
    }
    for config in results:
        for res in results[config]:
            del res["outputs"]
    payload = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": len(cores), "node": platform.node()},
        "hardware": {"name": hardware.name, "bandwidth_gb_per_s": hardware.bandwidth_bytes_per_s / 1e9},
        "model": args.model,
        "quantization": args.quantization,
        "args": vars(args),
        "summary": summary,
        "rounds": results,
        "transfers": transfers,
    }
    Path(args.out).write_text(json.dumps(payload, indent=2, default=float) + "\n")
    print(json.dumps(summary, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
