"""Colocated against disaggregated serving, on the roofline: what moving the KV cache costs and
what separating prefill from decode buys, for one arrival pattern.

The pattern: ``decode_streams`` sequences decode steadily (context ``decode_context``) while a
prompt of ``prompt_tokens`` arrives every ``arrival_interval_s`` seconds.

**Colocated** (one instance, the whole machine): the prompt is cut into chunks of
``chunk_tokens - decode_streams`` tokens (chunked prefill), each riding in a step with the
decodes. Those steps cost ``t_mixed``, the others ``t_decode``; the decode users' inter-token
latency (ITL) is ``t_mixed`` in a step that carries a chunk, so its p99 is ``t_mixed`` whenever
more than 1% of the steps carry one. Time to first token: the chunks' steps.

**Disaggregated** (a prefill instance on ``prefill_share`` of the machine's compute and
bandwidth, the decode instance on the rest; shares scale both, a stated convention): the
prompt runs whole on the prefill instance (``t_prefill``), its KV cache (``kv_bytes``) crosses
the link (``transfer_s`` = latency + bytes / bandwidth), and the consumer copies it into its
pool (reading and writing the bytes). Decode steps cost ``t_decode`` on the decode share; a
step that receives a transfer pays its copy too. TTFT: prefill + transfer + one decode step.

Each step is priced by the analyzer (``Analyzer.step``: the max of compute time and memory
time, per operator); every figure is a floor, to be held against measurements.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ridge.roofline import ops
from ridge.roofline.analyze import Analyzer, Conventions, Roof, Workload, infer_compute_dtype
from ridge.roofline.hardware import Hardware
from ridge.roofline.shapes import ModelShape

# The ITL percentile reported: a step kind present in more than this share of steps sets it.
P99_SHARE = 0.01


@dataclass(frozen=True)
class ServingPattern:
    prompt_tokens: int = 1024
    arrival_interval_s: float = 2.0
    decode_streams: int = 8
    decode_context: int = 256
    chunk_tokens: int = 2048  # colocated: max_num_batched_tokens
    prefill_share: float = 0.5  # disaggregated: the prefill instance's share of the machine

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.decode_streams < 0 or self.decode_context < 1:
            raise ValueError("prompt_tokens and decode_context must be >= 1, decode_streams >= 0")
        if not self.arrival_interval_s > 0:
            raise ValueError("arrival_interval_s must be > 0")
        if self.chunk_tokens <= self.decode_streams:
            raise ValueError("chunk_tokens must exceed decode_streams (room for a prefill chunk)")
        if not 0 < self.prefill_share < 1:
            raise ValueError("prefill_share must be in (0, 1)")


@dataclass(frozen=True)
class ServingPrediction:
    ttft_s: float
    itl_mean_s: float
    itl_p99_s: float
    decode_tokens_per_s: float  # the decode streams' tokens per second
    saturated: bool  # prompts arrive faster than they can be computed: queues grow


@dataclass(frozen=True)
class DisaggregationAnalysis:
    pattern: ServingPattern
    link: ops.Link
    kv_bytes: float  # one prompt's KV cache, every layer (what crosses the link)
    transfer_s: float
    copy_s: float  # the consumer's copy of a transfer into its pool
    t_decode_full_s: float  # a decode step on the whole machine
    t_mixed_s: float  # a decode step carrying a prefill chunk (colocated)
    num_chunks: int
    t_prefill_share_s: float  # the whole prompt on the prefill share
    t_decode_share_s: float  # a decode step on the decode share
    colocated: ServingPrediction
    disaggregated: ServingPrediction

    @property
    def p99_itl_ratio(self) -> float:
        return self.colocated.itl_p99_s / self.disaggregated.itl_p99_s

    def to_json(self) -> dict:
        out = asdict(self)
        out["link"] = {"name": self.link.name, "bandwidth_bytes_per_s": self.link.bandwidth_bytes_per_s}
        out["link"]["latency_s"] = self.link.latency_s
        out["p99_itl_ratio"] = self.p99_itl_ratio
        return out


def transfer_time_s(kv_bytes: float, link: ops.Link) -> float:
    """One prompt's KV cache over ``link``: one message (latency) and its bytes."""
    return link.latency_s + kv_bytes / link.bandwidth_bytes_per_s


def analyze_disaggregation(
    model: ModelShape,
    hardware: Hardware,
    pattern: ServingPattern,
    link: ops.Link,
    workload: Workload | None = None,
    conventions: Conventions | None = None,
    compute_dtype: str | None = None,
) -> DisaggregationAnalysis:
    """The prediction for ``pattern`` (``workload`` gives the precision; its lengths are unused)."""
    workload = workload if workload is not None else Workload()
    conventions = conventions if conventions is not None else Conventions()
    dtype = compute_dtype or infer_compute_dtype(workload.precision, hardware)
    full = Analyzer(model, Roof(dtype, hardware.peak(dtype), hardware.bandwidth_bytes_per_s), workload, conventions)

    def on_share(share: float) -> Analyzer:
        roof = Roof(dtype, hardware.peak(dtype) * share, hardware.bandwidth_bytes_per_s * share)
        return Analyzer(model, roof, workload, conventions)

    def step_s(az: Analyzer, sequences: dict[tuple[int, int], int]) -> float:
        return az.step(sequences).time_s(az.roof.peak_flops, az.roof.bandwidth)

    p = pattern
    P, B, ctx = p.prompt_tokens, p.decode_streams, p.decode_context
    kv_bytes = P * ops.kv_bytes_per_token(model, workload.precision.kv_bytes, conventions.cost.tensor_parallel)
    decodes = {(1, ctx): B} if B else {}

    # colocated: chunks of (chunk_tokens - B) prompt tokens ride in steps with the B decodes
    chunk = p.chunk_tokens - B
    num_chunks = math.ceil(P / chunk)
    t_decode_full = step_s(full, decodes) if B else 0.0
    mixed_s = []
    for i in range(num_chunks):
        n = min(chunk, P - i * chunk)
        mixed_s.append(step_s(full, {**decodes, (n, i * chunk + n): 1}))
    busy = sum(mixed_s)
    t_mixed = max(mixed_s)
    saturated = busy >= p.arrival_interval_s
    free_steps = 0.0 if saturated or not B else (p.arrival_interval_s - busy) / t_decode_full
    steps = num_chunks + free_steps
    itl_mean = (busy + free_steps * t_decode_full) / steps
    itl_p99 = t_mixed if num_chunks / steps > P99_SHARE else t_decode_full
    colocated = ServingPrediction(busy, itl_mean, itl_p99, B / itl_mean if B else 0.0, saturated)

    # disaggregated: the prompt whole on the prefill share, the decodes alone on the rest
    prefill_az, decode_az = on_share(p.prefill_share), on_share(1 - p.prefill_share)
    t_prefill = step_s(prefill_az, {(P, P): 1})
    transfer = transfer_time_s(kv_bytes, link)
    copy = 2 * kv_bytes / decode_az.roof.bandwidth
    t_decode = step_s(decode_az, decodes) if B else 0.0
    d_steps = p.arrival_interval_s / t_decode if B else 1.0
    d_p99 = t_decode + copy if 1 / d_steps > P99_SHARE else t_decode
    d_mean = t_decode + copy / d_steps
    disaggregated = ServingPrediction(
        t_prefill + transfer + t_decode + copy,
        d_mean,
        d_p99,
        B / d_mean if B else 0.0,
        t_prefill >= p.arrival_interval_s,
    )
    return DisaggregationAnalysis(
        pattern=p,
        link=link,
        kv_bytes=kv_bytes,
        transfer_s=transfer,
        copy_s=copy,
        t_decode_full_s=t_decode_full,
        t_mixed_s=t_mixed,
        num_chunks=num_chunks,
        t_prefill_share_s=t_prefill,
        t_decode_share_s=t_decode,
        colocated=colocated,
        disaggregated=disaggregated,
    )


def render_text(result: DisaggregationAnalysis, console) -> None:
    from rich.table import Table

    p = result.pattern
    console.print(
        f"serving pattern: a {p.prompt_tokens}-token prompt every {p.arrival_interval_s:g} s while "
        f"{p.decode_streams} streams decode (context {p.decode_context}); colocated chunks of "
        f"{p.chunk_tokens - p.decode_streams} tokens; disaggregated: prefill on {p.prefill_share:.0%} of the machine"
    )
    console.print(
        f"KV cache of one prompt: {result.kv_bytes / 1e6:.2f} MB; over {result.link.name}: "
        f"{result.transfer_s * 1e3:.2f} ms; the consumer's copy into its pool: {result.copy_s * 1e3:.2f} ms"
    )
    table = Table(title="predicted floors (roofline)")
    for column in ("", "TTFT", "ITL mean", "ITL p99", "decode tok/s", "saturated"):
        table.add_column(column, justify="right")
    for name, pred in (("colocated", result.colocated), ("disaggregated", result.disaggregated)):
        table.add_row(
            name,
            f"{pred.ttft_s * 1e3:.1f} ms",
            f"{pred.itl_mean_s * 1e3:.2f} ms",
            f"{pred.itl_p99_s * 1e3:.2f} ms",
            f"{pred.decode_tokens_per_s:.1f}",
            "yes" if pred.saturated else "no",
        )
    console.print(table)
    console.print(f"p99 ITL colocated / disaggregated: {result.p99_itl_ratio:.1f}x")
