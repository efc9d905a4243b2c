"""The analysis behind ``ridge analyze``: phases, batch sweeps and the summary.

Every number comes from ``ops.step_cost`` (the one cost model) placed under one roofline
(``Roof``: a peak FLOP/s for the compute dtype and a bandwidth). Phases:
- prefill: one prompt of ``prompt_len`` tokens (batch 1); per batch, B prompts in one step;
- decode: one step of B sequences at each reported context length (default: the generation's
  mean context, prompt_len + output_len // 2);
- TPOT: the mean step time over the generation's decode steps (contexts prompt_len + 1 ..
  prompt_len + output_len - 1, sampled at up to 32 evenly spaced points);
- speculative what-if: one verification step of spec_k + 1 tokens per sequence, yielding
  (1 - a^(k+1)) / (1 - a) tokens per sequence for per-token acceptance a (draft cost excluded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ridge.roofline import ops
from ridge.roofline.hardware import Hardware
from ridge.roofline.ops import CostConventions, Precision, StepCost
from ridge.roofline.shapes import ModelShape

UNITS = ("GB", "GiB")
MAX_SEARCH_BATCH = 1 << 20
GENERATION_SAMPLES = 32
SWEEP_LIMIT = 1 << 16


@dataclass(frozen=True)
class Workload:
    """What is run: lengths, batch sizes, precisions, tensor parallelism, speculation."""

    prompt_len: int = 2048
    output_len: int = 256
    batches: tuple[int, ...] = (1, 8, 64, 256)
    decode_context_lens: tuple[int, ...] = ()  # empty: the generation's mean context
    precision: Precision = Precision()
    spec_k: int = 0
    spec_acceptance: float = 0.7

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("--prompt-len and --output-len must be >= 1")
        if not self.batches or min(self.batches) < 1:
            raise ValueError("--batch needs one or more batch sizes >= 1")
        if any(c < 1 for c in self.decode_context_lens):
            raise ValueError("--context-len values must be >= 1")
        if self.spec_k < 0:
            raise ValueError("--spec-k must be >= 0")
        if not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError("--spec-acceptance must be in [0, 1]")

    @property
    def mean_decode_context(self) -> int:
        return self.prompt_len + self.output_len // 2

    @property
    def final_context(self) -> int:
        """Tokens a finished sequence holds: the prompt and every generated token."""
        return self.prompt_len + self.output_len

    def reported_contexts(self) -> tuple[int, ...]:
        return self.decode_context_lens or (self.mean_decode_context,)

    def generation_contexts(self) -> list[int]:
        """Context lengths of the decode steps (the first token comes from prefill)."""
        first, last = self.prompt_len + 1, self.prompt_len + max(self.output_len - 1, 1)
        count = last - first + 1
        if count <= GENERATION_SAMPLES:
            return list(range(first, last + 1))
        step = (count - 1) / (GENERATION_SAMPLES - 1)
        return [first + round(i * step) for i in range(GENERATION_SAMPLES)]

    def expected_tokens_per_verify(self) -> float:
        """Tokens a sequence gains per verification step with i.i.d. acceptance a."""
        k, a = self.spec_k, self.spec_acceptance
        return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


@dataclass(frozen=True)
class Conventions:
    """Cost conventions plus how bytes are printed (decimal GB or binary GiB)."""

    cost: CostConventions = CostConventions()
    units: str = "GB"

    def __post_init__(self) -> None:
        if self.units not in UNITS:
            raise ValueError(f"units must be one of {UNITS}, got {self.units!r}")

    def describe(self, workload: Workload) -> list[str]:
        """One line per convention, printed with every output."""
        c, p = self.cost, workload.precision
        mix = ", ".join(f"{name} {share:.0%}" for name, share in p.weight_mix)
        stored = (
            f"stored in {p.weight_storage_bits:.4g} bits per weight with scales"
            + (f": the file's {mix} of its matrices' weights, averaged" if mix else "")
            if p.weight_storage_bits
            else "no quantization-scale overhead"
        )
        return [
            f"attention FLOPs: {c.attention} ("
            + (
                "each query against the keys before it"
                if c.attention == "causal"
                else "the whole query x context rectangle"
            )
            + ")",
            "input embedding: "
            + (
                "only the gathered rows are read" if c.embedding == "gathered" else "the whole table is read every step"
            ),
            f"bytes: minimum traffic, every operand once; weights {p.weight_bits}-bit (incl. embedding and "
            f"lm_head, {stored}), norms/biases 16-bit; activations {p.activation_bits}-bit; KV cache {p.kv_bits}-bit",
            "FLOPs: 2 per multiply-add; RMSNorm 4/element; softmax, RoPE, SiLU-gating, residual adds "
            "fused and not counted",
            "time per op = max(FLOPs / peak, bytes / bandwidth); a phase is the sum of its ops",
            "projections: " + ("fused QKV and gate_up" if c.fused_projections else "separate q/k/v and gate/up"),
            "MoE: uniform routing, expected distinct experts per layer; MLA: absorbed or decompressed "
            "per sequence, whichever has fewer FLOPs",
            f"tensor parallel {c.tensor_parallel}: per-GPU costs; 2 all-reduces of the hidden states per "
            "layer and a gather of the logits, priced on the link (latency per collective + bytes / "
            "bandwidth, a ring sends 2 (N-1)/N of an all-reduce), added to the step"
            if c.tensor_parallel > 1
            else "single GPU (tensor parallel 1)",
            "memory fit: weights + KV of full-length sequences; activations and runtime overhead ignored",
            f"units: {'decimal GB (1e9 bytes)' if self.units == 'GB' else 'binary GiB (2^30 bytes)'}",
        ]


@dataclass(frozen=True)
class Roof:
    """The roofline: peak FLOP/s of the compute dtype and memory bandwidth."""

    dtype: str
    peak_flops: float
    bandwidth: float
    link: ops.Link | None = None  # between tensor-parallel ranks (None: communication not priced)

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.bandwidth <= 0:
            raise ValueError("Roof needs positive peak and bandwidth")

    def comm_s(self, cost: StepCost) -> float:
        """The step's communication time on the link (0 for one rank or no link)."""
        return self.link.time_s(cost.comm) if self.link is not None and cost.comm.collectives else 0.0

    @property
    def ridge_point(self) -> float:
        return self.peak_flops / self.bandwidth


# Preferred compute dtypes by the wider of weight and activation bits (W4A16 runs in bf16).
_COMPUTE_DTYPES = {
    32: ("fp32",),
    16: ("bf16", "fp16", "fp32"),
    8: ("fp8", "int8", "bf16", "fp16"),
    4: ("fp4", "int4", "fp8", "int8", "bf16"),
}


def infer_compute_dtype(precision: Precision, hardware: Hardware | None = None) -> str:
    """The dtype the matmuls run in: the first of the preferred ones the hardware has a peak for."""
    ladder = _COMPUTE_DTYPES[max(precision.weight_bits, precision.activation_bits)]
    if hardware is None:
        return ladder[0]
    for dtype in ladder:
        if dtype in hardware.peak_flops:
            return dtype
    return next(iter(hardware.peak_flops))


@dataclass(frozen=True)
class Phase:
    """One priced step under the roof."""

    kind: str  # "prefill" | "decode" | "spec_verify"
    batch: int
    context_len: int
    cost: StepCost
    time_s: float  # the roofline's time plus the communication's
    tokens_per_s: float
    bound: str
    comm_s: float = 0.0  # of time_s: the tensor-parallel collectives on the link

    @property
    def intensity(self) -> float:
        return self.cost.intensity


@dataclass(frozen=True)
class BatchSummary:
    batch: int
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    e2e_s: float
    kv_bytes: float
    fits: bool
    experts_touched_per_layer: float | None
    spec_tokens_per_s: float | None = None
    spec_speedup: float | None = None


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    tpot_s: float
    tokens_per_s: float
    fits: bool


@dataclass(frozen=True)
class Analysis:
    model: ModelShape
    hardware: Hardware
    roof: Roof
    workload: Workload
    conventions: Conventions
    params_total: int
    params_active: float
    weight_bytes: float
    weight_bytes_per_gpu: float
    kv_bytes_per_token: float
    kv_bytes_per_token_per_gpu: float
    kv_bytes_per_sequence: float
    prefill: Phase
    decode: tuple[Phase, ...]
    spec_verify: tuple[Phase, ...]
    batches: tuple[BatchSummary, ...]
    decode_floor_s: float
    max_batch: int
    compute_bound_batch: int | None
    compute_bound_batch_linear: int | None
    sweep: tuple[SweepPoint, ...] = field(default=())
    warnings: tuple[str, ...] = field(default=())  # setups the model or machine cannot run as asked


class Analyzer:
    """Prices steps for one (model, roof, workload, conventions); explicit state, no globals."""

    def __init__(self, model: ModelShape, roof: Roof, workload: Workload, conventions: Conventions):
        self.model, self.roof, self.workload, self.conventions = model, roof, workload, conventions
        p = workload.precision
        self._bytes = (p.weight_bytes, p.kv_bytes, p.activation_bytes)
        ops.ShardWidths.of(model, conventions.cost.tensor_parallel)  # fail early on bad TP

    def step(self, sequences: dict[tuple[int, int], int], logit_rows: int | None = None) -> StepCost:
        """{(num_query_tokens, context_len): count} priced by ``ops.step_cost_from_counts``."""
        return ops.step_cost_from_counts(
            self.model,
            sequences,
            *self._bytes,
            conventions=self.conventions.cost,
            logit_rows=logit_rows,
        )

    def phase(self, kind: str, batch: int, context_len: int, cost: StepCost, tokens: float) -> Phase:
        comm_s = self.roof.comm_s(cost)
        time_s = cost.time_s(self.roof.peak_flops, self.roof.bandwidth) + comm_s
        return Phase(
            kind,
            batch,
            context_len,
            cost,
            time_s,
            tokens / time_s,
            cost.bound(self.roof.peak_flops, self.roof.bandwidth),
            comm_s,
        )

    def prefill(self, batch: int) -> Phase:
        P = self.workload.prompt_len
        return self.phase("prefill", batch, P, self.step({(P, P): batch}), batch * P)

    def decode(self, batch: int, context_len: int) -> Phase:
        return self.phase("decode", batch, context_len, self.step({(1, context_len): batch}), batch)

    def spec_verify(self, batch: int, context_len: int) -> Phase:
        k = self.workload.spec_k
        cost = self.step({(k + 1, context_len + k): batch}, logit_rows=batch * (k + 1))
        return self.phase("spec_verify", batch, context_len, cost, batch * self.workload.expected_tokens_per_verify())

    def mean_tpot(self, batch: int) -> float:
        contexts = self.workload.generation_contexts()
        return sum(self.decode(batch, c).time_s for c in contexts) / len(contexts)

    def first_batch(self, predicate) -> int | None:
        """Smallest batch in [1, MAX_SEARCH_BATCH] satisfying a predicate monotone in batch."""
        hi = 1
        while not predicate(hi):
            if hi >= MAX_SEARCH_BATCH:
                return None
            hi *= 2
        lo = hi // 2  # predicate(lo) is false (or lo == 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if predicate(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def is_compute_bound(self, batch: int, linear_only: bool = False) -> bool:
        cost = self.step({(1, self.workload.mean_decode_context): batch})
        chosen = [op for op in cost.ops if op.kind == "linear"] if linear_only else cost.ops
        flops = sum(op.flops for op in chosen)
        moved = sum(op.bytes for op in chosen)
        return flops / self.roof.peak_flops >= moved / self.roof.bandwidth


def analyze(
    model: ModelShape,
    hardware: Hardware,
    workload: Workload = Workload(),
    conventions: Conventions = Conventions(),
    compute_dtype: str | None = None,
    link: ops.Link | None = None,
) -> Analysis:
    """Run the whole analysis; raises ValueError on an impossible setup (e.g. TP vs heads).
    ``link``: what connects tensor-parallel ranks (their collectives are priced on it)."""
    dtype = compute_dtype or infer_compute_dtype(workload.precision, hardware)
    roof = Roof(dtype, hardware.peak(dtype), hardware.bandwidth_bytes_per_s, link)
    az = Analyzer(model, roof, workload, conventions)
    tp = conventions.cost.tensor_parallel
    p = workload.precision

    weights_gpu = ops.weight_bytes(model, p.weight_bytes, tp)
    kv_token_gpu = ops.kv_bytes_per_token(model, p.kv_bytes, tp)
    kv_sequence_gpu = kv_token_gpu * model.cached_tokens(workload.final_context)
    free = hardware.memory_bytes - weights_gpu
    max_batch = max(0, int(free // kv_sequence_gpu)) if kv_sequence_gpu else MAX_SEARCH_BATCH

    decode_phases = tuple(az.decode(b, c) for b in workload.batches for c in workload.reported_contexts())
    spec_phases: tuple[Phase, ...] = ()
    if workload.spec_k:
        spec_phases = tuple(az.spec_verify(b, workload.mean_decode_context) for b in workload.batches)

    summaries = []
    for i, b in enumerate(workload.batches):
        ttft = az.prefill(b).time_s
        tpot = az.mean_tpot(b)
        spec_tps = spec_speedup = None
        if spec_phases:
            spec_tps = spec_phases[i].tokens_per_s
            spec_speedup = spec_tps / az.decode(b, workload.mean_decode_context).tokens_per_s
        summaries.append(
            BatchSummary(
                batch=b,
                ttft_s=ttft,
                tpot_s=tpot,
                tokens_per_s=b / tpot,
                e2e_s=ttft + max(workload.output_len - 1, 0) * tpot,
                kv_bytes=b * kv_sequence_gpu,
                fits=b <= max_batch,
                experts_touched_per_layer=model.moe.expected_experts_touched(b) if model.is_moe else None,
                spec_tokens_per_s=spec_tps,
                spec_speedup=spec_speedup,
            )
        )

    floor_step = az.step({(1, workload.mean_decode_context): 1})
    compute_bound = az.first_batch(az.is_compute_bound)
    compute_bound_linear = az.first_batch(lambda b: az.is_compute_bound(b, linear_only=True))

    return Analysis(
        model=model,
        hardware=hardware,
        roof=roof,
        workload=workload,
        conventions=conventions,
        params_total=ops.params_total(model),
        params_active=ops.params_active(model),
        weight_bytes=ops.weight_bytes(model, p.weight_bytes),
        weight_bytes_per_gpu=weights_gpu,
        kv_bytes_per_token=ops.kv_bytes_per_token(model, p.kv_bytes),
        kv_bytes_per_token_per_gpu=kv_token_gpu,
        kv_bytes_per_sequence=kv_sequence_gpu,
        prefill=az.prefill(1),
        decode=decode_phases,
        spec_verify=spec_phases,
        batches=tuple(summaries),
        decode_floor_s=floor_step.weight_bytes / roof.bandwidth,
        max_batch=max_batch,
        compute_bound_batch=compute_bound,
        compute_bound_batch_linear=compute_bound_linear,
        sweep=_sweep(az, workload, max_batch, compute_bound_linear),
        warnings=_warnings(model, workload, max_batch),
    )


def _warnings(model: ModelShape, workload: Workload, max_batch: int) -> tuple[str, ...]:
    out = []
    if model.max_context is not None and workload.final_context > model.max_context:
        out.append(
            f"prompt + output ({workload.final_context} tokens) exceeds the model's context "
            f"({model.max_context} tokens): these figures describe a run the model cannot serve"
        )
    if max_batch < 1:
        out.append("the model does not fit this hardware's memory at this context (see 'memory fit')")
    return tuple(out)


def _sweep(az: Analyzer, workload: Workload, max_batch: int, knee: int | None) -> tuple[SweepPoint, ...]:
    """Throughput vs latency over powers of two (plus the requested batches) for the plot."""
    top = min(SWEEP_LIMIT, max(max(workload.batches), max_batch, knee or 1) * 2)
    batches = {1 << i for i in range(top.bit_length()) if 1 << i <= top} | set(workload.batches)
    points = []
    for b in sorted(batches):
        tpot = az.mean_tpot(b)
        points.append(SweepPoint(b, tpot, b / tpot, b <= max_batch))
    return tuple(points)
