"""Engine and sampling flags shared by every command that builds an engine."""

from __future__ import annotations

import argparse
import dataclasses

from ridge.config import KERNEL_CHOICES, SCHEDULER_POLICIES, EngineConfig
from ridge.dtypes import RUN_DTYPES
from ridge.sampling import SamplingParams

_ENGINE_DEFAULTS = EngineConfig()


def add_engine_args(parser: argparse.ArgumentParser, default_model: str | None = None) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=default_model,
        required=default_model is None,
        help="Hugging Face model directory, a llama.cpp .gguf file, or random:<preset> (random weights)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", help=f"auto (the checkpoint's), {', '.join(RUN_DTYPES)}")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda[:N]")
    g.add_argument("--seed", type=int, default=_ENGINE_DEFAULTS.seed)
    g.add_argument("--block-size", type=int, default=_ENGINE_DEFAULTS.block_size, help="tokens per KV block")
    g.add_argument(
        "--kv-cache-memory", type=float, default=None, help="GiB for the KV pool (default: from free memory)"
    )
    g.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-memory)"
    )
    g.add_argument("--max-num-seqs", type=int, default=_ENGINE_DEFAULTS.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=_ENGINE_DEFAULTS.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--scheduler", choices=SCHEDULER_POLICIES, default=_ENGINE_DEFAULTS.scheduler)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="quantize the linear layers' weights at load: int8 (llama.cpp's Q8_0), int4 (Q4_0), "
        "int4_asym (Q4_1) in blocks of 32 along K; q4_k, q6_k in super-blocks of 256",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache storage: auto (the model's dtype), int8, fp8 (e4m3); scales per token and KV head",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}; "adaptive": false always proposes k',
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=_ENGINE_DEFAULTS.tensor_parallel_size,
        help="split every weight matrix over N ranks (torch.distributed: gloo on CPU, NCCL on CUDA); "
        "ridge starts ranks 1..N-1 itself, or run one ridge per rank under torchrun",
    )
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        help='disaggregated serving, as JSON: {"kv_role": "kv_producer", "kv_port": 14600} runs prompts only '
        'and hands their KV cache over; {"kv_role": "kv_consumer", "kv_port": 14700} decodes handed-over '
        'requests; "kv_ip" defaults to 127.0.0.1 (see ridge router)',
    )
    g.add_argument(
        "--kernels",
        choices=KERNEL_CHOICES,
        default="auto",
        help="auto (ridge's AVX-512 kernels on CPU, its AVX2 ones without AVX-512, its Triton kernels on "
        "CUDA), torch (the reference ops), ridge (the CPU kernels or an error), avx2 (the AVX2 kernels "
        "even on an AVX-512 CPU, or an error)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step op by op from Python: on CPU, no decode plan (a bf16 decode step's "
        "layers in one call of ridge's kernels, the same results bit for bit); on CUDA, no CUDA graphs",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch each step before the last one's tokens are back (the host's work "
        "overlaps the GPU's); the same outputs. One process, no KV transfer; with speculative decoding, the "
        "steps its policy drafts nothing for. Default: on for CUDA where it applies, off on the CPU",
    )
    g.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="multi-step scheduling: a step of plain decodes (no penalties, min_tokens or grammar) "
        "runs up to this many forward passes, the host's scheduling and output processing once for all of "
        "them; tokens stream in runs of that many. Not with speculative decoding, tensor parallelism, KV "
        "transfer or --async-scheduling. Default 1",
    )


def engine_options(args: argparse.Namespace) -> dict:
    """The parsed engine flags as ``LLM(...)`` keywords (model excluded)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the CLI's default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="also return the top-N logprobs")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
