"""Quantized weights and KV cache, one interleaved run: decode steps against each format's floor.

Every round runs every configuration once, with the memory bandwidth probed before and after
the round (these machines jump between bandwidth levels; compare only within a round):

* weights: a decode step (the model's forward + logits, as the engine runs it) at batch 1,
  8 and 32 with short contexts, for bf16, int8 (Q8_0) and int4 (Q4_0) weights; its floor is
  the bytes the loaded layers hold (plus the KV read) over that round's bandwidth;
* KV cache: the decode attention of one layer alone (the three caches alternated call by
  call, the median of ATTENTION_CALLS each a round; the ratio to bf16 is the median of the
  rounds' ratios), and a whole decode step, at batch 16 with 4,096-token contexts, for a
  bf16, int8 and fp8 cache (bf16 weights), beside what the analyzer (``roofline/ops.py``)
  predicts for the step on the probed roofline.

Steps are driven directly (hand-made attention metadata over a filled pool) so a 4,096-token
context needs no prefill. Writes ``benchmarks/quantized_decode.json``.

    python benchmarks/quantized_decode.py [--rounds 5] [--model random:tinyllama-1.1b]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from ridge.config import EngineConfig
from ridge.engine.engine import LLMEngine
from ridge.kv import cache as kv_cache
from ridge.layers.attention import AttentionMetadata
from ridge.roofline.probe import ProbeSettings, cpu_model, probe_read_bandwidth

OUT = Path(__file__).with_name("quantized_decode.json")
ATTENTION_CALLS = 9  # a round's attention calls per cache kind


def make_engine(model: str, blocks: int, quantization=None, kv_cache_dtype="auto") -> LLMEngine:
    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        device="cpu",
        num_kv_blocks=blocks,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=64,
    )
    engine = LLMEngine(config)
    fill_caches(engine.executor.worker.kv_caches)
    return engine


def fill_caches(caches) -> None:
    for cache in caches:  # any values: the timings do not depend on them
        for pool in (cache.k, cache.v):
            if pool.dtype is torch.int8:
                pool.random_(-127, 128)
            elif pool.dtype is torch.uint8:
                pool.random_(0, 0x7F)  # finite fp8 codes
            else:
                pool.normal_()
        for scales in (cache.k_scale, cache.v_scale):
            if scales is not None:
                scales.fill_(0.01)


def decode_meta(batch: int, context: int, block_size: int) -> tuple[AttentionMetadata, torch.Tensor]:
    per_seq = -(-context // block_size)
    tables = torch.arange(batch * per_seq).view(batch, per_seq)
    last = context - 1
    slots = tables[:, last // block_size] * block_size + last % block_size
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=batch,
        decode_block_tables=tables,
        decode_context_lens=torch.full((batch,), context),
    )
    return meta, torch.full((batch,), last)


def step_seconds(engine: LLMEngine, batch: int, context: int, caches=None) -> float:
    meta, positions = decode_meta(batch, context, engine.config.block_size)
    # RoPE's tables end at the model's context (TinyLlama's 2,048): a position only picks an
    # angle, the context's length sets the cost, so a longer context is timed at the last one
    positions = positions.clamp(max=engine.executor.worker.model.model.rotary.cos.shape[0] - 1)
    ids = torch.randint(3, 200, (batch,))
    t = time.perf_counter()
    with torch.inference_mode():
        hidden = engine.executor.worker.model(ids, positions, caches or engine.executor.worker.kv_caches, meta)
        engine.executor.worker.model.compute_logits(hidden)
    return time.perf_counter() - t


def attention_seconds(engine: LLMEngine, batch: int, context: int, caches) -> float:
    meta, _ = decode_meta(batch, context, engine.config.block_size)
    cfg = engine.model_config
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim).bfloat16()
    t = time.perf_counter()
    engine.executor.worker.model.kernels.decode_attention(q, caches[0], meta)
    return time.perf_counter() - t


def floor_seconds(
    engine: LLMEngine, batch: int, context: int, bandwidth: float, peak: float, kv_kind: str = "auto"
) -> tuple[float, float]:
    """(floor, predicted) of one decode step: the telemetry's own pricing of the step (the KV
    bytes of ``kv_kind``)."""
    cfg = engine.model_config
    kv_bytes = kv_cache.bytes_per_token_head(kv_kind, cfg.head_dim, engine.dtype) / cfg.head_dim
    pricing = dataclasses.replace(engine.telemetry.pricing, kv_bytes=kv_bytes)
    cost = pricing.cost((), tuple([context] * batch))
    return cost.bytes / bandwidth, max(cost.flops / peak, cost.bytes / bandwidth)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:tinyllama-1.1b")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    kv_batch, kv_context, block = 16, 4096, 16
    blocks = kv_batch * kv_context // block + 64
    # One model per weight format; the KV caches of the three kinds share the bf16 model
    # (six engines of a 1.1B model did not fit beside their pools in 24 GiB).
    weights = {
        "bf16": make_engine(args.model, blocks),
        "int8": make_engine(args.model, 256, quantization="int8"),
        "int4": make_engine(args.model, 256, quantization="int4"),
    }
    base = weights["bf16"]
    kv = {"bf16": base.executor.worker.kv_caches}
    for kind in ("int8", "fp8"):
        kv[kind] = kv_cache.allocate(
            base.executor.worker.info.kv_spec, blocks, block, torch.bfloat16, torch.device("cpu"), kind
        )
        fill_caches(kv[kind])
    peak = weights["bf16"].telemetry.ceiling.peak_flops
    probe = ProbeSettings(bandwidth_bytes=512 * 1024**2, bandwidth_repeats=3)
    batches, short_context = (1, 8, 32), 64
    rows: list[dict] = []
    for engine in weights.values():  # warm-up
        step_seconds(engine, 1, short_context)
    for r in range(args.rounds):
        bw_before = probe_read_bandwidth(probe).high
        round_rows = []
        for name, engine in weights.items():
            for b in batches:
                round_rows.append(
                    {"what": "weights", "format": name, "batch": b, "s": step_seconds(engine, b, short_context)}
                )
        # one layer's attention, the three caches alternated call by call (one call each
        # swung 2-3x with the memory's level), the median of each
        calls = {name: [] for name in kv}
        for _ in range(ATTENTION_CALLS):
            for name, caches in kv.items():
                calls[name].append(attention_seconds(base, kv_batch, kv_context, caches))
        for name, caches in kv.items():
            attention = statistics.median(calls[name])
            round_rows.append({"what": "kv_attention", "format": name, "batch": kv_batch, "s": attention})
            step = step_seconds(base, kv_batch, kv_context, caches)
            round_rows.append({"what": "kv_step", "format": name, "batch": kv_batch, "s": step})
        bw = min(bw_before, probe_read_bandwidth(probe).high)
        for row in round_rows:
            if row["what"] == "weights":
                floors = floor_seconds(weights[row["format"]], row["batch"], short_context, bw, peak)
            else:
                kind = "auto" if row["format"] == "bf16" else row["format"]
                floors = floor_seconds(base, row["batch"], kv_context, bw, peak, kind)
            row["floor_s"], row["predicted_s"] = floors
            row["round"], row["bandwidth"] = r, bw
        rows += round_rows
        print(f"round {r}: {bw / 1e9:.1f} GB/s", flush=True)

    def median(what, fmt, batch, key="s"):
        return statistics.median(
            x[key] for x in rows if x["what"] == what and x["format"] == fmt and x["batch"] == batch
        )

    def of(what, fmt):  # the rows of one measurement, round by round
        return [x for x in rows if x["what"] == what and x["format"] == fmt and x["batch"] == kv_batch]

    summary = {"weights": {}, "kv": {}}
    for name in weights:
        for b in batches:
            s = median("weights", name, b)
            fraction = statistics.median(
                x["floor_s"] / x["s"]
                for x in rows
                if x["what"] == "weights" and x["format"] == name and x["batch"] == b
            )
            summary["weights"][f"{name} b{b}"] = {
                "ms": s * 1e3,
                "of_floor": fraction,
                "vs_bf16": median("weights", "bf16", b) / s,
            }
    for name in kv:
        summary["kv"][name] = {
            "attention_ms": median("kv_attention", name, kv_batch) * 1e3,
            "attention_vs_bf16": statistics.median(  # the same round's ratio, then the median
                base_row["s"] / row["s"] for base_row, row in zip(of("kv_attention", "bf16"), of("kv_attention", name))
            ),
            "step_ms": median("kv_step", name, kv_batch) * 1e3,
            "step_vs_bf16": median("kv_step", "bf16", kv_batch) / median("kv_step", name, kv_batch),
            "predicted_step_ms": median("kv_step", name, kv_batch, "predicted_s") * 1e3,
            "bytes_per_token_head": kv_cache.bytes_per_token_head(
                "auto" if name == "bf16" else name, base.model_config.head_dim, torch.bfloat16
            ),
        }
    payload = {
        "machine": cpu_model(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "rounds": args.rounds,
        "kv_batch": kv_batch,
        "kv_context": kv_context,
        "summary": summary,
        "rows": rows,
    }
    OUT.write_text(json.dumps(payload, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
