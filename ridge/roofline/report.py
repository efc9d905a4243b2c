"""Rendering an ``Analysis``: readable tables (``rich``) and the ``--json`` document.

JSON contract (scripts rely on these keys; more may be added): ``model.params_total``,
``model.params_active``, ``model.weight_bytes``, ``model.kv_bytes_per_token``;
``hardware.peak_flops``, ``hardware.bandwidth_bytes_per_s``, ``hardware.ridge_point``;
``prefill.{flops,bytes,time_s,ops}``; ``decode[]`` with ``batch, context_len, flops, bytes,
time_s, tokens_per_s, bound, ops``; every op with ``name, m, k, n, flops, bytes, intensity,
bound, time_s``; top level ``max_batch``, ``compute_bound_batch``. ``--matmul``: ``flops, bytes,
intensity``. Bytes in JSON are always raw byte counts, times in seconds.
"""

from __future__ import annotations

import importlib.metadata
import math
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from ridge.roofline.analyze import MAX_SEARCH_BATCH, Analysis, Phase, Roof
from ridge.roofline.hardware import Hardware
from ridge.roofline.ops import OpCost


def _ridge_version() -> str:
    try:
        return importlib.metadata.version("ridge")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_DECIMAL = ("B", "kB", "MB", "GB", "TB", "PB")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


# ---- number formatting ----------------------------------------------------------------------
def fmt_bytes(value: float, units: str = "GB") -> str:
    if value == 0:
        return "-"
    base, names = (1000.0, _DECIMAL) if units == "GB" else (1024.0, _BINARY)
    i = 0
    while abs(value) >= base and i < len(names) - 1:
        value /= base
        i += 1
    return f"{value:.3g} {names[i]}" if i else f"{value:.0f} B"


def fmt_rate_bytes(value: float, units: str = "GB") -> str:
    return f"{fmt_bytes(value, units)}/s"


def fmt_si(value: float, unit: str = "") -> str:
    """1.23e12 -> '1.23 T' + unit."""
    if value == 0:
        return f"0 {unit}".strip()
    prefixes = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
    for scale, prefix in prefixes:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".strip()


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e9:.3g} ns"


def fmt_intensity(value: float) -> str:
    if math.isinf(value):
        return "-"
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def fmt_params(value: float) -> str:
    """A parameter count the way model cards write it: 260K, 1.10B, 7.2M."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}" if value < 100 * scale else f"{value / scale:.0f}{suffix}"
    return f"{value:.0f}"


def fmt_count(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def describe_hardware(hw: Hardware, roof: Roof, units: str) -> list[str]:
    lines = [
        f"{hw.name}: {fmt_si(roof.peak_flops, 'FLOP/s')} {roof.dtype}, "
        f"{fmt_rate_bytes(hw.bandwidth_bytes_per_s, units)}, {fmt_bytes(hw.memory_bytes, units)}; "
        f"ridge point {roof.ridge_point:.1f} FLOP/byte",
        f"source: {hw.source}",
    ]
    if hw.measured_at:
        lines.append(f"measured {hw.measured_at[:10]} ({hw.measured_at})")
    if hw.bandwidth_probe:
        m = hw.bandwidth_probe
        lines.append(
            f"probe spread: bandwidth {fmt_rate_bytes(m.median, units)} "
            f"(range {fmt_rate_bytes(m.low, units)} .. {fmt_rate_bytes(m.high, units)}, n={m.samples})"
        )
    for dtype, m in hw.flops_probes.items():
        lines.append(
            f"probe spread: {dtype} matmul {fmt_si(m.median, 'FLOP/s')} "
            f"(range {fmt_si(m.low, 'FLOP/s')} .. {fmt_si(m.high, 'FLOP/s')}, n={m.samples})"
        )
    return lines


# ---- tables ---------------------------------------------------------------------------------
def render_text(analysis: Analysis, console: Console, show_ops: bool = True) -> None:
    a, units = analysis, analysis.conventions.units
    w = a.workload
    console.print(f"[bold]ridge analyze[/bold] {_ridge_version()}")
    console.print(f"[bold]model[/bold]     {a.model.name}: {_model_line(a)}")
    for note in a.model.notes:
        console.print(f"          note: {note}")
    for warning in a.warnings:
        console.print(f"[bold red]warning[/bold red]   {warning}")
    for i, line in enumerate(describe_hardware(a.hardware, a.roof, units)):
        console.print(("[bold]hardware[/bold]  " if i == 0 else "          ") + line)
    p = w.precision
    console.print(
        f"[bold]workload[/bold]  prompt {w.prompt_len}, output {w.output_len}, batch "
        f"{','.join(map(str, w.batches))}; weights {p.weight_bits}-bit, activations "
        f"{p.activation_bits}-bit, KV {p.kv_bits}-bit; TP {a.conventions.cost.tensor_parallel}"
        + (f"; speculative k={w.spec_k}, acceptance {w.spec_acceptance:g}" if w.spec_k else "")
    )
    console.print("[bold]conventions[/bold]")
    for line in a.conventions.describe(w):
        console.print(f"  - {line}")
    if show_ops:
        console.print(_ops_table(a.prefill, a.roof, units, f"Prefill: 1 x {w.prompt_len} tokens"))
        for phase in a.decode:
            title = f"Decode step: batch {phase.batch}, context {phase.context_len}"
            console.print(_ops_table(phase, a.roof, units, title))
    console.print(_batch_table(a))
    console.print(_summary_table(a))


def _model_line(a: Analysis) -> str:
    m = a.model
    parts = [f"{fmt_params(a.params_total)} params"]
    if m.is_moe:
        parts.append(f"{fmt_params(a.params_active)} active ({m.moe.experts_per_token} of {m.moe.num_experts} experts)")
    attn = "MLA" if m.mla else ("MHA" if m.num_kv_heads == m.num_heads else f"GQA {m.num_heads}/{m.num_kv_heads}")
    parts.append(f"{m.num_layers} layers, d={m.hidden_size}, {attn}")
    return ", ".join(parts)


def _ops_table(phase: Phase, roof: Roof, units: str, title: str) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for header in (
        "op",
        "layers",
        "M x K x N",
        "count",
        "FLOPs",
        "weights",
        "activations",
        "KV read",
        "KV write",
        "FLOP/B",
        "bound",
        "time",
        "%",
    ):
        table.add_column(header, justify="left" if header in ("op", "M x K x N", "bound") else "right")
    for op in phase.cost.ops:
        t = op.time_s(roof.peak_flops, roof.bandwidth)
        table.add_row(
            op.name,
            str(op.layers),
            f"{op.m} x {op.k} x {op.n}",
            fmt_count(op.count),
            fmt_si(op.flops),
            fmt_bytes(op.weight_bytes, units),
            fmt_bytes(op.activation_bytes, units),
            fmt_bytes(op.kv_read_bytes, units),
            fmt_bytes(op.kv_write_bytes, units),
            fmt_intensity(op.intensity),
            op.bound(roof.peak_flops, roof.bandwidth),
            fmt_time(t),
            f"{100 * t / phase.time_s:.1f}",
        )
    c = phase.cost
    table.add_section()
    table.add_row(
        "[bold]total[/bold]",
        "",
        "",
        "",
        fmt_si(c.flops),
        fmt_bytes(c.weight_bytes, units),
        fmt_bytes(c.activation_bytes, units),
        fmt_bytes(c.kv_read_bytes, units),
        fmt_bytes(c.kv_write_bytes, units),
        fmt_intensity(c.intensity),
        phase.bound,
        f"[bold]{fmt_time(phase.time_s)}[/bold]",
        "100",
    )
    return table


def _batch_table(a: Analysis) -> Table:
    units = a.conventions.units
    table = Table(title="Per batch", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    headers = ["batch", "TTFT (B prompts)", "TPOT (mean)", "tokens/s", "request latency", "KV cache", "fits"]
    if a.model.is_moe:
        headers.append("experts/layer")
    if a.spec_verify:
        headers += ["spec tokens/s", "spec speedup"]
    for h in headers:
        table.add_column(h, justify="right")
    for s in a.batches:
        row = [
            str(s.batch),
            fmt_time(s.ttft_s),
            fmt_time(s.tpot_s),
            f"{s.tokens_per_s:,.0f}",
            fmt_time(s.e2e_s),
            fmt_bytes(s.kv_bytes, units),
            "yes" if s.fits else "[red]no[/red]",
        ]
        if a.model.is_moe:
            row.append(f"{s.experts_touched_per_layer:.1f} / {a.model.moe.num_experts}")
        if a.spec_verify:
            row += [f"{s.spec_tokens_per_s:,.0f}", f"{s.spec_speedup:.2f}x"]
        table.add_row(*row)
    return table


def _comm_rows(a: Analysis, units: str) -> list[tuple[str, str]]:
    """Tensor parallelism: what one step sends and how long it takes on the link."""
    link, tp = a.roof.link, a.conventions.cost.tensor_parallel
    if tp == 1:
        return []
    rows = []
    for label, phase in (("prefill", a.prefill), ("decode", a.decode[0])):
        comm = phase.cost.comm
        timing = (
            f", {fmt_time(phase.comm_s)} on {link.name} ({100 * phase.comm_s / phase.time_s:.0f}% of the step)"
            if link is not None
            else " (no link given: not timed)"
        )
        rows.append(
            (
                f"communication, {label} (batch {phase.batch})",
                f"{comm.collectives} collectives, {fmt_bytes(comm.link_bytes, units)} sent per rank{timing}",
            )
        )
    if link is not None:
        rows.append(
            (
                "link",
                f"{link.name}: {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, {link.latency_s * 1e6:.0f} us per "
                f"collective ({link.source})",
            )
        )
    return rows


def _summary_table(a: Analysis) -> Table:
    units = a.conventions.units
    tp = a.conventions.cost.tensor_parallel
    table = Table(title="Summary", box=box.SIMPLE_HEAD, title_justify="left", show_header=False, pad_edge=False)
    table.add_column("quantity")
    table.add_column("value")
    rows = [
        ("parameters", f"{a.params_total:,}" + (f" total, {a.params_active:,.0f} active" if a.model.is_moe else "")),
        (
            "weight bytes",
            fmt_bytes(a.weight_bytes, units)
            + (f" ({fmt_bytes(a.weight_bytes_per_gpu, units)} per GPU)" if tp > 1 else ""),
        ),
        (
            "KV cache per token",
            f"{a.kv_bytes_per_token:,.0f} B" + (f" ({a.kv_bytes_per_token_per_gpu:,.0f} B per GPU)" if tp > 1 else ""),
        ),
        (
            "KV cache per sequence",
            f"{fmt_bytes(a.kv_bytes_per_sequence, units)} at {a.workload.final_context} tokens"
            + (" (per GPU)" if tp > 1 else ""),
        ),
        (
            "time to first token",
            f"{fmt_time(a.prefill.time_s)} (1 prompt, {a.prefill.bound}-bound, "
            f"{a.prefill.tokens_per_s:,.0f} prompt tokens/s)",
        ),
        *_comm_rows(a, units),
        (
            "decode floor",
            f"{fmt_time(a.decode_floor_s)} per token = weight bytes read per step / bandwidth "
            f"-> ceiling {1 / a.decode_floor_s:,.1f} tokens/s per sequence",
        ),
        (
            "compute-bound decode",
            _batch_or_never(a.compute_bound_batch, "whole step", "KV reads grow with the batch")
            + "; "
            + _batch_or_never(a.compute_bound_batch_linear, "linear layers", "weight reads dominate")
            + f" (context {a.workload.mean_decode_context})",
        ),
        ("memory fit", _memory_fit(a, units)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _memory_fit(a: Analysis, units: str) -> str:
    memory = fmt_bytes(a.hardware.memory_bytes, units)
    if a.max_batch >= 1:
        return f"largest batch {a.max_batch:,} (weights + KV at {a.workload.final_context} tokens in {memory})"
    if a.weight_bytes_per_gpu >= a.hardware.memory_bytes:
        return f"does not fit: the weights alone ({fmt_bytes(a.weight_bytes_per_gpu, units)}) exceed {memory}"
    return (
        f"does not fit: weights ({fmt_bytes(a.weight_bytes_per_gpu, units)}) + one sequence's KV at "
        f"{a.workload.final_context} tokens ({fmt_bytes(a.kv_bytes_per_sequence, units)}) exceed {memory}"
    )


def _batch_or_never(batch: int | None, what: str, why: str) -> str:
    if batch:
        return f"{what} from batch {batch:,}"
    return f"{what} never up to batch {MAX_SEARCH_BATCH:,} ({why})"


def render_matmul_text(result: dict[str, Any], console: Console, units: str) -> None:
    console.print(
        f"[bold]matmul[/bold] ({result['m']}, {result['k']}) x ({result['k']}, {result['n']}) in {result['dtype']}"
    )
    console.print(
        "conventions: FLOPs = 2*M*K*N; minimum bytes = every input and output element once "
        f"at {result['dtype_bytes']:g} bytes; intensity = FLOPs / bytes"
    )
    table = Table(box=box.SIMPLE_HEAD, show_header=False, pad_edge=False)
    table.add_column("quantity")
    table.add_column("value")
    table.add_row("FLOPs", f"{result['flops']:,.0f}")
    table.add_row("bytes", f"{result['bytes']:,.0f} ({fmt_bytes(result['bytes'], units)})")
    table.add_row("intensity", f"{result['intensity']:.2f} FLOP/byte")
    hw = result.get("hardware")
    if hw:
        table.add_row(
            "hardware",
            f"{hw['name']}: {fmt_si(hw['peak_flops'], 'FLOP/s')} {result['dtype']}, "
            f"{fmt_rate_bytes(hw['bandwidth_bytes_per_s'], units)}, ridge {hw['ridge_point']:.1f}",
        )
        table.add_row("bound", f"{result['bound']} ({fmt_time(result['time_s'])})")
        m = result["compute_bound_m"]
        table.add_row("compute-bound from", f"M = {m:,}" if m else "never at this K, N")
    elif result.get("hardware_note"):
        table.add_row("hardware", result["hardware_note"])
    console.print(table)


# ---- JSON -----------------------------------------------------------------------------------
def _finite(value: float) -> float | None:
    return None if math.isinf(value) or math.isnan(value) else value


def op_to_json(op: OpCost, roof: Roof) -> dict[str, Any]:
    return {
        "name": op.name,
        "kind": op.kind,
        "m": op.m,
        "k": op.k,
        "n": op.n,
        "count": op.count,
        "layers": op.layers,
        "flops": op.flops,
        "bytes": op.bytes,
        "bytes_weights": op.weight_bytes,
        "bytes_activations": op.activation_bytes,
        "bytes_kv_read": op.kv_read_bytes,
        "bytes_kv_write": op.kv_write_bytes,
        "intensity": _finite(op.intensity),
        "bound": op.bound(roof.peak_flops, roof.bandwidth),
        "time_s": op.time_s(roof.peak_flops, roof.bandwidth),
    }


def phase_to_json(phase: Phase, roof: Roof) -> dict[str, Any]:
    c = phase.cost
    return {
        "kind": phase.kind,
        "batch": phase.batch,
        "context_len": phase.context_len,
        "tokens": c.tokens,
        "flops": c.flops,
        "bytes": c.bytes,
        "bytes_weights": c.weight_bytes,
        "bytes_activations": c.activation_bytes,
        "bytes_kv_read": c.kv_read_bytes,
        "bytes_kv_write": c.kv_write_bytes,
        "intensity": _finite(c.intensity),
        "time_s": phase.time_s,
        "tokens_per_s": phase.tokens_per_s,
        "bound": phase.bound,
        "comm": {
            "collectives": c.comm.collectives,
            "payload_bytes": c.comm.payload_bytes,
            "link_bytes_per_rank": c.comm.link_bytes,
            "time_s": phase.comm_s,
        },
        "ops": [op_to_json(op, roof) for op in c.ops],
    }


def hardware_to_json(hw: Hardware, roof: Roof) -> dict[str, Any]:
    data = hw.to_json()
    data["peak_flops_by_dtype"] = data.pop("peak_flops")
    data.update(
        compute_dtype=roof.dtype,
        peak_flops=roof.peak_flops,
        bandwidth_bytes_per_s=roof.bandwidth,
        ridge_point=roof.ridge_point,
    )
    return data


def analysis_to_json(a: Analysis) -> dict[str, Any]:
    m, w, conv = a.model, a.workload, a.conventions
    return {
        "ridge_version": _ridge_version(),
        "conventions": {
            "attention": conv.cost.attention,
            "embedding": conv.cost.embedding,
            "tensor_parallel": conv.cost.tensor_parallel,
            "fused_projections": conv.cost.fused_projections,
            "units": conv.units,
            "notes": conv.describe(w),
        },
        "model": {
            "name": m.name,
            "params_total": a.params_total,
            "params_active": a.params_active,
            "weight_bytes": a.weight_bytes,
            "weight_bytes_per_gpu": a.weight_bytes_per_gpu,
            "kv_bytes_per_token": a.kv_bytes_per_token,
            "kv_bytes_per_token_per_gpu": a.kv_bytes_per_token_per_gpu,
            "kv_bytes_per_sequence": a.kv_bytes_per_sequence,
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "num_heads": m.num_heads,
            "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "moe": None
            if not m.is_moe
            else {
                "num_experts": m.moe.num_experts,
                "experts_per_token": m.moe.experts_per_token,
                "moe_layers": m.moe_layers,
            },
            "mla": None
            if m.mla is None
            else {
                "kv_lora_rank": m.mla.kv_lora_rank,
                "qk_rope_head_dim": m.mla.qk_rope_head_dim,
            },
            "notes": list(m.notes),
        },
        "hardware": hardware_to_json(a.hardware, a.roof),
        "link": None
        if a.roof.link is None
        else {
            "name": a.roof.link.name,
            "bandwidth_bytes_per_s": a.roof.link.bandwidth_bytes_per_s,
            "latency_s": a.roof.link.latency_s,
            "source": a.roof.link.source,
        },
        "workload": {
            "prompt_len": w.prompt_len,
            "output_len": w.output_len,
            "batches": list(w.batches),
            "decode_context_lens": list(w.reported_contexts()),
            "weight_bits": w.precision.weight_bits,
            "weight_storage_bits": w.precision.weight_bytes * 8,
            "weight_mix": dict(w.precision.weight_mix),
            "activation_bits": w.precision.activation_bits,
            "kv_bits": w.precision.kv_bits,
            "spec_k": w.spec_k,
            "spec_acceptance": w.spec_acceptance,
        },
        "prefill": phase_to_json(a.prefill, a.roof),
        "decode": [phase_to_json(p, a.roof) for p in a.decode],
        "spec_verify": [phase_to_json(p, a.roof) for p in a.spec_verify],
        "warnings": list(a.warnings),
        "summary": {
            "ttft_s": a.prefill.time_s,
            "decode_floor_s": a.decode_floor_s,
            "decode_ceiling_tokens_per_s": 1 / a.decode_floor_s,
            "batches": [
                {
                    "batch": s.batch,
                    "ttft_s": s.ttft_s,
                    "tpot_s": s.tpot_s,
                    "tokens_per_s": s.tokens_per_s,
                    "request_latency_s": s.e2e_s,
                    "kv_bytes": s.kv_bytes,
                    "fits_in_memory": s.fits,
                    "experts_touched_per_layer": s.experts_touched_per_layer,
                    "spec_tokens_per_s": s.spec_tokens_per_s,
                    "spec_speedup": s.spec_speedup,
                }
                for s in a.batches
            ],
            "sweep": [
                {"batch": p.batch, "tpot_s": p.tpot_s, "tokens_per_s": p.tokens_per_s, "fits_in_memory": p.fits}
                for p in a.sweep
            ],
        },
        "max_batch": a.max_batch,
        "compute_bound_batch": a.compute_bound_batch,
        "compute_bound_batch_linear": a.compute_bound_batch_linear,
    }
