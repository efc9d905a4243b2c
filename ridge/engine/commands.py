"""``ridge generate`` and ``ridge demo``."""

from __future__ import annotations

import argparse
import time

from ridge.engine.args import add_engine_args, add_sampling_args, engine_options, sampling_params
from ridge.sampling import SamplingParams
from ridge.stats import percentile

DEMO_MODEL = "random:tiny"


def register(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--chat", action="store_true", help="treat each prompt as a user message (chat template)")
    gen.add_argument(
        "--stats", action="store_true", help="print the steps' achieved GB/s, GFLOP/s and roofline fraction per phase"
    )
    gen.set_defaults(func=run_generate)

    demo = subparsers.add_parser("demo", help="serve a mix of short and long requests and summarize")
    add_engine_args(demo, default_model=DEMO_MODEL)
    demo.add_argument("--num-requests", type=int, default=16)
    demo.set_defaults(func=run_demo)


def run_generate(args: argparse.Namespace) -> int:
    from ridge.engine.llm import LLM

    params = sampling_params(args)  # bad sampling values fail before the model loads
    llm = LLM(args.model, **engine_options(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outputs):
        for comp in out.outputs:
            print(prompt + comp.text if not args.chat else comp.text)
            if comp.logprobs:
                for token_lps in comp.logprobs:
                    tops = ", ".join(f"{lp.decoded_token!r}:{lp.logprob:.3f}" for lp in token_lps.values())
                    print(f"  [{tops}]")
    if args.stats:
        print(llm.engine.telemetry.format())
        if llm.engine.speculator is not None:
            print(llm.engine.speculator.format())
        s = llm.engine.structured.stats
        if s.requests:
            print(
                f"structured output: {s.requests} sequences, {s.compiles} grammars compiled in "
                f"{s.compile_s * 1e3:.1f} ms, masks {s.mask_s * 1e3 / max(s.mask_steps, 1):.3f} ms per step "
                f"({s.mask_steps} steps)"
            )
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from ridge.engine.llm import LLM

    llm = LLM(args.model, **engine_options(args))
    engine = llm.engine
    topics = [
        "Once upon a time",
        "The roofline model says",
        "Continuous batching means",
        "A paged KV cache",
        "In a small village",
        "The memory wall",
    ]
    requests = []
    for i in range(args.num_requests):
        long_one = i % 4 == 3
        prompt = topics[i % len(topics)] + (" and then, after a long day," * 8 if long_one else "")
        max_tokens = 96 if long_one else 16 + 8 * (i % 3)
        requests.append((prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))

    print(
        f"ridge demo: {len(requests)} requests on {args.model} ({engine.dtype}, {engine.device}), "
        f"{engine.num_kv_blocks} KV blocks of {engine.config.block_size} tokens, {engine.config.scheduler} batching"
    )
    if args.model.startswith("random:"):
        print("(random weights: the texts are noise; pass --model DIR for a real model)")
    start = time.monotonic()
    ids = [engine.add_request(None, prompt, params) for prompt, params in requests]
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    elapsed = time.monotonic() - start

    for (prompt, _), rid in zip(requests, ids):
        text = done[rid].outputs[0].text
        print(f"[{rid:>2}] {_clip(prompt, 40)!r} -> {_clip(text, 60)!r}")
    _print_summary([done[i] for i in ids], elapsed, steps)
    print(engine.telemetry.format())
    if engine.speculator is not None:
        print(engine.speculator.format())
    return 0


def _print_summary(outputs, elapsed: float, steps: int) -> None:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    gen_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [o.metrics.time_to_first_token * 1000 for o in outputs]
    tpot = [
        (o.metrics.finish_time - o.metrics.first_token_time) * 1000 / (len(o.outputs[0].token_ids) - 1)
        for o in outputs
        if len(o.outputs[0].token_ids) > 1
    ]
    print("\nsummary")
    print(f"  requests             {len(outputs)} in {elapsed:.2f} s ({steps} engine steps)")
    print(f"  prompt tokens        {prompt_tokens}")
    print(f"  generated tokens     {gen_tokens}")
    print(f"  time to first token  median {percentile(ttft, 50):.1f} ms, p90 {percentile(ttft, 90):.1f} ms")
    print(f"  time per out token   median {percentile(tpot, 50):.2f} ms, p90 {percentile(tpot, 90):.2f} ms")
    print(
        f"  throughput           {gen_tokens / elapsed:.1f} generated tok/s, "
        f"{(prompt_tokens + gen_tokens) / elapsed:.1f} total tok/s"
    )


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
