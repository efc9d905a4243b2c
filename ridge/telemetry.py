"""Every engine step placed on the roofline.

The engine records each step's shape (prefill chunks, decode contexts) and wall time; the
FLOPs and bytes come from the analyzer's operator model (``roofline.ops.step_cost``, the one
source of truth) and are priced when read, not on the hot path. A report gives, per phase
(prefill-only, decode-only, mixed steps), the achieved bandwidth and FLOP/s and the fraction
of the roofline: ``sum(max(FLOPs / peak, bytes / bandwidth)) / sum(wall time)``. On CPU the
kernels also time their matmuls, so a report says what the steps spend outside them (norms,
attention, routing, sampling, the engine): what no weight format can shrink.

The roofline is a ceiling, so a step that runs faster than its floor proves it wrong; the
``Ceiling`` then re-probes the machine (once: the probe may have caught a busy moment) and,
if a step still beats it, raises the beaten term to that step's own rate. Both are said in
the report's notices, and no fraction above 100% is ever reported.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ridge.roofline.hardware import Hardware
from ridge.roofline.ops import (
    ROUTER_BYTES_PER_PARAM,
    CostConventions,
    Link,
    StepCost,
    step_cost,
    step_cost_from_counts,
)
from ridge.roofline.shapes import ModelShape

PHASES = ("prefill", "decode", "mixed")
TORCH_TO_ROOFLINE_DTYPE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass
class StepRecord:
    prefill_chunks: tuple[tuple[int, int], ...]  # (query tokens, context after the chunk)
    decode_contexts: tuple[int, ...]  # context (incl. the new token) of each decode
    wall_s: float
    # speculative verify runs: (1 + k query tokens, context after them); each row is sampled
    verify_chunks: tuple[tuple[int, int], ...] = ()
    # the draft model's passes that proposed for the next step: per pass, (query tokens,
    # context after them) per sequence
    draft_passes: tuple[tuple[tuple[int, int], ...], ...] = ()
    experts_touched: float | None = None  # an MoE model: distinct experts read per MoE layer (mean)
    comm_s: float = 0.0  # measured: seconds rank 0 spent in collectives (tensor parallelism)
    mask_s: float = 0.0  # measured: seconds filling structured output's token bitmasks
    matmul_s: float | None = None  # measured: seconds in the linear kernels (CPU; None: not timed)
    # measured: seconds by kind of op (RunnerOutput.step_parts: attention, norms, ...; the
    # matmul_* parts lie within matmul_s); None: not timed
    step_parts: dict[str, float] | None = None
    # asynchronous scheduling: wall_s is the pipeline's period (from the later of the step's
    # scheduling and the last collection to its own), not the step's own span; summed over
    # steps it is the time they took, but one period can be shorter than its step's device time
    pipelined: bool = False
    cost: StepCost | None = None  # priced on first read

    @property
    def phase(self) -> str:
        """A verify run generates tokens: it is a decode, of several rows."""
        generating = self.decode_contexts or self.verify_chunks
        if self.prefill_chunks and generating:
            return "mixed"
        return "prefill" if self.prefill_chunks else "decode"

    @property
    def tokens(self) -> int:
        """Query tokens run through the model."""
        return sum(q for q, _ in self.prefill_chunks + self.verify_chunks) + len(self.decode_contexts)


@dataclass
class PhaseStats:
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    floor_s: float = 0.0  # roofline time: sum over steps of StepCost.time_s (each op at its own bound)
    floored_wall_s: float = 0.0  # wall time of the steps priced with a known roofline
    comm_s: float = 0.0  # measured time in collectives (tensor parallelism)
    predicted_comm_s: float = 0.0  # the same steps' collectives priced on the link (once it is known)
    mask_s: float = 0.0  # measured time filling structured output's token bitmasks
    mask_steps: int = 0  # steps that filled one
    # the linear kernels' measured time, over the steps that timed it (CPU): the rest of
    # those steps' wall time is what a step spends outside its matmuls
    matmul_s: float = 0.0
    matmul_timed_wall_s: float = 0.0
    matmul_steps: int = 0
    step_parts: dict[str, float] = field(default_factory=dict)  # summed over the steps that timed them

    def add_matmul_timing(self, rec: StepRecord) -> None:
        """A step's matmul seconds, wall time and step parts, where its kernels timed them."""
        if rec.matmul_s is None:
            return
        self.matmul_s += rec.matmul_s
        self.matmul_timed_wall_s += rec.wall_s
        self.matmul_steps += 1
        for part, s in (rec.step_parts or {}).items():
            self.step_parts[part] = self.step_parts.get(part, 0.0) + s

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes / self.wall_s if self.wall_s else 0.0

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.wall_s if self.wall_s else 0.0

    @property
    def roofline_fraction(self) -> float:
        return self.floor_s / self.floored_wall_s if self.floored_wall_s else 0.0

    def to_json(self) -> dict:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "flops": self.flops,
            "bytes": self.bytes,
            "floor_s": self.floor_s,
            "floored_wall_s": self.floored_wall_s,
            "comm_s": self.comm_s,
            "predicted_comm_s": self.predicted_comm_s,
            "mask_s": self.mask_s,
            "mask_steps": self.mask_steps,
            "matmul_s": self.matmul_s,
            "matmul_timed_wall_s": self.matmul_timed_wall_s,
            "matmul_steps": self.matmul_steps,
            "step_parts": dict(self.step_parts),
            "achieved_gb_per_s": self.achieved_bytes_per_s / 1e9,
            "achieved_gflop_per_s": self.achieved_flops_per_s / 1e9,
            "roofline_fraction": self.roofline_fraction,
        }


class Ceiling:
    """The roofline floors are priced against, kept honest by the steps it prices.

    ``floor_s(cost, wall_s)`` is the analyzer's roofline time of the step, ``cost.time_s``: each
    operator at its own bound (``max(FLOPs / peak, bytes / bandwidth)``), summed; the one floor
    convention of ridge's reports. When a step took less than that, the ceiling is wrong: the
    first time, ``reprobe()`` (if given) measures the machine again and returns ``(peak,
    bandwidth)``; if the step still beats the new ceiling, the term its floor mostly rests on
    (the peak where its compute-bound operators take longer than its memory-bound ones, else
    the bandwidth) is raised by the least factor that brings the floor down to the step's time
    (a measured rate is a lower bound on the true ceiling), and the other term is left alone:
    a prefill that beats the peak says nothing of the bandwidth that later decode steps are
    held to. Only where the first term cannot do it alone (the other's operators take longer
    than the step did) are both raised, by the factor the step beat the floor by. What
    happened is appended to ``notices``: the re-probe, and one line for the raises, which says
    how many there were and the last (each faster step raises again; a decode run of 64 tokens
    printed a line a step).
    """

    def __init__(
        self,
        peak_flops: float,
        bandwidth: float,
        reprobe: Callable[[], tuple[float, float]] | None = None,
        notices: list[str] | None = None,
    ) -> None:
        self.peak_flops = peak_flops
        self.bandwidth = bandwidth
        self._reprobe = reprobe
        self.notices = notices if notices is not None else []
        self._raises = 0  # how many times this ceiling was raised ...
        self._raised_at = -1  # ... the index of its line in notices, and the ceiling before the first
        self._before_raises = ""

    def floor_s(self, cost: StepCost, wall_s: float | None = None) -> float:
        floor = cost.time_s(self.peak_flops, self.bandwidth)
        if wall_s is None or wall_s >= floor:
            return floor
        what = f"a step ({cost.tokens} tokens) ran in {wall_s * 1e3:.3g} ms, under its floor of {floor * 1e3:.3g} ms"
        if self._reprobe is not None:
            reprobe, self._reprobe = self._reprobe, None
            peak, bandwidth = reprobe()
            self.notices.append(
                f"re-probed the roofline: {what} ({self._describe()} -> "
                f"{peak / 1e9:,.0f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s)"
            )
            self.peak_flops, self.bandwidth = max(self.peak_flops, peak), max(self.bandwidth, bandwidth)
            floor = cost.time_s(self.peak_flops, self.bandwidth)
            if wall_s >= floor:
                return floor
        if not self._raises:
            self._before_raises, self._raised_at = self._describe(), len(self.notices)
            self.notices.append("")
        self._raise(cost, floor, wall_s)
        self._raises += 1
        times = "" if self._raises == 1 else f" ({self._raises} times; the last)"
        self.notices[self._raised_at] = (
            f"raised the roofline to what a step reached{times}: {what} ({self._before_raises} -> {self._describe()})"
        )
        return wall_s  # the raised terms give it (exactly: no rounding above 100%)

    def _raise(self, cost: StepCost, floor: float, wall_s: float) -> None:
        """The least raise of the term ``floor`` mostly rests on that brings it to ``wall_s``
        (the class's rule); both terms by ``floor / wall_s`` where that one cannot."""
        peak, bandwidth = self.peak_flops, self.bandwidth
        compute_s = sum(op.flops / peak for op in cost.ops if op.bound(peak, bandwidth) == "compute")
        on_peak = compute_s >= floor - compute_s

        def floor_at(scale: float) -> float:  # the floor with the first term raised by scale
            return cost.time_s(peak * scale, bandwidth) if on_peak else cost.time_s(peak, bandwidth * scale)

        # raised without bound, the first term leaves the other's operators' own time
        rest = sum(op.bytes / bandwidth if on_peak else op.flops / peak for op in cost.ops)
        if rest >= wall_s:
            self.peak_flops, self.bandwidth = peak * floor / wall_s, bandwidth * floor / wall_s
            return
        low, high = 1.0, 2.0  # floor_at falls as scale grows: bracket wall_s, then halve
        while floor_at(high) > wall_s:
            low, high = high, 2 * high
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if floor_at(mid) > wall_s else (low, mid)
        if on_peak:
            self.peak_flops = peak * high
        else:
            self.bandwidth = bandwidth * high

    def step_floor_s(self, cost: StepCost, rec: StepRecord) -> float:
        """``rec``'s floor: ``floor_s(cost, rec.wall_s)``, or for a pipelined step at most its
        period, without re-probing or raising anything: one period can undercut its step's own
        time, so it says nothing of the ceiling (and no step shows over 100%)."""
        if rec.pipelined:
            return min(self.floor_s(cost), rec.wall_s)
        return self.floor_s(cost, rec.wall_s)

    def _describe(self) -> str:
        return f"{self.peak_flops / 1e9:,.0f} GFLOP/s, {self.bandwidth / 1e9:.1f} GB/s"


@dataclass(frozen=True)
class ModelPricing:
    """A loaded model as the cost model prices it: its shape and the bytes it holds. The one
    place the telemetry, the speculation policy and the benchmarks turn a step into
    ``step_cost``'s arguments."""

    model: ModelShape
    weight_bytes: float  # per parameter
    kv_bytes: float  # per cached element
    act_bytes: float
    router_bytes: float = ROUTER_BYTES_PER_PARAM  # per parameter of an MoE's routers

    @classmethod
    def of(cls, info) -> ModelPricing:
        """From a worker's ``ModelInfo``: weights priced by what the loaded layers hold (a
        quantized layer's blocks and scales, a repacked layer's padding), not by the dtype;
        an MoE's routers as held (float32, or bf16 where the CPU kernels read it so)."""
        return cls(
            ModelShape.from_model_config(info.config, info.source),
            info.weight_bytes / max(1, info.weight_params),
            info.kv_bytes_per_element,  # codes plus each token-head's scale
            info.dtype.itemsize,
            info.router_bytes_per_param or ROUTER_BYTES_PER_PARAM,
        )

    def cost(self, prefill_chunks, decode_contexts, **kwargs) -> StepCost:
        """``step_cost`` of one step of this model (``kwargs``: its keyword arguments)."""
        return step_cost(
            self.model,
            prefill_chunks,
            decode_contexts,
            self.weight_bytes,
            self.kv_bytes,
            self.act_bytes,
            router_bytes_per_param=self.router_bytes,
            **kwargs,
        )

    def cost_from_counts(self, sequences, **kwargs) -> StepCost:
        """``step_cost_from_counts`` of one step of this model: {(query tokens, context): count}."""
        return step_cost_from_counts(
            self.model,
            sequences,
            self.weight_bytes,
            self.kv_bytes,
            self.act_bytes,
            router_bytes_per_param=self.router_bytes,
            **kwargs,
        )


@dataclass
class Telemetry:
    """Step records of one engine, and their place on a roofline.

    ``hardware`` is resolved on first report (probing the local machine can take seconds);
    ``hardware_fn(reprobe=True)`` measures it again (see ``Ceiling``). Totals cover every step
    since the last ``reset``; ``recent`` keeps the last steps in full.
    """

    pricing: ModelPricing  # the model whose steps these are
    compute_dtype: str  # the roofline dtype of the peak ("bf16", ...)
    hardware_fn: Callable[..., Hardware]
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))
    notices: list = field(default_factory=list)  # what the ceiling did (re-probes, raises)
    _pending: list = field(default_factory=list)
    _totals: dict = field(default_factory=lambda: {p: PhaseStats() for p in PHASES})
    _hardware: Hardware | None = None
    _ceiling: Ceiling | None = None
    draft: ModelPricing | None = None  # a speculative draft model whose passes count in its steps
    # tensor parallelism: steps are priced per rank, and their collectives on the link
    # (``link_fn()`` resolves it on first report, like the hardware)
    tensor_parallel: int = 1
    link_fn: Callable[[], Link] | None = None
    _link: Link | None = None

    def record(
        self,
        prefill_chunks,
        decode_contexts,
        wall_s: float,
        verify_chunks=(),
        draft_passes=(),
        experts_touched=None,
        comm_s: float = 0.0,
        mask_s: float = 0.0,
        matmul_s: float | None = None,
        step_parts: dict[str, float] | None = None,
        pipelined: bool = False,
    ) -> None:
        """Hot path: keep the shape and the time; pricing happens on read."""
        rec = StepRecord(
            tuple(prefill_chunks),
            tuple(decode_contexts),
            wall_s,
            tuple(verify_chunks),
            tuple(draft_passes),
            experts_touched,
            comm_s,
            mask_s,
            matmul_s,
            step_parts,
            pipelined,
        )
        self.recent.append(rec)
        self._pending.append(rec)

    def price(self, rec: StepRecord) -> StepCost:
        if rec.cost is None:
            rows = len(rec.prefill_chunks) + len(rec.decode_contexts) + sum(q for q, _ in rec.verify_chunks)
            rec.cost = self.pricing.cost(
                rec.prefill_chunks + rec.verify_chunks,
                rec.decode_contexts,
                conventions=CostConventions(tensor_parallel=self.tensor_parallel),
                logit_rows=rows,
                experts_touched=rec.experts_touched,
            )
            if rec.draft_passes and self.draft is not None:  # the draft's reads and FLOPs too
                ops = list(rec.cost.ops)
                for chunks in rec.draft_passes:
                    cost = self.draft.cost(chunks, ())
                    ops += [dataclasses.replace(op, name=f"draft {op.name}") for op in cost.ops]
                rec.cost = StepCost(tuple(ops), rec.cost.tokens, rec.cost.sequences, rec.cost.comm)
        return rec.cost

    @property
    def hardware_resolved(self) -> bool:
        return self._hardware is not None

    @property
    def hardware(self) -> Hardware:
        if self._hardware is None:
            self._hardware = self.hardware_fn()
        return self._hardware

    @property
    def ceiling(self) -> Ceiling:
        """The roofline this engine's steps are priced against (the hardware's, kept honest)."""
        if self._ceiling is None:
            hw = self.hardware
            self._ceiling = Ceiling(hw.peak(self.compute_dtype), hw.bandwidth_bytes_per_s, self.reprobe, self.notices)
        return self._ceiling

    def reprobe(self) -> tuple[float, float]:
        """Measure the hardware again; (peak FLOP/s in the compute dtype, bandwidth)."""
        self._hardware = self.hardware_fn(reprobe=True)
        return self._hardware.peak(self.compute_dtype), self._hardware.bandwidth_bytes_per_s

    def floor_s(self, cost: StepCost, wall_s: float | None = None) -> float:
        return self.ceiling.floor_s(cost, wall_s)

    def phases(self) -> dict[str, PhaseStats]:
        """Per-phase totals since the last reset (pricing any steps not yet priced).

        Roofline floors need the hardware: steps priced before it is resolved (a server
        resolves it at start-up; ``report`` does first) count in FLOPs and bytes only.
        """
        for rec in self._pending:
            cost = self.price(rec)
            stats = self._totals[rec.phase]
            stats.steps += 1
            stats.tokens += rec.tokens
            stats.wall_s += rec.wall_s
            stats.comm_s += rec.comm_s
            stats.mask_s += rec.mask_s
            stats.mask_steps += rec.mask_s > 0
            stats.add_matmul_timing(rec)
            if self._link is not None:
                stats.predicted_comm_s += self._link.time_s(cost.comm)
            stats.flops += cost.flops
            stats.bytes += cost.bytes
            if self._hardware is not None:
                stats.floor_s += self.ceiling.step_floor_s(cost, rec)
                stats.floored_wall_s += rec.wall_s
        self._pending.clear()
        return self._totals

    def reset(self) -> None:
        self._pending.clear()
        self.recent.clear()
        self._totals = {p: PhaseStats() for p in PHASES}

    @property
    def link(self) -> Link | None:
        """What connects the ranks (tensor parallelism), resolved now; None for one rank."""
        if self._link is None and self.link_fn is not None and self.tensor_parallel > 1:
            self._link = self.link_fn()
        return self._link

    def report(self) -> dict:
        ceiling = self.ceiling
        _ = self.link
        phases = {name: stats.to_json() for name, stats in self.phases().items() if stats.steps}
        hw = self.hardware
        return {
            "hardware": {
                "name": hw.name,
                "bandwidth_gb_per_s": ceiling.bandwidth / 1e9,
                "peak_gflop_per_s": ceiling.peak_flops / 1e9,
                "dtype": self.compute_dtype,
                "measured_at": hw.measured_at,
            },
            "phases": phases,
            "notices": list(self.notices),
        }

    def format(self) -> str:
        """A few lines for humans: achieved GB/s and GFLOP/s and the roofline fraction per phase."""
        rep = self.report()
        hw = rep["hardware"]
        lines = [
            f"roofline ({hw['name']}: {hw['bandwidth_gb_per_s']:.1f} GB/s, "
            f"{hw['peak_gflop_per_s']:.0f} GFLOP/s {hw['dtype']})"
        ]
        for name, s in rep["phases"].items():
            lines.append(
                f"  {name:<8} {s['steps']:>5} steps  {s['achieved_gb_per_s']:7.1f} GB/s  "
                f"{s['achieved_gflop_per_s']:8.1f} GFLOP/s  {100 * s['roofline_fraction']:5.1f}% of roofline"
                + (
                    f"  collectives {1e3 * s['comm_s'] / s['steps']:.2f} ms/step "
                    f"(link predicts {1e3 * s['predicted_comm_s'] / s['steps']:.2f})"
                    if s["comm_s"]
                    else ""
                )
                + (
                    f"  grammar masks {1e3 * s['mask_s'] / s['mask_steps']:.2f} ms on {s['mask_steps']} steps"
                    if s["mask_steps"]
                    else ""
                )
                + (f"  {outside_matmuls_text(split)}" if (split := outside_matmuls(s)) else "")
            )
        lines += [f"  note: {notice}" for notice in rep["notices"]]
        return "\n".join(lines)


def outside_matmuls(s: dict) -> dict | None:
    """Where a phase's steps that timed their matmuls (``PhaseStats.to_json``'s keys) spent
    their time, in ms per step: outside the linear kernels in all (and that share of the steps'
    wall time), by kind of op where the kernels timed them (their parts that took time, and
    "other": the engine, Python, untimed ops), and the matmuls' own setup and waiting threads
    (within the matmuls' time). None where no step timed its matmuls."""
    steps, parts = s["matmul_steps"], dict(s.get("step_parts") or {})
    if not steps or not s["matmul_timed_wall_s"]:
        return None
    outside = s["matmul_timed_wall_s"] - s["matmul_s"]
    inside = {part.removeprefix("matmul_"): parts.pop(part) for part in list(parts) if part.startswith("matmul_")}
    by_op = {}
    if any(t > 0 for t in parts.values()):  # (a prefill runs no timed op outside its matmuls)
        by_op = {part: t for part, t in parts.items() if t > 0} | {"other": outside - sum(parts.values())}
    return {
        "ms_per_step": 1e3 * outside / steps,
        "share": outside / s["matmul_timed_wall_s"],
        "by_op_ms_per_step": {part: 1e3 * t / steps for part, t in by_op.items()},
        "in_matmuls_ms_per_step": {part: 1e3 * t / steps for part, t in inside.items()} if any(inside.values()) else {},
    }


def outside_matmuls_text(split: dict) -> str:
    """``outside_matmuls``' figures on one line."""
    text = f"outside matmuls {split['ms_per_step']:.2f} ms/step ({100 * split['share']:.0f}%)"
    if split["by_op_ms_per_step"]:
        text += ": " + ", ".join(f"{part} {ms:.2f}" for part, ms in split["by_op_ms_per_step"].items())
    if split["in_matmuls_ms_per_step"]:
        text += "; in matmuls " + ", ".join(f"{part} {ms:.2f}" for part, ms in split["in_matmuls_ms_per_step"].items())
    return text


def cuda_hardware(device, reprobe: bool = False) -> Hardware:
    """A CUDA device measured now (every call measures: ``reprobe`` changes nothing): read
    bandwidth (sum over 2 GiB) and bf16 and fp32 GEMMs, the best of 5 runs each."""
    import datetime as dt

    import torch

    def best_s(fn, repeats=5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)

    data = torch.ones(2**29, dtype=torch.float32, device=device)
    bandwidth = data.numel() * 4 / best_s(data.sum)
    del data
    peaks = {}
    for name, dtype, n in (("bf16", torch.bfloat16, 8192), ("fp32", torch.float32, 4096)):
        a = torch.randn(n, n, dtype=dtype, device=device)
        peaks[name] = 2 * n**3 / best_s(lambda a=a: a @ a)
    props = torch.cuda.get_device_properties(device)
    return Hardware(
        name=f"cuda:{props.name}",
        peak_flops={"bf16": peaks["bf16"], "fp16": peaks["bf16"], "fp32": peaks["fp32"]},
        bandwidth_bytes_per_s=bandwidth,
        memory_bytes=float(props.total_memory),
        source="measured now: sum() over 2 GiB fp32; 8192^3 bf16 and 4096^3 fp32 matmuls (fp16 as bf16); "
        "the best of 5 runs",
        measured_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )
