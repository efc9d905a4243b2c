"""Prometheus metrics for ``/metrics``, on a per-app ``CollectorRegistry`` (never the global one).

Two kinds of metric, fed two ways:

* **Request and step metrics** (counters and histograms: finish reasons, prompt and generated
  tokens, time to first token, inter-token latency, end-to-end latency, queue time, step
  time). ``ServerMetrics`` is the engine loop's ``EngineObserver``: it observes them on the
  engine thread as outputs come out of each step (prometheus-client metrics are thread-safe).
* **Engine state** (running and waiting sequences, KV-cache usage, prefix-cache hit rate,
  preemptions, ...), read *at scrape time*: the ``/metrics`` handler asks the engine loop for
  a stats snapshot (``EngineStats``, plain data taken between two steps), turns it into
  samples with ``read_state``, hands them to ``publish_state`` and renders. Each *state
  source* is a function ``EngineStats -> [Sample]``; ``STATE_SOURCES`` lists the defaults.

Adding gauges is one function ``EngineStats -> [Sample]`` in ``STATE_SOURCES``;
``telemetry_samples`` (the steps on the roofline, per phase) is one.

Every metric carries a ``model_name`` label (the first served name), as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ridge.engine.outputs import RequestOutput
from ridge.engine.stats import EngineStats
from ridge.server.async_engine import EngineObserver

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
REQUEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class Sample:
    """One value of an engine-state metric. ``kind``: "gauge", or "counter" (name without ``_total``)."""

    name: str
    documentation: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)
    kind: str = "gauge"


StateSource = Callable[[EngineStats], Iterable[Sample]]


def engine_state_samples(stats: EngineStats) -> list[Sample]:
    """Scheduler and KV-cache state."""
    counts = stats.kv_blocks
    samples = [
        Sample("ridge_num_requests_running", "Sequences in the running batch.", stats.num_running),
        Sample("ridge_num_requests_waiting", "Sequences waiting to be admitted.", stats.num_waiting),
        Sample("ridge_kv_cache_usage_ratio", "Fraction of KV blocks held by requests (0..1).", stats.kv_cache_usage),
        Sample(
            "ridge_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up.",
            stats.prefix_cache_hit_rate,
        ),
        Sample(
            "ridge_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
            kind="counter",
        ),
        Sample(
            "ridge_prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits,
            kind="counter",
        ),
        Sample(
            "ridge_num_preemptions",
            "Sequences preempted (to be recomputed) for lack of KV blocks.",
            stats.num_preemptions,
            kind="counter",
        ),
    ]
    for state in ("free", "used", "cached"):
        samples.append(
            Sample(
                "ridge_kv_cache_blocks",
                "KV blocks by state (cached: free but holding a prefix).",
                counts[state],
                labels={"state": state},
            )
        )
    samples.append(Sample("ridge_engine_info", "Engine configuration (value 1).", 1.0, labels=dict(stats.info)))
    return samples


def telemetry_samples(stats: EngineStats) -> list[Sample]:
    """The steps on the roofline, per phase (prefill, decode, mixed), since the engine started.

    Achieved rates need only the analyzer's FLOPs and bytes; the roofline fraction also needs
    the hardware, which ``ridge serve`` resolves at start-up (a scrape never probes).
    """
    samples = []
    for phase, totals in stats.phases.items():
        labels = {"phase": phase}
        samples += [
            Sample(
                "ridge_step_achieved_bandwidth_bytes_per_second",
                "Bytes the analyzer says the phase's steps move, per second of their wall time.",
                totals.achieved_bytes_per_s,
                labels,
            ),
            Sample(
                "ridge_step_achieved_flops_per_second",
                "FLOPs the analyzer says the phase's steps do, per second of their wall time.",
                totals.achieved_flops_per_s,
                labels,
            ),
            Sample("ridge_steps", "Engine steps by phase.", totals.steps, labels, kind="counter"),
        ]
        if totals.matmul_timed_wall_s:  # CPU: the kernels timed their matmuls
            samples.append(
                Sample(
                    "ridge_step_outside_matmul_fraction",
                    "Share of the phase's wall time spent outside the linear kernels (CPU; measured).",
                    1.0 - totals.matmul_s / totals.matmul_timed_wall_s,
                    labels,
                )
            )
            samples += [  # the ops the kernels timed, by kind (the matmul_* parts lie within the matmuls)
                Sample(
                    "ridge_step_part_fraction",
                    "Share of the phase's wall time in one kind of op, as the CPU kernels timed it "
                    "(attention, norms, ...; matmul_setup and matmul_wait lie within the matmuls' share).",
                    seconds / totals.matmul_timed_wall_s,
                    labels | {"part": part},
                )
                for part, seconds in totals.step_parts.items()
            ]
        if stats.roofline_resolved:
            samples.append(
                Sample(
                    "ridge_step_roofline_fraction",
                    "Roofline time / wall time of the phase's steps (1 = at the hardware limit).",
                    totals.roofline_fraction,
                    labels,
                )
            )
    return samples


def spec_decode_samples(engine_stats: EngineStats) -> list[Sample]:
    """Speculative decoding: drafts proposed and accepted (vLLM's names), by position too."""
    stats = engine_stats.spec_decode
    if stats is None:
        return []
    samples = [
        Sample(
            "ridge_spec_decode_num_drafts",
            "Verify runs (sequences x steps that verified drafts).",
            stats.num_verify_runs,
            kind="counter",
        ),
        Sample(
            "ridge_spec_decode_num_draft_tokens",
            "Tokens proposed for verification.",
            stats.num_draft_tokens,
            kind="counter",
        ),
        Sample(
            "ridge_spec_decode_num_accepted_tokens",
            "Proposed tokens the target accepted.",
            stats.num_accepted_tokens,
            kind="counter",
        ),
        Sample(
            "ridge_spec_decode_num_speculative_tokens",
            "Tokens proposed per sequence in the last step (k).",
            engine_stats.spec_decode_k,
        ),
    ]
    for position, accepted in enumerate(stats.accepted_by_position):
        samples.append(
            Sample(
                "ridge_spec_decode_num_accepted_tokens_per_pos",
                "Proposed tokens accepted, by their position in the run.",
                accepted,
                labels={"position": str(position)},
                kind="counter",
            )
        )
    return samples


def kv_transfer_samples(engine_stats: EngineStats) -> list[Sample]:
    """Disaggregated serving: transfers, blocks and bytes moved, their time, what waits."""
    stats = engine_stats.kv_transfer
    if stats is None:
        return []
    role = {"role": stats.role}
    return [
        Sample("ridge_kv_transfer_peers", "KV-transfer peers paired now.", stats.num_peers, role),
        Sample(
            "ridge_kv_transfer_transfers",
            "KV transfers: pulls served (producer), transfers received (consumer).",
            stats.transfers,
            role,
            kind="counter",
        ),
        Sample("ridge_kv_transfer_blocks", "KV blocks sent or received.", stats.blocks, role, kind="counter"),
        Sample("ridge_kv_transfer_bytes", "KV-cache bytes sent or received.", stats.bytes, role, kind="counter"),
        Sample(
            "ridge_kv_transfer_blocks_skipped",
            "Consumer: prompt blocks its prefix cache held, so not transferred.",
            stats.blocks_skipped,
            role,
            kind="counter",
        ),
        Sample(
            "ridge_kv_transfer_seconds",
            "Consumer: seconds from posting a transfer's receive to its arrival, summed.",
            stats.seconds,
            role,
            kind="counter",
        ),
        Sample(
            "ridge_kv_transfer_failures",
            "KV transfers that failed or were refused.",
            stats.failures,
            role,
            kind="counter",
        ),
        Sample(
            "ridge_kv_transfer_parked_requests",
            "Producer: finished prompts whose blocks wait for a consumer's pull.",
            stats.parked,
            role,
        ),
        Sample(
            "ridge_kv_transfer_receiving_requests",
            "Consumer: admitted requests whose prompt's KV cache is on its way.",
            stats.receiving,
            role,
        ),
    ]


def structured_samples(engine_stats: EngineStats) -> list[Sample]:
    """Structured output: constrained sequences, grammar compiles and the steps' mask time."""
    stats = engine_stats.structured
    return [
        Sample(
            "ridge_structured_output_requests",
            "Constrained sequences admitted.",
            stats.requests,
            kind="counter",
        ),
        Sample(
            "ridge_structured_output_compiles", "Constraints compiled (cache misses).", stats.compiles, kind="counter"
        ),
        Sample(
            "ridge_structured_output_compile_seconds",
            "Seconds spent compiling constraints.",
            stats.compile_s,
            kind="counter",
        ),
        Sample(
            "ridge_structured_output_mask_seconds",
            "Seconds the steps spent filling token bitmasks.",
            stats.mask_s,
            kind="counter",
        ),
        Sample("ridge_structured_output_mask_steps", "Steps that masked.", stats.mask_steps, kind="counter"),
    ]


STATE_SOURCES: tuple[StateSource, ...] = (
    engine_state_samples,
    telemetry_samples,
    spec_decode_samples,
    kv_transfer_samples,
    structured_samples,
)


class _StateCollector(Collector):
    """Exports the engine-state samples last published (an atomic swap of a tuple)."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self._samples: tuple[Sample, ...] = ()

    def publish(self, samples: Iterable[Sample]) -> None:
        self._samples = tuple(samples)

    def describe(self) -> list[Metric]:
        return []  # the names are only known once published; skip the registry's duplicate check

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for s in self._samples:
            labels = {"model_name": self._model_name, **s.labels}
            family = families.get(s.name)
            if family is None:
                cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                family = families[s.name] = cls(s.name, s.documentation, labels=list(labels))
            family.add_metric(list(labels.values()), s.value)
        return list(families.values())


@dataclass
class _Live:
    """What the observer remembers of a request between steps (engine thread only)."""

    first_token_seen: bool = False
    last_token_time: float | None = None


class ServerMetrics(EngineObserver):
    """The server's metrics: an ``EngineObserver`` for the engine loop plus the state collector."""

    def __init__(self, model_name: str, state_sources: Sequence[StateSource] = STATE_SOURCES) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.state_sources = tuple(state_sources)
        self._state = _StateCollector(model_name)
        self.registry.register(self._state)
        labels = ["model_name"]
        r = self.registry
        self.request_success = Counter(
            "ridge_request_success",
            "Finished completions (sequences) by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("ridge_prompt_tokens", "Prompt tokens prefilled.", labels, registry=r)
        self.generation_tokens = Counter("ridge_generation_tokens", "Tokens generated.", labels, registry=r)
        self.ttft = Histogram(
            "ridge_time_to_first_token_seconds",
            "Arrival to first generated token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ridge_inter_token_latency_seconds",
            "Time between successive tokens of a request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ridge_e2e_request_latency_seconds",
            "Arrival to finish of a request.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "ridge_request_queue_time_seconds",
            "Arrival to first scheduled.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "ridge_engine_step_seconds",
            "Wall time of one engine step (count: steps).",
            labels,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.http_errors = Counter(
            "ridge_http_errors", "Error replies by HTTP status.", labels + ["status"], registry=r
        )
        # Every series present from the start (at 0), so rates and deltas work from the first scrape.
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.step_time,
        ):
            metric.labels(model_name)
        self._live: dict[str, _Live] = {}  # engine thread only

    # -- engine state, at scrape time ---------------------------------------------------
    def read_state(self, stats: EngineStats) -> list[Sample]:
        """Every state source's samples of one stats snapshot."""
        return [s for source in self.state_sources for s in source(stats)]

    def publish_state(self, samples: Iterable[Sample]) -> None:
        self._state.publish(samples)

    def render(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)

    def record_http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    # -- EngineObserver (engine thread) -------------------------------------------------
    def on_step(self, outputs: list[RequestOutput], start: float, end: float) -> None:
        name = self.model_name
        self.step_time.labels(name).observe(end - start)
        for out in outputs:
            self._observe(name, out)

    def _observe(self, name: str, out: RequestOutput) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            live = self._live[out.request_id] = _Live()
        new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
        if new_tokens:
            self.generation_tokens.labels(name).inc(new_tokens)
        m = out.metrics
        if not live.first_token_seen and m.first_token_time is not None:
            live.first_token_seen = True
            self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
            self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue_time.labels(name).observe(m.first_scheduled_time - m.arrival_time)
        elif new_tokens and m.last_token_time is not None and live.last_token_time is not None:
            self.itl.labels(name).observe(m.last_token_time - live.last_token_time)
        live.last_token_time = m.last_token_time
        if out.finished:
            for c in out.outputs:
                self.request_success.labels(name, c.finish_reason or "abort").inc()
            if m.finish_time is not None:
                self.e2e.labels(name).observe(m.finish_time - m.arrival_time)
            del self._live[out.request_id]

    def on_abort(self, aborted: Sequence[tuple[str, int]]) -> None:
        for request_id, n in aborted:
            self._live.pop(request_id, None)
            self.request_success.labels(self.model_name, "abort").inc(n)
