"""``ridge analyze``: the roofline of a model's prefill and decode, or of one matmul.

``register(subparsers)`` adds the subcommand; bad input raises ValueError, which ``ridge.cli``
turns into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from ridge.quantization.formats import FORMAT_ALIASES, FORMATS
from ridge.roofline.analyze import UNITS, Conventions, Workload, analyze, infer_compute_dtype
from ridge.roofline.hardware import DEFAULT_HARDWARE, HARDWARE_PRESETS, Hardware, resolve_hardware
from ridge.roofline.ops import (
    ATTENTION_CONVENTIONS,
    DTYPE_BYTES,
    EMBEDDING_CONVENTIONS,
    LINK_PRESETS,
    WEIGHT_FORMATS,
    CostConventions,
    Link,
    Precision,
    dtype_bytes,
    matmul_compute_bound_rows,
    matmul_cost,
)
from ridge.roofline.shapes import load_model

# the formats ridge's quantized CPU kernel runs (int8 activations): their ceiling is probed
BLOCK_FORMAT_NAMES = frozenset({*FORMATS, *FORMAT_ALIASES})

EPILOG = """examples:
  ridge analyze --model llama-3.1-8b --hardware h100-sxm --prompt-len 2048 --output-len 256 --batch 1,8,64,256
  ridge analyze --model mixtral-8x7b --hardware a100-80gb --weight-bits 4 --tp 2 --json
  ridge analyze --model path/to/model_dir --hardware local --plot roofline.png
  ridge analyze --matmul 100 4096 4096 --dtype fp32
  ridge analyze --model tinyllama-1.1b --hardware local --weight-format int4 --disaggregated --prompt-len 1024
"""


def register(subparsers) -> None:
    """Add ``analyze`` to an argparse subparsers object; it runs ``run(args) -> int``."""
    parser = subparsers.add_parser(
        "analyze",
        help="roofline of every prefill and decode operator for a model on some hardware",
        description="Roofline analysis: FLOPs, bytes, intensity, bound and time of every operator "
        "of prefill and decode, for a preset or any Hugging Face config, on preset, custom or "
        "measured (local) hardware.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to analyze")
    what.add_argument(
        "--model",
        default="llama-3.1-8b",
        help="preset name, config.json path or model directory (default: %(default)s)",
    )
    what.add_argument(
        "--matmul",
        nargs=3,
        type=int,
        metavar=("M", "K", "N"),
        help="analyze one (M, K) x (K, N) matmul instead of a model",
    )
    what.add_argument(
        "--dtype", choices=list(DTYPE_BYTES), default="bf16", help="element type for --matmul (default: %(default)s)"
    )

    hw = parser.add_argument_group("hardware")
    hw.add_argument(
        "--hardware",
        default=None,
        help=f"{', '.join(HARDWARE_PRESETS)}, local (measured here), custom, or a hardware "
        f"JSON file (default: {DEFAULT_HARDWARE})",
    )
    hw.add_argument("--peak-tflops", type=float, help="override the peak of the compute dtype")
    hw.add_argument("--bandwidth-gbs", type=float, help="override memory bandwidth (decimal GB/s)")
    hw.add_argument("--memory-gib", type=float, help="override memory capacity (GiB)")
    hw.add_argument(
        "--compute-dtype",
        choices=list(DTYPE_BYTES),
        help="dtype whose peak applies (default: from weight/activation bits)",
    )
    hw.add_argument("--reprobe", action="store_true", help="with --hardware local: measure again")

    load = parser.add_argument_group("workload")
    load.add_argument("--prompt-len", type=int, default=2048, help="default: %(default)s")
    load.add_argument("--output-len", type=int, default=256, help="default: %(default)s")
    load.add_argument(
        "--batch", type=_int_list, default=(1, 8, 64, 256), help="comma-separated batch sizes (default: 1,8,64,256)"
    )
    load.add_argument(
        "--context-len",
        type=_int_list,
        default=(),
        help="decode context lengths to tabulate (default: prompt + output/2)",
    )
    load.add_argument(
        "--weight-bits",
        type=int,
        choices=(32, 16, 8, 4),
        default=None,
        help="default: a GGUF file's own formats (each matrix's, averaged over its weights), else 16",
    )
    load.add_argument(
        "--weight-format",
        default=None,
        help="weights in a storage format, scale bytes counted (bits a weight): "
        + ", ".join(f"{name} ({stored:g})" for name, (_, stored) in WEIGHT_FORMATS.items())
        + "; overrides --weight-bits. A block format on --hardware local takes ridge's kernel for it as "
        "the compute ceiling (measured now, in cache)",
    )
    load.add_argument("--act-bits", type=int, choices=(32, 16, 8, 4), default=16)
    load.add_argument("--kv-bits", type=int, choices=(32, 16, 8, 4), default=16)
    load.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (costs are per rank)")
    load.add_argument(
        "--link",
        default=None,
        help="what connects the --tp ranks (or, with --disaggregated, the instances): local (probed here between "
        f"two processes; the default), {', '.join(LINK_PRESETS)}, or custom GBPS:US (bandwidth per rank, "
        "latency per message)",
    )
    load.add_argument("--spec-k", type=int, default=0, help="speculative decoding: draft tokens per step")
    load.add_argument(
        "--spec-acceptance",
        type=float,
        default=0.7,
        help="speculative decoding: per-token acceptance rate (default: %(default)s)",
    )

    dis = parser.add_argument_group("disaggregated serving (--disaggregated)")
    dis.add_argument(
        "--disaggregated",
        action="store_true",
        help="predict colocated against disaggregated serving: a --prompt-len prompt every --arrival-interval "
        "seconds while --decode-streams sequences decode; the KV cache crosses --link",
    )
    dis.add_argument("--arrival-interval", type=float, default=2.0, help="seconds between prompts (default: 2)")
    dis.add_argument("--decode-streams", type=int, default=8, help="sequences decoding meanwhile (default: 8)")
    dis.add_argument("--decode-context", type=int, default=256, help="their context length (default: 256)")
    dis.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="colocated: tokens per step (default: 2048)"
    )
    dis.add_argument(
        "--prefill-share",
        type=float,
        default=0.5,
        help="disaggregated: the prefill instance's share of the machine (default: 0.5)",
    )

    conv = parser.add_argument_group("conventions (stated in every output)")
    conv.add_argument(
        "--attention",
        choices=ATTENTION_CONVENTIONS,
        default="causal",
        help="attention FLOPs: causal (default) or the full rectangle",
    )
    conv.add_argument(
        "--embedding",
        choices=EMBEDDING_CONVENTIONS,
        default="gathered",
        help="input-embedding reads: gathered rows (default) or the full table",
    )
    conv.add_argument("--units", choices=UNITS, default="GB", help="print bytes in decimal GB or GiB")
    conv.add_argument("--unfused", action="store_true", help="separate q/k/v and gate/up projections")

    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--plot", metavar="FILE.png", help="also write the roofline plot")
    out.add_argument("--no-ops", action="store_true", help="tables: summary only, no per-operator rows")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
    if args.matmul:
        return _run_matmul(args, console)
    model, file_weights = load_model(args.model)
    workload = Workload(
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        batches=tuple(args.batch),
        decode_context_lens=tuple(args.context_len),
        precision=_precision(args, file_weights),
        spec_k=args.spec_k,
        spec_acceptance=args.spec_acceptance,
    )
    conventions = Conventions(
        cost=CostConventions(
            attention=args.attention,
            embedding=args.embedding,
            tensor_parallel=args.tp,
            fused_projections=not args.unfused,
        ),
        units=args.units,
    )
    hardware, args.compute_dtype = _hardware(args, workload.precision)
    if args.disaggregated:
        return _run_disaggregated(args, console, model, hardware, workload, conventions)
    link = resolve_link(args.link) if args.tp > 1 else None
    analysis = analyze(model, hardware, workload, conventions, compute_dtype=args.compute_dtype, link=link)
    if args.plot:
        from ridge.roofline.plot import plot_analysis

        written = plot_analysis(analysis, args.plot)
        if not args.json:
            console.print(f"plot written to {written}")
    if args.json:
        from ridge.roofline.report import analysis_to_json

        print(json.dumps(analysis_to_json(analysis), indent=2))
    else:
        from ridge.roofline.report import render_text

        render_text(analysis, console, show_ops=not args.no_ops)
    return 0


def _run_disaggregated(args, console, model, hardware, workload, conventions) -> int:
    from ridge.roofline.disaggregation import ServingPattern, analyze_disaggregation, render_text

    pattern = ServingPattern(
        prompt_tokens=args.prompt_len,
        arrival_interval_s=args.arrival_interval,
        decode_streams=args.decode_streams,
        decode_context=args.decode_context,
        chunk_tokens=args.max_num_batched_tokens,
        prefill_share=args.prefill_share,
    )
    result = analyze_disaggregation(
        model, hardware, pattern, resolve_link(args.link, "gloo"), workload, conventions, args.compute_dtype
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        render_text(result, console)
    return 0


def resolve_link(spec: str | None, transport: str | None = None) -> Link:
    """A preset, ``local`` (probed on this machine, cached; ``transport``: see ``local_link``),
    or ``GBPS:US``."""
    if spec is None or spec == "local":
        from ridge.distributed.probe import local_link

        return local_link(transport=transport)
    if spec in LINK_PRESETS:
        return LINK_PRESETS[spec]
    try:
        gbps, us = (float(part) for part in spec.split(":"))
    except ValueError:
        raise ValueError(
            f"--link must be local, one of {', '.join(LINK_PRESETS)}, or GBPS:US (e.g. 25:20), got {spec!r}"
        ) from None
    if gbps <= 0 or us < 0:
        raise ValueError(f"--link needs a positive bandwidth and a latency >= 0, got {spec!r}")
    return Link(f"custom ({gbps:g} GB/s, {us:g} us)", gbps * 1e9, us * 1e-6, "given")


def _hardware_spec(args: argparse.Namespace) -> str | None:
    """--hardware as given; with none but both --peak-tflops and --bandwidth-gbs, ``custom``."""
    if args.hardware is None and args.peak_tflops is not None and args.bandwidth_gbs is not None:
        return "custom"
    return args.hardware


def _precision(args: argparse.Namespace, file_weights: dict[str, int] | None) -> Precision:
    """--weight-format, else --weight-bits, else a GGUF file's own formats (each matrix in its
    own; ``Precision.for_weight_mix``), else 16-bit weights."""
    if args.weight_format:
        return Precision.for_weight_format(args.weight_format, args.act_bits, args.kv_bits)
    if args.weight_bits is None and file_weights:
        return Precision.for_weight_mix(file_weights, args.act_bits, args.kv_bits)
    return Precision(args.weight_bits or 16, args.act_bits, args.kv_bits)


def _block_format(args: argparse.Namespace, precision: Precision) -> str | None:
    """The block format whose kernel sets the compute ceiling on local hardware: the one asked
    for, or the one holding most of a GGUF file's weights."""
    name = args.weight_format or (precision.weight_mix[0][0] if precision.weight_mix else None)
    return name if name and name.lower() in BLOCK_FORMAT_NAMES else None


def _hardware(args: argparse.Namespace, precision: Precision) -> tuple[Hardware, str | None]:
    """Resolve --hardware, then apply the overrides to the dtype the analysis will use; returns
    the hardware and the compute dtype to analyze in (None: inferred from the precision)."""
    spec = _hardware_spec(args)
    if spec == "custom":
        dtype = args.compute_dtype or infer_compute_dtype(precision)
        hardware = resolve_hardware(
            "custom",
            dtype=dtype,
            peak_tflops=args.peak_tflops,
            bandwidth_gbs=args.bandwidth_gbs,
            memory_gib=args.memory_gib,
        )
        return hardware, args.compute_dtype
    base = resolve_hardware(spec, reprobe=args.reprobe)
    dtype = args.compute_dtype or infer_compute_dtype(precision, base)
    compute_dtype = args.compute_dtype
    block_format = _block_format(args, precision)
    if block_format and base.name == "local" and args.compute_dtype is None and args.peak_tflops is None:
        # ridge's CPU kernel for a block format multiplies int8 activations by the weights'
        # codes (VNNI): its ceiling is that kernel's measured rate, not the ISA's int8 peak
        from ridge.roofline.probe import probe_block_kernel

        measured = probe_block_kernel(block_format)
        if measured is not None:
            dtype = "int8"
            base = base.with_kernel_peak(dtype, measured, f"ridge's {block_format} kernel (64 rows, in cache)")
            compute_dtype = dtype
    return base.with_overrides(
        dtype=dtype, peak_tflops=args.peak_tflops, bandwidth_gbs=args.bandwidth_gbs, memory_gib=args.memory_gib
    ), compute_dtype


def matmul_result(m: int, k: int, n: int, dtype: str, hardware: Hardware | None = None) -> dict:
    """The ``--matmul`` document: FLOPs, minimum bytes, intensity; placed under ``hardware``."""
    op = matmul_cost(m, k, n, dtype)
    result = {
        "m": m,
        "k": k,
        "n": n,
        "dtype": dtype,
        "dtype_bytes": dtype_bytes(dtype),
        "flops": op.flops,
        "bytes": op.bytes,
        "intensity": op.intensity,
    }
    if hardware is None:
        return result
    if dtype not in hardware.peak_flops:
        result["hardware_note"] = f"{hardware.name} has no {dtype} peak; pass --peak-tflops to place it"
        return result
    peak, bandwidth = hardware.peak(dtype), hardware.bandwidth_bytes_per_s
    result.update(
        hardware={
            "name": hardware.name,
            "peak_flops": peak,
            "bandwidth_bytes_per_s": bandwidth,
            "ridge_point": peak / bandwidth,
            "source": hardware.source,
        },
        bound=op.bound(peak, bandwidth),
        time_s=op.time_s(peak, bandwidth),
        compute_bound_m=matmul_compute_bound_rows(k, n, dtype, peak / bandwidth),
    )
    return result


def _run_matmul(args: argparse.Namespace, console) -> int:
    if args.plot:
        raise ValueError("--plot is for model analyses, not --matmul")
    hardware = resolve_hardware(
        _hardware_spec(args),
        dtype=args.dtype,
        peak_tflops=args.peak_tflops,
        bandwidth_gbs=args.bandwidth_gbs,
        memory_gib=args.memory_gib,
        reprobe=args.reprobe,
    )
    result = matmul_result(*args.matmul, args.dtype, hardware)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from ridge.roofline.report import render_matmul_text

        render_matmul_text(result, console, args.units)
    return 0
