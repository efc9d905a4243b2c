"""What several benchmark scripts share (each is run as ``python benchmarks/<script>.py``, whose
folder Python puts on the path, so they import this as ``common``)."""

from __future__ import annotations


def cpu_engine_options(args, **options) -> dict:
    """An ``LLM``'s options for a CPU benchmark of one process: bf16 on the CPU, the weights
    ``args.quantization`` gives, ``args.kernels``, ``args.threads`` threads, the bytes tokenizer,
    no prefix cache (each round computes its own tokens), seed 0; ``options`` add or replace."""
    return (
        dict(
            dtype="bfloat16",
            device="cpu",
            quantization=args.quantization,
            kernels=args.kernels,
            tokenizer="bytes",
            num_threads=args.threads,
            enable_prefix_caching=False,
            seed=0,
        )
        | options
    )
