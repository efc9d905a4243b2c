"""Quantization quality on the same file, ridge against llama.cpp (llama-cpp-python).

A Hugging Face model (by default the inflated stories model of ``../shared/tools``, a real
trained model at TinyLlama's size) is exported in bf16 by ridge's GGUF writer and quantized
by llama.cpp's own ``llama_model_quantize`` into each ``--formats`` file type. On one text (a
story the bf16 reference samples at temperature 1, seed 0, as ``ridge bench quality`` does)
both engines give every position's next-token distribution from the same file; each is held
against the reference's (ridge on the Hugging Face directory, bf16): mean KL divergence and
top-token agreement, llama.cpp's ``--kl-divergence`` measures.

    python benchmarks/quality_llamacpp.py --model /path/to/inflated --formats Q4_K_M,Q6_K \\
        --work-dir /tmp/quality --json benchmarks/quality_llamacpp.json

Needs llama-cpp-python; files are cached in ``--work-dir``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np
import torch

from ridge.bench.common import machine
from ridge.bench.quality import compare
from ridge.config import EngineConfig
from ridge.engine.engine import LLMEngine
from ridge.models.export import write_gguf
from ridge.sampling import SamplingParams


def story_ids(engine: LLMEngine, prompt: str, tokens: int) -> list[int]:
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request("story", prompt, params, stream=False)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids)


def llama_cpp_logprobs(lc, path: Path, ids: list[int], threads: int) -> torch.Tensor:
    """(T - 1, V) log-probabilities of each next token, from llama.cpp's logits of every position."""
    llm = lc.Llama(
        model_path=str(path), n_ctx=len(ids) + 16, n_batch=512, logits_all=True, n_threads=threads, verbose=False
    )
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    return torch.log_softmax(logits, -1)[:-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (bf16 reference)")
    parser.add_argument("--formats", default="Q8_0,Q6_K,Q5_K_M,Q4_K_M,IQ4_XS,Q4_0,Q3_K_M,Q2_K")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--tokens", type=int, default=484)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("quality_llamacpp"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        import llama_cpp as lc
    except ImportError:
        print("quality_llamacpp: needs llama-cpp-python", file=sys.stderr)
        return 2

    args.work_dir.mkdir(parents=True, exist_ok=True)
    options = dict(dtype="bfloat16", num_threads=args.threads, enable_prefix_caching=False)
    reference = LLMEngine(EngineConfig.from_kwargs(args.model, **options))
    bf16 = args.work_dir / "model-bf16.gguf"
    if not bf16.is_file():
        write_gguf(args.model, reference.hf_config, bf16)
    ids = story_ids(reference, args.prompt, args.tokens)
    ref_logprobs = reference.score(ids)
    del reference
    lc.llama_backend_init()
    results = {}
    for ftype in args.formats.split(","):
        path = args.work_dir / f"model-{ftype}.gguf"
        if not path.is_file():
            params = lc.llama_model_quantize_default_params()
            params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.nthread = args.threads
            if lc.llama_model_quantize(str(bf16).encode(), str(path).encode(), ctypes.byref(params)) != 0:
                raise RuntimeError(f"llama_model_quantize failed for {ftype}")
        candidate = LLMEngine(EngineConfig.from_kwargs(str(path), tokenizer="bytes", **options))
        ours = compare(ref_logprobs, candidate.score(ids), ids)
        del candidate
        theirs = compare(ref_logprobs, llama_cpp_logprobs(lc, path, ids, args.threads), ids)
        keys = ("mean_kld", "top_token_agreement", "ppl_candidate")
        results[ftype] = {"ridge": {k: ours[k] for k in keys}, "llama.cpp": {k: theirs[k] for k in keys}}
        ratio = ours["mean_kld"] / theirs["mean_kld"]
        print(
            f"{ftype:7s} KLD ridge {ours['mean_kld']:.5f}  llama.cpp {theirs['mean_kld']:.5f}  ({ratio:.3f}x)  "
            f"top token {100 * ours['top_token_agreement']:.1f}% / {100 * theirs['top_token_agreement']:.1f}%",
            flush=True,
        )
    if args.json:
        payload = {"model": args.model, "tokens": len(ids), "machine": machine(), "formats": results}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
