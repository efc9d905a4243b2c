"""Speculative decoding, one interleaved run: decode tokens/s with and without speculation.

Every round runs every scenario's plain engine and its speculating engine back to back (these
machines are noisy: compare only within a round), on models that say real things at a real
model's cost (``../shared/tools/inflate_stories.py``):

* ``ngram-story``:   the inflated stories model continuing a story that is in its prompt
                      (prompt lookup finds it), n-gram, k = 4, batch 1, greedy;
* ``ngram-fresh``:   the same with a prompt where lookup finds little, batch 1, greedy;
* ``draft``:          stories260K drafting for the inflated model (the same function), k = 4,
                      batch 1, greedy and temperature 0.8;
* ``draft-noisy``:    a target made with ``--noise 0.05`` (a related but different model), so
                      acceptance is below 1;
* ``batch-N``:        batch 1, 8 and 32 with the adaptive policy (n-gram and draft);
* ``overhead``:       stories260K itself (a step is all engine overhead), n-gram vs plain.

Each result holds the measured speedup (decode tokens over decode time, from the engine's
telemetry), the acceptance, and the analyzer's prediction for that acceptance:
mean tokens per verify run / (T(k) / T(0) + c k), T from the roofline cost model on this
machine's probed roofline, c the draft's weight bytes over the target's.

    python benchmarks/spec_decode.py [--rounds 3] [--inflated /tmp/stories-1.1b]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ridge import LLM, SamplingParams

HERE = Path(__file__).parent
SHARED = Path(os.environ.get("RIDGE_SHARED_DIR", HERE.parent.parent / "shared"))  # models and tools
STORIES = SHARED / "models" / "stories260K"
OUT = HERE / "spec_decode.json"


def inflated(path: Path, noise: float = 0.0) -> Path:
    if not (path / "model.safetensors").is_file():
        args = [sys.executable, str(SHARED / "tools" / "inflate_stories.py"), str(path)]
        if noise:
            args += ["--noise", str(noise)]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return path


def decode_run(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    """Decode tokens per second of one generate call (prefill excluded, from the telemetry)."""
    engine = llm.engine
    engine.telemetry.reset()
    if engine.speculator is not None:
        from ridge.spec_decode.stats import SpecDecodeStats

        engine.speculator.stats = SpecDecodeStats()
        engine.speculator.propose_s = 0.0
    graphs = getattr(getattr(getattr(engine.executor, "worker", None), "runner", None), "graphs", None)
    replays = graphs.replays if graphs is not None else 0  # steps a CUDA graph ran
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    decode = [r for r in engine.telemetry.recent if r.phase == "decode"]
    decode_s = sum(r.wall_s for r in decode)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    run = {"tokens_per_s": tokens / decode_s, "decode_s": decode_s, "steps": len(decode), "wall_s": wall}
    run["ms_per_step"] = 1e3 * decode_s / max(1, len(decode))
    run["text"] = outs[0].outputs[0].text[:80]
    if graphs is not None:
        run["graph_steps"] = graphs.replays - replays
    if engine.speculator is not None:
        run["speculation"] = engine.speculator.report()
    return run


def predicted_speedup(llm: LLM, batch: int, context: int, spec: dict, steps: int) -> float | None:
    """The analyzer's expectation for the measured acceptance: tokens per verify run over the
    roofline cost of a verify step (and the draft's passes) relative to a plain step; steps
    that did not verify (nothing proposed) count as plain ones."""
    if not spec["num_verify_runs"]:
        return None
    model = llm.engine.speculator.cost_model
    k = round(spec["num_draft_tokens"] / spec["num_verify_runs"])
    ratio = model.step_ratios(batch, context)[min(k, model.max_k)]
    cost = ratio + model.proposer_cost * k  # a verify step's time over a plain step's
    length = spec["mean_accepted_length"]  # tokens a verify run yields (a plain step: 1)
    f = min(1.0, spec["num_verify_runs"] / batch / max(1, steps))  # share of steps that verified
    return (f * length + 1 - f) / (f * cost + 1 - f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inflated", type=Path, default=Path("/tmp/stories-1.1b"))
    ap.add_argument("--noisy", type=Path, default=Path("/tmp/stories-1.1b-noise0.05"))
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--only", default=None, help="comma-separated scenario names")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    target = str(inflated(args.inflated))
    noisy = str(inflated(args.noisy, noise=0.05))
    # max_model_len: the draft (stories260K) covers 512 positions
    common = dict(dtype="bfloat16", device=args.device, num_kv_blocks=4096, max_num_seqs=64, max_model_len=512)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    draft = {"method": "draft_model", "model": str(STORIES), "num_speculative_tokens": 4}
    fixed = {"adaptive": False}

    plain = LLM(target, **common)
    # a story the model tells, put in the prompt, then its opening again: lookup finds the rest
    told = plain.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=160), use_tqdm=False)
    story = "Once upon a time" + told[0].outputs[0].text
    story_prompt = story + "\n\nOnce upon a time"
    fresh_prompt = "Lily and Ben went to the park."
    openings = ["Once upon a time", "Tom had a", "The sun was", "Lily saw a", "One day, a", "Sam and his"]

    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.8, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    short = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engines = {"plain": plain}

    def engine(name, model, spec):
        if name not in engines:
            llm = engines[name] = LLM(model, speculative_config=spec, **common)
            # warm like the plain engine (its story above): first-use costs (kernel compiles
            # for new shapes, the policy's one-off roofline probe) stay out of the measurement
            llm.generate(openings[:4], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        return engines[name]

    scenarios = {
        # name: (plain engine, spec engine, prompts, params, batch)
        "ngram-story": (lambda: plain, lambda: engine("ngram", target, {**ngram, **fixed}), [story_prompt], greedy, 1),
        "ngram-fresh": (lambda: plain, lambda: engine("ngram", target, {**ngram, **fixed}), [fresh_prompt], greedy, 1),
        "draft-greedy": (lambda: plain, lambda: engine("draft", target, {**draft, **fixed}), [fresh_prompt], greedy, 1),
        "draft-t0.8": (lambda: plain, lambda: engine("draft", target, {**draft, **fixed}), [fresh_prompt], warm, 1),
        "draft-noisy": (
            lambda: engine("noisy-plain", noisy, None),
            lambda: engine("noisy-draft", noisy, {**draft, **fixed}),
            [fresh_prompt],
            greedy,
            1,
        ),
    }
    for batch in (1, 8, 32):
        prompts = [openings[i % len(openings)] + " " * (i // len(openings)) for i in range(batch)]
        scenarios[f"batch-{batch}-ngram"] = (
            lambda: plain,
            lambda: engine("ngram-adaptive", target, ngram),
            prompts,
            short,
            batch,
        )
        scenarios[f"batch-{batch}-draft"] = (
            lambda: plain,
            lambda: engine("draft-adaptive", target, draft),
            prompts,
            short,
            batch,
        )
    only = set(args.only.split(",")) if args.only else None
    results: dict[str, list] = {}
    for round_index in range(args.rounds):
        for name, (get_plain, get_spec, prompts, params, batch) in scenarios.items():
            if only and name not in only:
                continue
            base = decode_run(get_plain(), prompts, params)
            fast_llm = get_spec()
            fast = decode_run(fast_llm, prompts, params)
            spec = fast["speculation"]
            context = len(get_plain().engine.tokenizer.encode(prompts[0])) + params.max_tokens // 2
            pred = predicted_speedup(fast_llm, batch, context, spec, fast["steps"])
            row = {
                "round": round_index,
                "batch": batch,
                "plain": base,
                "speculative": fast,
                "speedup": fast["tokens_per_s"] / base["tokens_per_s"],
                "predicted_speedup": pred,
            }
            results.setdefault(name, []).append(row)
            print(
                f"round {round_index} {name:<16} plain {base['tokens_per_s']:7.2f} tok/s  "
                f"spec {fast['tokens_per_s']:7.2f}"
                f"  x{row['speedup']:.2f} (predicted {pred if pred is None else round(pred, 2)})  "
                f"accepted {spec['acceptance_rate']:.2f}, {spec['mean_accepted_length']:.2f}/run, k {spec['last_k']}"
                + (f", graphs {fast['graph_steps']}/{fast['steps']}" if "graph_steps" in fast else ""),
                flush=True,
            )
    # engine overhead on stories260K itself: a step there is nearly all engine
    overhead = []
    small_plain = LLM(str(STORIES), dtype="float32", device=args.device)
    small_spec = LLM(str(STORIES), dtype="float32", device=args.device, speculative_config={**ngram, **fixed})
    told_small = small_plain.generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=160), use_tqdm=False
    )
    small_prompt = "Once upon a time" + told_small[0].outputs[0].text + "\n\nOnce upon a time"
    for _ in range(max(3, args.rounds)):
        a = decode_run(small_plain, [small_prompt], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        b = decode_run(small_spec, [small_prompt], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        overhead.append(
            {
                "plain_ms_per_step": a["ms_per_step"],
                "spec_ms_per_step": b["ms_per_step"],
                "ratio": b["ms_per_step"] / a["ms_per_step"],
                "spec_tokens_per_step": b["speculation"]["mean_accepted_length"],
            }
        )
    summary = {
        name: {
            "batch": rows[0]["batch"],
            "speedup_median": statistics.median(r["speedup"] for r in rows),
            "speedups": [round(r["speedup"], 3) for r in rows],
            "predicted_median": statistics.median(r["predicted_speedup"] for r in rows if r["predicted_speedup"])
            if any(r["predicted_speedup"] for r in rows)
            else None,
            "acceptance_rate": statistics.median(r["speculative"]["speculation"]["acceptance_rate"] for r in rows),
            "tokens_per_verify_run": statistics.median(
                r["speculative"]["speculation"]["mean_accepted_length"] for r in rows
            ),
            "plain_tokens_per_s": statistics.median(r["plain"]["tokens_per_s"] for r in rows),
            "spec_tokens_per_s": statistics.median(r["speculative"]["tokens_per_s"] for r in rows),
        }
        for name, rows in results.items()
    }
    summary["overhead"] = {"ratio_median": statistics.median(o["ratio"] for o in overhead), "runs": overhead}
    payload = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        },
        "target": "inflated stories260K (TinyLlama-1.1B shape, bf16)",
        "summary": summary,
        "rounds": results,
    }
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    plot(summary, args.out.with_suffix(".png"))


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in summary if n != "overhead"]
    measured = [summary[n]["speedup_median"] for n in names]
    predicted = [summary[n]["predicted_median"] or 0 for n in names]
    fig, ax = plt.subplots(figsize=(10, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], predicted, 0.4, label="analyzer, for the measured acceptance")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s vs no speculation")
    ax.set_title("Speculative decoding on the inflated stories model (2 CPU threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
