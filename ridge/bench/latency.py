"""``ridge bench latency``: prefill and decode step times against this machine's roofline.

Each round serves ``batch`` requests of ``--input-len`` prompt tokens and ``--output-len``
new tokens; the engine's telemetry gives each step's shape and wall time, the analyzer its
FLOPs and bytes. Memory bandwidth is probed right before and after every round (on these
machines it jumps between levels), so each floor is ``bytes / bandwidth measured in the
same round`` or ``FLOPs / measured peak``, whichever is larger. A step faster than its floor
re-probes the machine once and, if it still beats it, raises the roofline to its own rate
(``telemetry.Ceiling``): the report says so in its notes, and no fraction exceeds 100%. Where
ridge's CPU kernels time their matmuls, the report also splits the decode steps' time outside
them by kind of op (the telemetry's step parts: attention, norms, ...; "other" the rest).
"""

from __future__ import annotations

import argparse

from ridge.bench.common import dump_json, machine, random_prompts, summarize
from ridge.engine.args import add_engine_args, engine_options
from ridge.spec_decode.stats import SpecDecodeStats
from ridge.telemetry import Ceiling, PhaseStats, outside_matmuls, outside_matmuls_text


def register(subparsers) -> None:
    p = subparsers.add_parser("latency", help="batch prefill + decode step times vs the roofline floor")
    add_engine_args(p)
    p.add_argument("--batch", type=int, action="append", help="batch size (repeatable; default 1)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ridge.engine.llm import LLM

    if args.input_len < 1 or args.output_len < 2 or args.rounds < 1 or args.warmup_rounds < 0:
        raise ValueError("need --input-len >= 1, --output-len >= 2, --rounds >= 1, --warmup-rounds >= 0")
    if any(b < 1 for b in args.batch or []):
        raise ValueError("--batch must be >= 1")
    llm = LLM(args.model, **engine_options(args))
    results = [
        bench_latency(llm, batch, args.input_len, args.output_len, args.rounds, args.warmup_rounds)
        for batch in (args.batch or [1])
    ]
    engine = llm.engine
    payload = {
        "model": args.model,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "device": str(engine.device),
        "machine": machine(),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "results": results,
    }
    print(dump_json(payload) if args.json else format_latency(payload))
    return 0


def bench_latency(llm, batch: int, input_len: int, output_len: int, rounds: int, warmup_rounds: int = 1) -> dict:
    """Run warm-up + timed rounds at one batch size; medians and spreads with floors per round."""
    from ridge.roofline.probe import ProbeSettings, probe_read_bandwidth
    from ridge.sampling import SamplingParams

    engine, telemetry = llm.engine, llm.engine.telemetry
    ceiling = telemetry.ceiling  # the engine's roofline: its peak, kept honest across rounds
    probe = ProbeSettings(bandwidth_bytes=512 * 1024**2, bandwidth_repeats=3)
    on_cpu = engine.device.type == "cpu"

    def probe_round_bandwidth() -> float:
        return probe_read_bandwidth(probe).high if on_cpu else telemetry.hardware.bandwidth_bytes_per_s

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    notices: list[str] = []
    reprobed = []

    def reprobe_once() -> tuple[float, float]:
        """A step beat its floor: measure the machine again, once per batch size (a probe
        costs seconds); later calls only re-read this round's bandwidth."""
        if not reprobed:
            reprobed.append(telemetry.reprobe())
            ceiling.peak_flops = max(ceiling.peak_flops, reprobed[0][0])
        return ceiling.peak_flops, probe_round_bandwidth()

    prefill_rates, decode_ms, floors_ms, fractions, gbps, prefill_fracs, bandwidths = [], [], [], [], [], [], []
    decode_tokens, decode_time = 0, 0.0
    matmul_split = PhaseStats()  # the timed rounds' decode steps, where the kernels timed their matmuls
    speculator = engine.speculator
    for round_index in range(warmup_rounds + rounds):
        if speculator is not None and round_index == warmup_rounds:
            speculator.stats = SpecDecodeStats()  # count the timed rounds only
        # Fresh prompts for every batch size and round: no prefix-cache hits across rounds.
        seed = batch * 1000 + round_index
        prompts = random_prompts(batch, [input_len] * batch, engine.model_config.vocab_size, seed=seed)
        bw_before = probe_round_bandwidth()
        telemetry.reset()
        llm.generate(prompts, params, use_tqdm=False)
        bw_after = probe_round_bandwidth()
        if round_index < warmup_rounds:
            continue
        # This round's roofline: its own bandwidth, the engine's peak; re-probed and raised
        # (noted) if a step beats it.
        bandwidth = max(bw_before, bw_after)
        round_ceiling = Ceiling(ceiling.peak_flops, bandwidth, reprobe=reprobe_once, notices=notices)
        bandwidths.append(bandwidth)
        records = list(telemetry.recent)
        prefill = [r for r in records if r.phase != "decode"]
        # a decode step of the whole batch: plain rows, or verify runs of speculating sequences
        decode = [r for r in records if r.phase == "decode" and len(r.decode_contexts) + len(r.verify_chunks) == batch]
        decode_tokens += batch * (output_len - 1)  # every token after the first comes from a decode step
        decode_time += sum(r.wall_s for r in records if r.phase == "decode")
        prefill_time = sum(r.wall_s for r in prefill)
        prefill_tokens = sum(n for r in prefill for n, _ in r.prefill_chunks)  # computed, not cached
        prefill_rates.append(prefill_tokens / prefill_time)
        prefill_floor = sum(round_ceiling.step_floor_s(telemetry.price(r), r) for r in prefill)
        prefill_fracs.append(prefill_floor / prefill_time)
        for r in decode:
            cost = telemetry.price(r)
            floor = round_ceiling.step_floor_s(cost, r)
            decode_ms.append(r.wall_s * 1e3)
            floors_ms.append(floor * 1e3)
            fractions.append(floor / r.wall_s)
            gbps.append(cost.bytes / r.wall_s / 1e9)
            matmul_split.add_matmul_timing(r)
        ceiling.peak_flops = max(ceiling.peak_flops, round_ceiling.peak_flops)  # a raise holds for later rounds
    step = summarize(decode_ms)
    # With speculation a step emits several tokens per sequence: tokens over decode time.
    tokens_per_s = decode_tokens / decode_time if speculator is not None else batch * 1e3 / step["median"]
    return {
        "batch": batch,
        "bandwidth_gb_per_s": summarize([b / 1e9 for b in bandwidths]),
        "peak_gflop_per_s": ceiling.peak_flops / 1e9,
        "notices": notices,
        "prefill": {"tokens_per_s": summarize(prefill_rates), "roofline_fraction": summarize(prefill_fracs)},
        "decode": {
            "ms_per_step": step,
            "tokens_per_s": tokens_per_s,
            "floor_ms": summarize(floors_ms),
            "roofline_fraction": summarize(fractions),
            "achieved_gb_per_s": summarize(gbps),
            # the step's time outside its matmuls, by kind of op (CPU kernels; None elsewhere)
            "outside_matmuls": outside_matmuls(matmul_split.to_json()),
        },
        "speculation": speculator.report() if speculator is not None else None,
    }


def format_latency(payload: dict) -> str:
    m = payload["machine"]
    lines = [
        f"ridge bench latency: {payload['model']} {payload['dtype']} on {payload['device']} "
        f"({m['cpus']} cpus, {m['torch_threads']} threads, torch {m['torch']}, {m['date']})",
        f"prompt {payload['input_len']} tokens, {payload['output_len']} new tokens per request",
    ]
    for r in payload["results"]:
        d, p = r["decode"], r["prefill"]
        lines += [
            f"batch {r['batch']}: bandwidth probed {r['bandwidth_gb_per_s']['median']:.1f} GB/s "
            f"(range {r['bandwidth_gb_per_s']['min']:.1f}-{r['bandwidth_gb_per_s']['max']:.1f}), "
            f"peak {r['peak_gflop_per_s']:.0f} GFLOP/s",
            f"  prefill  {p['tokens_per_s']['median']:9.1f} tok/s (p10 {p['tokens_per_s']['p10']:.1f}, "
            f"p90 {p['tokens_per_s']['p90']:.1f})   {100 * p['roofline_fraction']['median']:5.1f}% of roofline",
            f"  decode   {d['ms_per_step']['median']:9.2f} ms/step (p10 {d['ms_per_step']['p10']:.2f}, "
            f"p90 {d['ms_per_step']['p90']:.2f})  {d['tokens_per_s']:.1f} tok/s",
            f"           floor {d['floor_ms']['median']:.2f} ms -> {100 * d['roofline_fraction']['median']:5.1f}% "
            f"of roofline, {d['achieved_gb_per_s']['median']:.1f} GB/s achieved",
            *([f"           {outside_matmuls_text(d['outside_matmuls'])}"] if d.get("outside_matmuls") else []),
            *(f"  note: {notice}" for notice in r["notices"]),
        ]
        spec = r.get("speculation")
        if spec:
            lines.append(
                f"  speculation ({spec['method']}): {spec['mean_accepted_length']:.2f} tokens per verify run, "
                f"acceptance {100 * spec['acceptance_rate']:.1f}%, k last {spec['last_k']}"
            )
    return "\n".join(lines)
