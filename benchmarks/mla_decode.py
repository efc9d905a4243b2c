"""DeepSeek's latent attention at long context: the cache ridge keeps, and absorbed decode
against the expanded form.

The DeepSeek-V3-shaped random model (``random:deepseek-v3-small``) serves ``--batch``
sequences of ``--context`` prompt tokens, then decodes ``--output-len`` tokens, once with
each decode form, interleaved over rounds (the prompts stay the same, so after the first
round the prefix cache holds them and only decode differs):

- absorbed (ridge's default): W_uk folded into the query, W_uv into the output; a step reads
  each sequence's latents, (kv_lora_rank + qk_rope_head_dim) values per token and layer;
- expanded: every step runs each sequence's whole latent context through kv_b_proj into
  per-head keys and values (nope + rope and v per head), then ordinary attention.

It also reports the KV bytes per token the engine allocates beside the analyzer's count and
beside what a standard (non-latent) cache of the same heads would hold.

    python benchmarks/mla_decode.py --json benchmarks/mla_decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ridge import LLM
from ridge.bench.common import machine, random_prompts
from ridge.models.deepseek import DeepseekAttention
from ridge.roofline.probe import ProbeSettings, probe_read_bandwidth
from ridge.sampling import SamplingParams


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def set_form(llm, absorbed: bool) -> None:
    for module in llm.engine.executor.worker.model.modules():
        if isinstance(module, DeepseekAttention):
            module.absorb_decode = absorbed


def decode_steps(llm, prompts, output_len: int) -> tuple[list[float], list[float]]:
    """Wall time and floor (analyzer bytes / probed bandwidth) of each full-batch decode step."""
    telemetry = llm.engine.telemetry
    telemetry.reset()
    bw = probe_read_bandwidth(ProbeSettings(bandwidth_bytes=512 * 1024**2, bandwidth_repeats=3)).high
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    steps = [r for r in telemetry.recent if r.phase == "decode" and len(r.decode_contexts) == len(prompts)]
    return [r.wall_s for r in steps], [telemetry.price(r).bytes / bw for r in steps]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:deepseek-v3-small")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--output-len", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/mla_decode.json"))
    args = parser.parse_args(argv)
    batches = args.batch or [1, 4]
    torch.set_num_threads(args.threads)
    tokens_per_seq = args.context + args.output_len
    llm = LLM(
        args.model,
        dtype="bfloat16",
        max_model_len=tokens_per_seq + 16,
        num_kv_blocks=(max(batches) + 1) * (tokens_per_seq // 16 + 2),
        max_num_seqs=max(batches),
        max_num_batched_tokens=1024,
    )
    engine = llm.engine
    cfg, shape = engine.model_config, engine.telemetry.pricing.model
    mla = cfg.mla
    elem = engine.dtype.itemsize
    cache = {
        "engine_bytes_per_token": engine.kv_bytes_per_block / engine.config.block_size,
        "analyzer_elements_per_token": shape.kv_cache_elements_per_token(),
        "latent_elements_per_token_and_layer": mla.kv_lora_rank + mla.qk_rope_head_dim,
        "standard_cache_bytes_per_token": cfg.num_layers * cfg.num_heads * (mla.qk_head_dim + mla.v_head_dim) * elem,
    }
    cache["analyzer_bytes_per_token"] = cache["analyzer_elements_per_token"] * elem
    cache["standard_over_latent"] = cache["standard_cache_bytes_per_token"] / cache["engine_bytes_per_token"]
    log(f"KV cache per token: {cache}")
    results = []
    for batch in batches:
        prompts = random_prompts(batch, [args.context] * batch, cfg.vocab_size, seed=batch)
        log(f"batch {batch}: prefilling {batch} x {args.context} tokens (cached for the rounds after)")
        decode_steps(llm, prompts, 2)  # prefill once, and warm both forms
        set_form(llm, False)
        decode_steps(llm, prompts, 2)
        times = {"absorbed": [], "expanded": []}
        floors = []
        for round_index in range(args.rounds):
            for form in ("absorbed", "expanded"):
                set_form(llm, form == "absorbed")
                walls, floor = decode_steps(llm, prompts, args.output_len)
                times[form].append(statistics.median(walls) * 1e3)
                if form == "absorbed":
                    floors.append(statistics.median(floor) * 1e3)
                log(f"batch {batch} round {round_index} {form}: {times[form][-1]:.1f} ms/step")
        set_form(llm, True)
        absorbed, expanded = statistics.median(times["absorbed"]), statistics.median(times["expanded"])
        results.append(
            {
                "batch": batch,
                "context": args.context,
                "absorbed_ms_per_step": absorbed,
                "expanded_ms_per_step": expanded,
                "absorbed_speedup": expanded / absorbed,
                "absorbed_floor_ms": statistics.median(floors),
                "absorbed_floor_fraction": statistics.median(floors) / absorbed,
                "rounds": times,
            }
        )
    payload = {"model": args.model, "machine": machine(), "threads": args.threads, "cache": cache, "results": results}
    args.json.write_text(json.dumps(payload, indent=2))
    print(
        f"{args.model}: KV per token {cache['engine_bytes_per_token']:.0f} B "
        f"(analyzer {cache['analyzer_bytes_per_token']:.0f} B; a standard cache of these heads: "
        f"{cache['standard_cache_bytes_per_token']:.0f} B, {cache['standard_over_latent']:.1f}x)"
    )
    for r in results:
        print(
            f"batch {r['batch']} at {r['context']} tokens: absorbed {r['absorbed_ms_per_step']:.1f} ms/step, "
            f"expanded {r['expanded_ms_per_step']:.1f} ms/step ({r['absorbed_speedup']:.2f}x); absorbed at "
            f"{r['absorbed_floor_fraction']:.0%} of its floor"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
