"""``ridge bench quality``: what quantization costs, measured as llama.cpp measures it.

Over one fixed text, the candidate (``--quantization``, ``--kv-cache-dtype``, or a ``.gguf``
file) and a reference (the same model unquantized, or ``--reference``) each give the
log-probabilities of every next token over the whole vocabulary. Reported: the mean KL
divergence of the candidate's distributions from the reference's (``llama-perplexity
--kl-divergence``), the share of positions where their top tokens agree, and the
perplexity of the text under each.

The text: ``--text FILE``, or a story the reference itself samples at temperature 1 (seed
0) from ``--prompt``, ``--tokens`` long, so a real model is scored on text like its own.
The whole text is one prefill (causal attention: each position sees only the tokens
before it), so a quantized KV cache is read back exactly as a decode step would read it.
"""

from __future__ import annotations

import argparse
import math

import torch

from ridge.bench.common import dump_json, machine
from ridge.engine.args import add_engine_args, engine_options


def register(subparsers) -> None:
    p = subparsers.add_parser("quality", help="KL divergence, top-token agreement, perplexity vs a reference")
    add_engine_args(p)
    p.add_argument("--reference", default=None, help="reference model (default: --model, unquantized)")
    p.add_argument("--text", default=None, help="a UTF-8 text file to score (default: a sampled story)")
    p.add_argument("--prompt", default="Once upon a time", help="the sampled story's prompt")
    p.add_argument("--tokens", type=int, default=480, help="the sampled story's length in tokens")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ridge.config import EngineConfig
    from ridge.engine.engine import LLMEngine

    if args.tokens < 2:
        raise ValueError("--tokens must be >= 2")
    options = engine_options(args)
    options["enable_prefix_caching"] = False  # the scoring prefill writes the pool directly
    reference_options = {**options, "quantization": None, "kv_cache_dtype": "auto"}
    reference = LLMEngine(EngineConfig.from_kwargs(args.reference or args.model, **reference_options))
    ids = _text_ids(reference, args)
    ref_logprobs = reference.score(ids)
    ref_name = f"{args.reference or args.model} ({str(reference.dtype).removeprefix('torch.')})"
    del reference
    candidate = LLMEngine(EngineConfig.from_kwargs(args.model, **options))
    result = compare(ref_logprobs, candidate.score(ids), ids)
    payload = {
        "candidate": {
            "model": args.model,
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "weight_bytes": candidate.model_info.weight_bytes,
        },
        "reference": ref_name,
        "tokens": len(ids),
        "machine": machine(),
        **result,
    }
    if args.json:
        print(dump_json(payload))
    else:
        print(f"reference  {ref_name}")
        print(
            f"candidate  {args.model}, weights {args.quantization or 'as loaded'}, KV cache {args.kv_cache_dtype}; "
            f"{len(ids)} tokens"
        )
        print(f"  mean KL divergence      {result['mean_kld']:.6f}  (max {result['max_kld']:.4f})")
        print(f"  top token agrees        {100 * result['top_token_agreement']:.1f}%")
        print(f"  perplexity              {result['ppl_candidate']:.4f}  (reference {result['ppl_reference']:.4f})")
    return 0


def _text_ids(engine, args) -> list[int]:
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            ids = engine.tokenizer.encode(f.read())
    else:
        from ridge.sampling import SamplingParams

        params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.tokens, ignore_eos=True)
        engine.add_request("quality-text", args.prompt, params, stream=False)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                out = o
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    if len(ids) < 2:
        raise ValueError("the text must be at least 2 tokens long")
    if len(ids) > engine.max_model_len:
        ids = ids[: engine.max_model_len]
    return ids


def compare(reference: torch.Tensor, candidate: torch.Tensor, ids: list[int]) -> dict:
    """KL(reference || candidate) per position, top-1 agreement, both perplexities."""
    targets = torch.tensor(ids[1:])
    kld = (reference.exp() * (reference - candidate)).sum(-1)
    agree = (reference.argmax(-1) == candidate.argmax(-1)).float().mean().item()
    nll_ref = -reference.gather(1, targets[:, None]).mean().item()
    nll_cand = -candidate.gather(1, targets[:, None]).mean().item()
    return {
        "mean_kld": kld.mean().item(),
        "max_kld": kld.max().item(),
        "top_token_agreement": agree,
        "ppl_reference": math.exp(nll_ref),
        "ppl_candidate": math.exp(nll_cand),
    }
