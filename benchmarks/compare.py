"""transformers vs ridge vs llama.cpp on one random-initialized model, interleaved round by round.

    .venv/bin/python benchmarks/compare.py                          # TinyLlama-1.1B shape, bf16, 2 threads
    .venv/bin/python benchmarks/compare.py --rounds 5 --json compare.json --plot benchmarks/compare.png
    .venv/bin/python benchmarks/compare.py --preset tiny --rounds 1 --new-tokens 4     # smoke run

The model is built once by ridge (``random:<preset>``, fixed seed) and exported with
``ridge.models.export``: a Hugging Face directory for transformers and a GGUF for llama.cpp
(``llama-cpp-python``, optional: pip install llama-cpp-python gguf). The exports are cached
under ``$RIDGE_CACHE_DIR/compare/`` (else ``~/.cache/ridge/compare/``), keyed by preset, dtype
and seed, and checked against the weights' fingerprint. Every engine sees the same weights
and the same prompts (random token ids, fixed seed per round) and decodes greedily for
exactly the requested number of tokens (no EOS stop).

Scenarios (``--scenarios``), each run in every round right after a memory-bandwidth probe,
engine after engine (transformers, ridge, llama.cpp), because this machine's bandwidth jumps
between levels and a figure means something only next to the floor measured with it:

- ``batch1``: one prompt of ``--prompt-len`` tokens, ``--new-tokens`` new ones: prefill time
  and decode ms per token.
- ``batch32``: 32 prompts of that length decoding together: prefill time, decode ms per step.
- ``mixed``: offline, ``--mixed-requests`` requests with prompt and output lengths drawn
  uniformly (fixed seed), all submitted at once; output tokens per second.

How each engine runs:
- transformers: the model's forward called step by step with its KV cache
  (``use_cache=True``, greedy argmax): the loop ``generate`` runs, timed per step. The mixed
  workload: ``generate`` in static batches of ``--hf-batch`` requests, left padded, each batch
  generating its longest request's length (the tokens past a request's own length are waste).
- ridge: ``LLMEngine.add_request`` + ``step()``, each step timed; mixed: ``LLM.generate``
  (continuous batching).
- llama.cpp: its C API through ``llama_cpp`` (low level): one context per batch size
  (``n_seq_max`` sequences, a separate KV stream each), ``llama_batch`` with one sequence id per
  request, ``llama_decode`` per step (prompts in ``n_batch``-token chunks, decodes first), greedy
  argmax of the returned logits. The mixed workload runs the same loop with a slot per request:
  continuous batching like llama-server's.

Floors: a step cannot beat the analyzer's roofline time (``StepCost.time_s``: each operator at
max(bytes / bandwidth, FLOPs / peak), summed) with bytes and FLOPs from ridge's analyzer
(``roofline.ops.step_cost``; weights + KV cache + activations; a decode floor is the mean over
the decode steps), bandwidth probed on both sides of each engine's run in batch1 / batch32 (its
ceiling: the best trial of ``sum()`` and ridge's bf16 GEMV,
``roofline.probe.probe_read_bandwidth``; the higher of the two probes, so a level that changes
during a run still gives a ceiling), peak from the machine's probed ``local`` hardware
(``roofline.probe.local_hardware``). "% of floor" is floor / measured.
The mixed workload has no floor (it depends on the schedule).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import importlib.util
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import huge_page_fallbacks

from ridge.bench.common import parse_range, random_prompts, summarize
from ridge.bench.peers import LLAMA_FTYPES, LlamaCppRunner, RidgeRunner, Timed, TransformersRunner, quantize_gguf
from ridge.layers.cpu_kernels import loaded_prefetch_policy
from ridge.models.export import hf_state_dict, save_hf_checkpoint, write_gguf
from ridge.roofline.ops import StepCost, step_cost, weight_bytes
from ridge.roofline.probe import ProbeSettings, local_hardware, machine_fingerprint, probe_read_bandwidth
from ridge.roofline.shapes import ModelShape

REPO = Path(__file__).resolve().parents[1]

SCENARIOS = ("batch1", "batch32", "mixed")
BATCH_OF = {"batch1": 1, "batch32": 32}
ENGINES = ("transformers", "ridge", "llama.cpp")
PROBE = ProbeSettings(bandwidth_bytes=512 * 1024**2, bandwidth_repeats=3)
ROOFLINE_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
EXPORT_FORMAT = 1  # bump when the export layout changes: invalidates cached exports


@dataclass
class Floor:
    """A scenario's roofline inputs: the analyzer's cost of its prefill and of each decode step.
    Their floors are ridge's one convention, ``StepCost.time_s`` (each operator at its own
    bound, summed); a decode floor is the mean over the steps."""

    prefill: StepCost
    decodes: list[StepCost]

    @property
    def prefill_flops(self) -> float:
        return self.prefill.flops

    @property
    def prefill_bytes(self) -> float:
        return self.prefill.bytes

    @property
    def decode_flops(self) -> float:
        return statistics.mean(c.flops for c in self.decodes)

    @property
    def decode_bytes(self) -> float:
        return statistics.mean(c.bytes for c in self.decodes)

    def decode_s(self, bandwidth: float, peak: float) -> float:
        return statistics.mean(c.time_s(peak, bandwidth) for c in self.decodes)

    def prefill_s(self, bandwidth: float, peak: float) -> float:
        return self.prefill.time_s(peak, bandwidth)


# ---- exports --------------------------------------------------------------------------------
def weights_fingerprint(llm) -> str:
    """A hash of a few weight rows: tells a cached export from a stale one (another init)."""
    state = hf_state_dict(llm)
    last = llm.engine.model_config.num_layers - 1
    digest = hashlib.sha256()
    for name in ("model.embed_tokens.weight", f"model.layers.{last}.mlp.down_proj.weight"):
        digest.update(state[name][:2].float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def prepare_exports(
    llm, preset: str, dtype: str, seed: int, cache_root: Path, need_hf: bool, need_gguf: bool
) -> tuple[Path | None, Path | None]:
    """The cached HF directory and GGUF of this model, (re)written when missing or stale."""
    base = cache_root / f"{preset}-{dtype}-seed{seed}"
    meta_file = base / "meta.json"
    meta = {
        "preset": preset,
        "dtype": dtype,
        "seed": seed,
        "format": EXPORT_FORMAT,
        "fingerprint": weights_fingerprint(llm),
    }
    try:
        fresh = json.loads(meta_file.read_text()) == meta
    except (OSError, json.JSONDecodeError):
        fresh = False
    if not fresh:
        shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True, exist_ok=True)
    hf_dir, gguf = base / "hf", base / "model.gguf"
    hf_config = llm.engine.hf_config
    if need_hf and not (hf_dir / "model.safetensors").is_file():
        log(f"exporting the model for transformers -> {hf_dir}")
        tmp = base / "hf.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf_checkpoint(llm, hf_config, tmp)
        tmp.rename(hf_dir)
    if need_gguf and not gguf.is_file():
        log(f"exporting the model for llama.cpp -> {gguf}")
        tmp = base / "model.gguf.tmp"
        write_gguf(hf_state_dict(llm), hf_config, tmp)
        tmp.rename(gguf)
    meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    gc.collect()
    return (hf_dir if need_hf else None), (gguf if need_gguf else None)


# ridge's --quantization of the same block format, run beside the file (Q4_K_M has none)
RIDGE_QUANTIZATION = {"q8_0": "int8", "q4_0": "int4"}


# ---- the benchmark --------------------------------------------------------------------------
def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def scenario_floor(
    shape: ModelShape, batch: int, prompt_len: int, new_tokens: int, elem: float, weight: float | None = None
) -> Floor:
    """Prefill of ``batch`` prompts and the mean decode step, priced by the analyzer
    (``weight``: bytes per weight, when the format is not ``elem``)."""
    w = elem if weight is None else weight
    prefill = step_cost(shape, [(prompt_len, prompt_len)] * batch, [], w, elem, elem)
    decodes = [step_cost(shape, [], [prompt_len + i + 1] * batch, w, elem, elem) for i in range(1, new_tokens)]
    decodes = decodes or [step_cost(shape, [], [prompt_len + 1] * batch, w, elem, elem)]
    return Floor(prefill, decodes)


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each sequence's greedy tokens equal to the reference's before they first differ."""
    shares = []
    for got, ref in zip(tokens, reference):
        same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        shares.append(same / max(len(ref), 1))
    return statistics.mean(shares)


def mixed_workload(args, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = parse_range(args.mixed_prompt_len), parse_range(args.mixed_output_len)
    prompt_lens = [rng.randint(p_lo, p_hi) for _ in range(args.mixed_requests)]
    output_lens = [rng.randint(o_lo, o_hi) for _ in range(args.mixed_requests)]
    return random_prompts(args.mixed_requests, prompt_lens, vocab, seed), output_lens


def run_rounds(args, runners: list, vocab: int) -> list[dict]:
    """Every round: per scenario a bandwidth probe, then each engine on the same prompts; odd
    rounds take the engines in the reverse order, so that of two engines compared neither runs
    first in every round (the 2-core EPYC's memory changes level every minute or so: in a run
    whose rounds all took ridge before llama.cpp, ridge's Q6_K ran at a probed 33 GB/s in both
    rounds and llama.cpp's right after it at 52-58)."""
    rounds = []
    for r in range(args.rounds):
        seed = args.seed + 1000 * (r + 1)
        record: dict = {"round": r}
        order = runners if r % 2 == 0 else runners[::-1]
        for scenario in args.scenarios:
            bandwidth = probe_read_bandwidth(PROBE)
            entry: dict = {
                "bandwidth_gb_per_s": bandwidth.high / 1e9,  # the ceiling, as --hardware local takes it
                "bandwidth_range_gb_per_s": [bandwidth.low / 1e9, bandwidth.high / 1e9],
                "engines": {},
            }
            if scenario == "mixed":
                prompts, output_lens = mixed_workload(args, vocab, seed)
                for runner in order:
                    seconds = runner.run_offline(prompts, output_lens)
                    entry["engines"][runner.name] = {
                        "seconds": seconds,
                        "output_tokens": sum(output_lens),
                        "output_tokens_per_s": sum(output_lens) / seconds,
                    }
                    log(f"round {r + 1} {scenario:<8} {runner.name:<13} {sum(output_lens) / seconds:8.1f} out tok/s")
            else:
                batch = BATCH_OF[scenario]
                prompts = random_prompts(batch, [args.prompt_len] * batch, vocab, seed)
                timed_by: dict[str, Timed] = {}
                before = bandwidth  # each run between two probes: its floor takes the higher
                for runner in order:
                    timed = runner.run_batch(prompts, args.new_tokens)
                    after = probe_read_bandwidth(PROBE)
                    timed_by[runner.name] = timed
                    decode_ms = [s * 1e3 for s in timed.decode_s]
                    entry["engines"][runner.name] = {
                        "prefill_s": timed.prefill_s,
                        "decode_ms": decode_ms,
                        "decode_ms_median": statistics.median(decode_ms) if decode_ms else float("nan"),
                        "bandwidth_gb_per_s": max(before.high, after.high) / 1e9,
                    }
                    before = after
                    log(
                        f"round {r + 1} {scenario:<8} {runner.name:<13} prefill {timed.prefill_s * 1e3:8.1f} ms  "
                        f"decode {entry['engines'][runner.name]['decode_ms_median']:8.2f} ms/step"
                    )
                for name, timed in timed_by.items():
                    ref = agreement_reference(name)
                    if ref in timed_by:
                        entry["engines"][name]["greedy_agreement_with_ridge"] = agreement(
                            timed.tokens, timed_by[ref].tokens
                        )
            record[scenario] = entry
        rounds.append(record)
    return rounds


def agreement_reference(name: str) -> str:
    """The ridge engine an engine's greedy tokens are compared with: the one on the same weights."""
    fmt = name.split(" ", 1)[1] if " " in name else ""
    if fmt.startswith("--quantization "):  # ridge's own quantization: the file of that block format
        by_format = {q: f for f, q in RIDGE_QUANTIZATION.items()}
        return f"ridge {by_format[fmt.split()[1]]}"
    return f"ridge {fmt}" if fmt else "ridge"


def peer_pairs(engines: list[str]) -> dict[str, tuple[str, str]]:
    """ridge against each peer on the same weights: bf16 vs everyone, each file vs llama.cpp on it."""
    pairs = {name: ("ridge", name) for name in engines if " " not in name and name != "ridge"}
    for name in engines:
        if name.startswith("llama.cpp ") and f"ridge {name.split(' ', 1)[1]}" in engines:
            pairs[name] = (f"ridge {name.split(' ', 1)[1]}", name)
    return pairs


def summarize_rounds(
    args, rounds: list[dict], floors: dict[str, dict[str, Floor]], peak: float, engines: list[str]
) -> dict:
    """Medians and spreads per scenario and engine, floors and fractions per round, ratios to ridge."""
    summary: dict = {}
    for scenario in args.scenarios:
        entries = [rnd[scenario] for rnd in rounds]
        bandwidths = [e["bandwidth_gb_per_s"] * 1e9 for e in entries]
        out: dict = {"bandwidth_gb_per_s": summarize([b / 1e9 for b in bandwidths]), "engines": {}}
        if scenario == "mixed":
            for name in engines:
                rates = [e["engines"][name]["output_tokens_per_s"] for e in entries]
                out["engines"][name] = {"output_tokens_per_s": summarize(rates)}
            key, higher = "output_tokens_per_s", True
            per_round = {name: [e["engines"][name][key] for e in entries] for name in engines}
        else:
            floor = floors[scenario]["ridge"]
            batch = BATCH_OF[scenario]
            floor_ms = [floor.decode_s(bw, peak) * 1e3 for bw in bandwidths]
            prefill_floor_s = [floor.prefill_s(bw, peak) for bw in bandwidths]
            out["floor"] = {
                "decode_ms": summarize(floor_ms),
                "decode_bound": "memory"
                if floor.decode_bytes / statistics.median(bandwidths) >= floor.decode_flops / peak
                else "compute",
                "decode_bytes": floor.decode_bytes,
                "decode_flops": floor.decode_flops,
                "prefill_ms": summarize([s * 1e3 for s in prefill_floor_s]),
                "prefill_bytes": floor.prefill_bytes,
                "prefill_flops": floor.prefill_flops,
            }
            for name in engines:
                runs = [e["engines"][name] for e in entries]
                all_steps = [ms for run in runs for ms in run["decode_ms"]]
                medians = [run["decode_ms_median"] for run in runs]
                own = floors[scenario].get(name, floor)  # this engine's weights' floor
                # the bandwidth probed around this engine's own run (a round's first probe in
                # files written before 2026-12-02)
                own_bws = [r.get("bandwidth_gb_per_s", e["bandwidth_gb_per_s"]) * 1e9 for r, e in zip(runs, entries)]
                floor_ms = [own.decode_s(bw, peak) * 1e3 for bw in own_bws]
                prefill_floor_s = [own.prefill_s(bw, peak) for bw in own_bws]
                out["engines"][name] = {
                    "decode_ms_per_step": summarize(all_steps),
                    "decode_tokens_per_s": batch * 1e3 / statistics.median(all_steps) if all_steps else float("nan"),
                    "decode_floor_fraction": summarize([f / m for f, m in zip(floor_ms, medians)]),
                    "achieved_gb_per_s": summarize([own.decode_bytes / m / 1e6 for m in medians]),
                    "prefill_ms": summarize([run["prefill_s"] * 1e3 for run in runs]),
                    "prefill_tokens_per_s": summarize([batch * args.prompt_len / run["prefill_s"] for run in runs]),
                    "prefill_floor_fraction": summarize(
                        [f / run["prefill_s"] for f, run in zip(prefill_floor_s, runs)]
                    ),
                }
                if "greedy_agreement_with_ridge" in runs[0]:
                    out["engines"][name]["greedy_agreement_with_ridge"] = statistics.mean(
                        run["greedy_agreement_with_ridge"] for run in runs
                    )
            key, higher = "decode_ms_median", False
            per_round = {name: medians_of(entries, name, key) for name in engines}
        if "ridge" in engines:
            # speed of ridge over each peer on the same weights, round by round (>1: ridge is faster)
            out["ridge_speedup"] = {
                name: summarize([(r / p if higher else p / r) for r, p in zip(per_round[mine], per_round[name])])
                for name, (mine, _) in peer_pairs(engines).items()
            }
        summary[scenario] = out
    return summary


def medians_of(entries: list[dict], name: str, key: str) -> list[float]:
    return [e["engines"][name][key] for e in entries]


# ---- output ---------------------------------------------------------------------------------
def format_report(payload: dict) -> str:
    cfg, summary = payload["config"], payload["summary"]
    m = payload["machine"]
    lines = [
        f"compare: random:{cfg['preset']} {cfg['dtype']} (seed {cfg['seed']}), {cfg['threads']} threads, "
        f"{cfg['rounds']} rounds, {m['cpu']} ({m['cpus']} cpus), torch {m['torch']}, {m['date']}",
        f"weights {payload['weight_bytes'] / 1e6:.1f} MB; peak {payload['peak_gflop_per_s']:.0f} GFLOP/s "
        f"{cfg['roofline_dtype']} (probed local hardware); engines: {', '.join(payload['engines'])}",
    ]
    for note in payload["notes"]:
        lines.append(f"note: {note}")
    for scenario, out in summary.items():
        bw = out["bandwidth_gb_per_s"]
        lines.append("")
        if scenario == "mixed":
            lines.append(
                f"mixed offline: {cfg['mixed_requests']} requests, prompt {cfg['mixed_prompt_len']}, "
                f"output {cfg['mixed_output_len']} tokens; bandwidth {bw['median']:.1f} GB/s "
                f"({bw['min']:.1f}-{bw['max']:.1f})"
            )
            lines.append(f"  {'engine':<13} {'out tok/s':>10} {'(min-max)':>17}  how")
            for name, e in out["engines"].items():
                t = e["output_tokens_per_s"]
                lines.append(
                    f"  {name:<13} {t['median']:10.1f} {t['min']:8.1f}-{t['max']:<8.1f}  {payload['how'][name]}"
                )
        else:
            f = out["floor"]
            batch = BATCH_OF[scenario]
            lines.append(
                f"batch {batch}: prompt {cfg['prompt_len']}, {cfg['new_tokens']} new tokens; bandwidth "
                f"{bw['median']:.1f} GB/s ({bw['min']:.1f}-{bw['max']:.1f}); decode floor "
                f"{f['decode_ms']['median']:.2f} ms/step ({f['decode_bound']}-bound: "
                f"{f['decode_bytes'] / 1e6:.1f} MB, {f['decode_flops'] / 1e9:.2f} GFLOP per step)"
            )
            lines.append(
                f"  {'engine':<26} {'prefill ms':>10} {'decode ms/step':>15} {'(p10-p90)':>17} "
                f"{'tok/s':>8} {'% floor':>8} {'GB/s':>6} {'prefill %':>9} {'= ridge':>8}"
            )
            for name, e in out["engines"].items():
                d = e["decode_ms_per_step"]
                agree = e.get("greedy_agreement_with_ridge")
                lines.append(
                    f"  {name:<26} {e['prefill_ms']['median']:10.1f} {d['median']:15.2f} "
                    f"{d['p10']:8.2f}-{d['p90']:<8.2f} {e['decode_tokens_per_s']:8.1f} "
                    f"{100 * e['decode_floor_fraction']['median']:7.1f}% {e['achieved_gb_per_s']['median']:6.1f} "
                    f"{100 * e['prefill_floor_fraction']['median']:8.1f}% "
                    f"{'' if agree is None else f'{100 * agree:7.0f}%'}"
                )
        pairs = peer_pairs(list(out["engines"]))
        for name, s in out.get("ridge_speedup", {}).items():
            lines.append(
                f"  {pairs[name][0]} vs {name}: {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}) "
                f"{'output throughput' if scenario == 'mixed' else 'decode speed'}"
            )
    lines.append("")
    lines.append(
        "% floor: roofline floor / measured (decode: per step, with the bandwidth probed on both sides of the run); "
        "GB/s: analyzer bytes per step / measured step (each engine's own weight bytes); = ridge: greedy "
        "tokens equal to ridge's on the same weights "
        "(prefix share; bf16 rounding differs between engines, so late divergence is expected)"
    )
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    """Bars per engine per scenario (ms per decode step, or per output token for mixed), floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = payload["summary"]
    colors = {"transformers": "#d62728", "ridge": "#1f77b4", "llama.cpp": "#2ca02c"}
    fig, axes = plt.subplots(1, len(summary), figsize=(4.2 * len(summary), 4.2), squeeze=False)
    for ax, (scenario, out) in zip(axes[0], summary.items()):
        names = list(out["engines"])
        if scenario == "mixed":
            stats = [out["engines"][n]["output_tokens_per_s"] for n in names]
            heights = [1e3 / s["median"] for s in stats]
            lows = [h - 1e3 / s["max"] for h, s in zip(heights, stats)]
            highs = [1e3 / s["min"] - h for h, s in zip(heights, stats)]
            ax.set_title(f"mixed offline ({payload['config']['mixed_requests']} requests)")
            ax.set_ylabel("ms per output token (lower is better)")
        else:
            stats = [out["engines"][n]["decode_ms_per_step"] for n in names]
            heights = [s["median"] for s in stats]
            lows = [h - s["p10"] for h, s in zip(heights, stats)]
            highs = [s["p90"] - h for h, s in zip(heights, stats)]
            floor = out["floor"]["decode_ms"]["median"]
            ax.axhline(floor, color="black", linestyle="--", linewidth=1)
            ax.annotate(
                f"floor {floor:.1f} ms",
                (1.0, floor),
                xycoords=("axes fraction", "data"),
                ha="right",
                va="bottom",
                fontsize=8,
                xytext=(-2, 2),
                textcoords="offset points",
            )
            ax.set_title(f"decode, batch {BATCH_OF[scenario]}")
            ax.set_ylabel("ms per decode step (lower is better)")
        ax.set_ylim(0, 1.15 * max(h + e for h, e in zip(heights, highs)))
        bars = ax.bar(names, heights, yerr=[lows, highs], capsize=4, color=[colors.get(n, "gray") for n in names])
        for bar, h, high in zip(bars, heights, highs):
            ax.annotate(
                f"{h:.1f}",
                (bar.get_x() + bar.get_width() / 2, h + high),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
    cfg = payload["config"]
    fig.suptitle(
        f"random:{cfg['preset']} {cfg['dtype']}, {cfg['threads']} threads, {payload['machine']['cpu']}, "
        f"{payload['machine']['date'][:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tinyllama-1.1b", help="ridge preset of the random model (tiny for smoke runs)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(ROOFLINE_DTYPE))
    p.add_argument("--seed", type=int, default=0, help="weights seed (prompts derive from it too)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp n_threads")
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="ridge's multi-step scheduling: plain decode steps run up to this many forward passes a plan",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        help="ridge's CPU kernels: auto, or avx2 (the AVX2 kernels on an AVX-512 CPU too, as an AVX2-only CPU runs)",
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--mixed-requests", type=int, default=32)
    p.add_argument("--mixed-prompt-len", default="16:128", help="N or LO:HI (uniform)")
    p.add_argument("--mixed-output-len", default="8:128", help="N or LO:HI (uniform)")
    p.add_argument("--hf-batch", type=int, default=8, help="transformers' static batch size in the mixed workload")
    p.add_argument("--llamacpp-n-batch", type=int, default=512)
    p.add_argument(
        "--formats",
        default="bf16",
        help="comma-separated weight formats: bf16 and llama.cpp files quantized by its own llama_model_quantize "
        f"({', '.join(LLAMA_FTYPES)}): each run by llama.cpp and by ridge from the same file, and ridge's "
        "--quantization of the same block format beside them",
    )
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each engine")
    p.add_argument("--cache-dir", type=Path, default=None, help="where exports are cached")
    p.add_argument("--json", type=Path, default=None, help="write every number to this file")
    p.add_argument("--plot", type=Path, default=None, help="write a bar chart (PNG)")
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad or not args.scenarios:
        p.error(f"unknown scenarios {bad}; choose from {', '.join(SCENARIOS)}")
    if args.rounds < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.threads < 1 or args.mixed_requests < 1:
        p.error("need --rounds >= 1, --prompt-len >= 1, --new-tokens >= 2, --threads >= 1, --mixed-requests >= 1")
    parse_range(args.mixed_prompt_len), parse_range(args.mixed_output_len)
    return args


def warm_up(runners: list, args, vocab: int) -> None:
    """One short untimed run per engine and batch size: kernel builds, thread pools, caches."""
    for batch in sorted({BATCH_OF.get(s, args.mixed_requests) for s in args.scenarios}):
        prompts = random_prompts(batch, [min(args.prompt_len, 16)] * batch, vocab, seed=args.seed)
        for runner in runners:
            runner.run_batch(prompts, 3)


def main(argv=None) -> int:
    from ridge import LLM

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    notes: list[str] = []
    have_llamacpp = importlib.util.find_spec("llama_cpp") is not None
    use_llamacpp = not args.skip_llamacpp and have_llamacpp
    if not args.skip_llamacpp and not have_llamacpp:
        notes.append("llama.cpp not measured: llama-cpp-python is not installed (pip install llama-cpp-python gguf)")
    if use_llamacpp and importlib.util.find_spec("gguf") is None:
        notes.append("llama.cpp not measured: the gguf package (needed for the export) is not installed")
        use_llamacpp = False

    (_, mixed_prompt_hi), (_, mixed_output_hi) = parse_range(args.mixed_prompt_len), parse_range(args.mixed_output_len)
    longest = max(
        args.prompt_len + args.new_tokens, mixed_prompt_hi + mixed_output_hi if "mixed" in args.scenarios else 0
    )
    max_seqs = max([BATCH_OF.get(s, args.mixed_requests) for s in args.scenarios])
    log(f"building random:{args.preset} ({args.dtype}, seed {args.seed}) in ridge")
    llm = LLM(
        f"random:{args.preset}",
        dtype=args.dtype,
        seed=args.seed,
        num_threads=args.threads,
        max_num_seqs=max_seqs,
        max_model_len=longest + 16,
        num_scheduler_steps=args.num_scheduler_steps,
        kernels=args.kernels,
    )
    hf_config, vocab = llm.engine.hf_config, llm.engine.model_config.vocab_size
    cache_root = args.cache_dir or (
        Path(os.environ.get("RIDGE_CACHE_DIR", Path.home() / ".cache" / "ridge")) / "compare"
    )
    hf_dir, gguf_path = prepare_exports(
        llm, args.preset, args.dtype, args.seed, cache_root, need_hf=not args.skip_transformers, need_gguf=use_llamacpp
    )

    runners: list = []
    how: dict[str, str] = {}
    if not args.skip_transformers:
        log("loading the export in transformers")
        runners.append(TransformersRunner(hf_dir, getattr(torch, args.dtype), args.hf_batch))
        how["transformers"] = f"generate, static batches of {args.hf_batch}, left padded"
    runners.append(RidgeRunner(llm))
    how["ridge"] = "LLM.generate, continuous batching" + (
        f", --num-scheduler-steps {args.num_scheduler_steps}" if args.num_scheduler_steps > 1 else ""
    )
    if use_llamacpp:
        log("loading the GGUF in llama.cpp")
        runners.append(LlamaCppRunner(gguf_path, args.threads, longest + 16, args.llamacpp_n_batch))
        how["llama.cpp"] = f"llama_batch, {args.mixed_requests} slots, continuous batching"
        notes.append("llama.cpp: batch 32 and the mixed workload use llama_batch with one sequence id per request")
    engine_options = dict(
        num_threads=args.threads,
        max_num_seqs=max_seqs,
        max_model_len=longest + 16,
        num_scheduler_steps=args.num_scheduler_steps,
        kernels=args.kernels,
    )
    files: dict[str, str] = {}  # each format's file, as both engines loaded it
    fallbacks: dict[str, int] = {}  # ridge engine -> 2 MiB page requests served with 4 KiB pages during its load

    def load_ridge(name: str, *args, **kwargs):
        before = huge_page_fallbacks()
        engine = LLM(*args, **kwargs)
        after = huge_page_fallbacks()
        if before is not None and after is not None and after > before:
            fallbacks[name] = after - before
            notes.append(
                f"{name}: {after - before} of the 2 MiB pages asked for during its load came as 4 KiB pages "
                "(/proc/vmstat thp_fault_fallback; with transparent huge pages on 'madvise' only ridge's weights ask): "
                "its weights may stream slower than they would"
            )
        return engine

    for fmt in [f for f in args.formats.split(",") if f and f != "bf16"]:
        if fmt not in LLAMA_FTYPES:
            raise SystemExit(f"unknown format {fmt!r}; choose from bf16, {', '.join(LLAMA_FTYPES)}")
        if not use_llamacpp:
            raise SystemExit("quantized formats need llama-cpp-python (its quantizer makes the files)")
        path = quantize_gguf(gguf_path, fmt, args.threads)
        files[fmt] = str(path)
        log(f"loading {path.name} in ridge and in llama.cpp")
        runners.append(
            RidgeRunner(load_ridge(f"ridge {fmt}", str(path), tokenizer="bytes", **engine_options), f"ridge {fmt}")
        )
        runners.append(LlamaCppRunner(path, args.threads, longest + 16, args.llamacpp_n_batch, f"llama.cpp {fmt}"))
        how[f"ridge {fmt}"] = f"{how['ridge']}, {path.name}"
        how[f"llama.cpp {fmt}"] = f"{how['llama.cpp']}, {path.name}"
        if fmt in RIDGE_QUANTIZATION:
            q = RIDGE_QUANTIZATION[fmt]
            quantized = load_ridge(
                f"ridge --quantization {q}",
                f"random:{args.preset}",
                dtype=args.dtype,
                seed=args.seed,
                quantization=q,
                **engine_options,
            )
            runners.append(RidgeRunner(quantized, f"ridge --quantization {q}"))
            how[f"ridge --quantization {q}"] = f"{how['ridge']}, quantized at load"
        notes.append(
            f"{fmt}: the bf16 export quantized by llama.cpp's llama_model_quantize; ridge loads the same file "
            "(its own log says what it converted)"
        )
    engines = [r.name for r in runners]

    hardware = local_hardware()
    roofline_dtype = ROOFLINE_DTYPE[args.dtype]
    peak = hardware.peak(roofline_dtype)
    shape = ModelShape.from_hf_config(hf_config)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    # Each engine's floor prices the weights it reads: ridge's loaded layers (blocks and scales);
    # llama.cpp reads the same file as the ridge engine on it.
    weight_of = {r.name: r.weight_bytes_per_param for r in runners if isinstance(r, RidgeRunner)}
    for name in engines:
        if name.startswith("llama.cpp ") and f"ridge {name.split(' ', 1)[1]}" in weight_of:
            weight_of[name] = weight_of[f"ridge {name.split(' ', 1)[1]}"]
    floors = {
        s: {
            name: scenario_floor(shape, BATCH_OF[s], args.prompt_len, args.new_tokens, elem, weight_of.get(name))
            for name in engines
        }
        for s in args.scenarios
        if s in BATCH_OF
    }

    try:
        if not args.no_warmup:
            log("warm-up")
            warm_up(runners, args, vocab)
        rounds = run_rounds(args, runners, vocab)
    finally:
        for runner in runners:
            runner.close()
    payload = {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "roofline_dtype": roofline_dtype,
        },
        "machine": {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "cpu": machine_fingerprint()["cpu"],
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "llama_cpp_python": _version("llama_cpp"),
            "cpu_prefetch": loaded_prefetch_policy(),  # ridge's CPU kernels' (csrc/prefetch.cpp)
        },
        "engines": engines,
        "files": files,
        "huge_page_fallbacks": fallbacks,
        "how": how,
        "notes": notes,
        "peak_gflop_per_s": peak / 1e9,
        "weight_bytes": weight_bytes(shape, elem),
        "hardware": hardware.to_json(),
        "rounds": rounds,
        "summary": summarize_rounds(args, rounds, floors, peak, engines),
    }
    print(format_report(payload))
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2, default=float) + "\n")
        log(f"wrote {args.json}")
    if args.plot:
        plot(payload, args.plot)
        log(f"wrote {args.plot}")
    return 0


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", None)
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
