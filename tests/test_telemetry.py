"""The engine's roofline telemetry: its arithmetic is the analyzer's, its report adds up per phase,
and the probe that measures this machine writes what the rest reads.

No timing is asserted: wall times are made up here (or only checked for being positive), and
the hardware is a fixed ``Hardware`` passed as ``hardware_fn``, so no probe runs unless a test
says so (and then at a tiny size).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math

import pytest

from ridge.models.presets import PRESETS
from ridge.roofline import probe
from ridge.roofline.analyze import Analyzer, Conventions, Roof, Workload
from ridge.roofline.hardware import GIB, HARDWARE_PRESETS, Hardware, Measurement
from ridge.roofline.ops import Precision, step_cost
from ridge.roofline.probe import ProbeSettings, local_hardware, probe_bandwidth
from ridge.roofline.shapes import ModelShape
from ridge.telemetry import PHASES, TORCH_TO_ROOFLINE_DTYPE, Ceiling, ModelPricing, StepRecord, Telemetry

TINY_SHAPE = ModelShape.from_hf_config(PRESETS["tiny"])
# A roofline with round numbers: 1 TFLOP/s bf16 and 100 GB/s (ridge point 10 FLOP/byte).
HW = Hardware("test-roof", {"bf16": 1e12, "fp32": 5e11}, 100e9, 16 * GIB, "made up for the tests")

PREFILL = ((16, 16), (16, 16), (5, 5))  # three prompts prefilled in one step
DECODE = (17, 17, 40, 129)
MIXED_PREFILL, MIXED_DECODE = ((32, 48),), (20, 20, 33)  # a second chunk beside three decodes


def make_telemetry(hardware=HW, bytes_per_elem=2, dtype="bf16", model=TINY_SHAPE, calls=None) -> Telemetry:
    """As ``LLMEngine._make_telemetry`` builds it: one element size for weights, KV, activations."""

    def hardware_fn(reprobe=False):
        if calls is not None:
            calls.append(1)
        return hardware

    return Telemetry(
        pricing=ModelPricing(model, bytes_per_elem, bytes_per_elem, bytes_per_elem),
        compute_dtype=dtype,
        hardware_fn=hardware_fn,
    )


def analyzer(bits: int, prompt_len: int = 16, model=TINY_SHAPE) -> Analyzer:
    workload = Workload(prompt_len=prompt_len, output_len=8, precision=Precision(bits, bits, bits))
    dtype = "fp32" if bits == 32 else "bf16"
    return Analyzer(model, Roof(dtype, HW.peak(dtype), HW.bandwidth_bytes_per_s), workload, Conventions())


def floor(cost, hw=HW, dtype="bf16") -> float:
    """The analyzer's roofline time: each operator at its own bound, summed."""
    return sum(max(op.flops / hw.peak(dtype), op.bytes / hw.bandwidth_bytes_per_s) for op in cost.ops)


# ---- the arithmetic is the analyzer's ---------------------------------------------------------


@pytest.mark.parametrize("bits", [16, 32])
def test_a_decode_step_costs_what_the_analyzer_says(bits):
    t = make_telemetry(bytes_per_elem=bits // 8)
    t.record([], [40] * 6, 1e-3)
    (rec,) = t.recent
    expected = analyzer(bits).decode(6, 40).cost
    got = t.price(rec)
    assert (got.flops, got.bytes) == (expected.flops, expected.bytes)
    assert (got.tokens, got.sequences) == (6, 6)
    assert [op.name for op in got.ops] == [op.name for op in expected.ops]


@pytest.mark.parametrize("bits", [16, 32])
def test_a_prefill_step_costs_what_the_analyzer_says(bits):
    t = make_telemetry(bytes_per_elem=bits // 8)
    t.record([(24, 24)] * 3, [], 1e-3)
    expected = analyzer(bits, prompt_len=24).prefill(3).cost
    got = t.price(t.recent[0])
    assert (got.flops, got.bytes) == (expected.flops, expected.bytes)
    assert (got.tokens, got.sequences) == (72, 3)


@pytest.mark.parametrize("bits", [16, 32])
def test_a_mixed_step_costs_what_the_analyzer_says(bits):
    t = make_telemetry(bytes_per_elem=bits // 8)
    t.record(MIXED_PREFILL, MIXED_DECODE, 1e-3)
    expected = analyzer(bits).step({(32, 48): 1, (1, 20): 2, (1, 33): 1})
    got = t.price(t.recent[0])
    assert (got.flops, got.bytes) == (expected.flops, expected.bytes)
    assert (got.tokens, got.sequences) == (35, 4)
    # and it is step_cost itself, with the engine's element sizes
    direct = step_cost(TINY_SHAPE, MIXED_PREFILL, MIXED_DECODE, bits / 8, bits / 8, bits / 8)
    assert (got.flops, got.bytes) == (direct.flops, direct.bytes)


def test_a_mixed_step_is_not_the_sum_of_its_parts():
    """Weights are read once per step: a mixed step moves fewer bytes than its parts apart, but
    does the same FLOPs (what the analyzer says of mixing; the telemetry must not price per phase)."""
    t = make_telemetry()
    t.record(MIXED_PREFILL, MIXED_DECODE, 1e-3)
    t.record(MIXED_PREFILL, [], 1e-3)
    t.record([], MIXED_DECODE, 1e-3)
    mixed, prefill, decode = (t.price(r) for r in t.recent)
    assert mixed.flops == pytest.approx(prefill.flops + decode.flops)
    assert mixed.bytes < prefill.bytes + decode.bytes


def test_pricing_is_done_once_and_kept():
    t = make_telemetry()
    t.record([], [10], 1e-3)
    rec = t.recent[0]
    assert rec.cost is None  # the hot path does not price
    first = t.price(rec)
    assert rec.cost is first and t.price(rec) is first


def test_the_engine_dtype_names_map_to_roofline_dtypes():
    assert TORCH_TO_ROOFLINE_DTYPE == {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


# ---- phases and the report --------------------------------------------------------------------


def test_step_phase_and_tokens():
    assert StepRecord(PREFILL, (), 0.1).phase == "prefill"
    assert StepRecord((), DECODE, 0.1).phase == "decode"
    assert StepRecord(MIXED_PREFILL, MIXED_DECODE, 0.1).phase == "mixed"
    assert StepRecord(PREFILL, (), 0.1).tokens == 37
    assert StepRecord((), DECODE, 0.1).tokens == 4
    assert StepRecord(MIXED_PREFILL, MIXED_DECODE, 0.1).tokens == 35


def test_report_aggregates_each_phase_against_the_roofline():
    t = make_telemetry()
    steps = [
        (PREFILL, (), 0.004),
        ((), DECODE, 0.002),
        ((), DECODE[:2], 0.001),
        ((), (18, 18, 41, 130), 0.0025),
        (MIXED_PREFILL, MIXED_DECODE, 0.003),
    ]
    for prefill, decode, wall in steps:
        t.record(prefill, decode, wall)
    rep = t.report()
    assert rep["hardware"] == {
        "name": "test-roof",
        "bandwidth_gb_per_s": 100.0,
        "peak_gflop_per_s": 1000.0,
        "dtype": "bf16",
        "measured_at": None,
    }
    assert set(rep["phases"]) == set(PHASES)
    for phase in PHASES:
        mine = [s for s in steps if StepRecord(s[0], s[1], s[2]).phase == phase]
        costs = [step_cost(TINY_SHAPE, p, d, 2, 2, 2) for p, d, _ in mine]
        wall = sum(w for *_, w in mine)
        flops, moved = sum(c.flops for c in costs), sum(c.bytes for c in costs)
        floor_s = sum(floor(c) for c in costs)
        got = rep["phases"][phase]
        assert got["steps"] == len(mine)
        assert got["tokens"] == sum(len(d) + sum(q for q, _ in p) for p, d, _ in mine)
        assert got["wall_s"] == pytest.approx(wall)
        assert got["flops"] == pytest.approx(flops) and got["bytes"] == pytest.approx(moved)
        assert got["floor_s"] == pytest.approx(floor_s)
        assert got["achieved_gb_per_s"] == pytest.approx(moved / wall / 1e9)
        assert got["achieved_gflop_per_s"] == pytest.approx(flops / wall / 1e9)
        assert got["roofline_fraction"] == pytest.approx(floor_s / wall)
    # the tiny model's decode is memory-bound on this roof: the floor is bytes / bandwidth
    decode = rep["phases"]["decode"]
    assert decode["floor_s"] == pytest.approx(decode["bytes"] / HW.bandwidth_bytes_per_s)
    # reading again adds nothing; new steps add to the totals
    assert t.report() == rep
    t.record([], [5], 0.001)
    assert t.report()["phases"]["decode"]["steps"] == 4


def test_report_lists_only_phases_that_ran():
    t = make_telemetry()
    t.record([], [8, 9], 0.001)
    assert list(t.report()["phases"]) == ["decode"]


def test_hardware_is_resolved_once_on_first_report_and_earlier_steps_have_no_floor():
    """Steps priced before the hardware is known count in FLOPs and bytes, not in the fraction."""
    calls = []
    t = make_telemetry(calls=calls)
    t.record([], [8, 9], 0.010)
    early = t.phases()["decode"]  # a server scraping before the roofline is known
    assert not t.hardware_resolved and calls == []
    assert early.floor_s == 0 and early.roofline_fraction == 0 and early.bytes > 0
    t.report()
    assert t.hardware_resolved and calls == [1]
    t.record([], [8, 9], 0.002)
    d = t.report()["phases"]["decode"]
    assert calls == [1]
    later = step_cost(TINY_SHAPE, [], [8, 9], 2, 2, 2)
    assert d["steps"] == 2 and d["wall_s"] == pytest.approx(0.012)
    assert d["achieved_gb_per_s"] == pytest.approx(2 * later.bytes / 0.012 / 1e9)  # over all the wall time
    assert d["floor_s"] == pytest.approx(floor(later))
    assert d["roofline_fraction"] == pytest.approx(floor(later) / 0.002)  # over the floored steps only


def test_compute_dtype_picks_the_peak():
    t = make_telemetry(bytes_per_elem=4, dtype="fp32")
    t.record(PREFILL, [], 0.01)
    rep = t.report()
    assert rep["hardware"]["peak_gflop_per_s"] == 500.0 and rep["hardware"]["dtype"] == "fp32"
    cost = step_cost(TINY_SHAPE, PREFILL, [], 4, 4, 4)
    assert rep["phases"]["prefill"]["floor_s"] == pytest.approx(floor(cost, dtype="fp32"))
    with pytest.raises(ValueError, match="no int4 peak"):
        make_telemetry(dtype="int4").report()


def test_format_has_a_line_per_phase():
    t = make_telemetry(hardware=HARDWARE_PRESETS["h100-sxm"])
    t.record(PREFILL, (), 0.004)
    t.record((), DECODE, 0.002)
    t.record(MIXED_PREFILL, MIXED_DECODE, 0.003)
    rep = t.report()
    lines = t.format().splitlines()
    assert len(lines) == 1 + len(PHASES)
    assert lines[0].startswith("roofline (h100-sxm: 3350.0 GB/s, 989400 GFLOP/s bf16)")
    for line, phase in zip(lines[1:], PHASES):
        assert line.split()[0] == phase and "% of roofline" in line
        assert f"{100 * rep['phases'][phase]['roofline_fraction']:5.1f}%" in line
        assert f"{rep['phases'][phase]['steps']:>5} steps" in line


def test_the_ops_a_step_timed_add_up_per_phase_and_the_rest_is_other():
    """Steps that timed their ops by kind (the CPU kernels' step parts): the phase sums them,
    the line lists each part outside the matmuls, the untimed rest as "other", and the matmuls'
    own parts apart; a phase whose ops outside the matmuls were not timed lists none."""
    t = make_telemetry()
    parts = {"attention": 0.002, "norms": 0.001, "routing": 0.0, "matmul_setup": 0.0005, "matmul_wait": 0.001}
    for _ in range(2):  # 10 ms steps, 6 of them in the matmuls
        t.record((), DECODE, 0.010, matmul_s=0.006, step_parts=parts)
    t.record(PREFILL, (), 0.020, matmul_s=0.015, step_parts={"attention": 0.0, "matmul_setup": 0.001})
    rep = t.report()["phases"]
    assert rep["decode"]["step_parts"] == pytest.approx({part: 2 * s for part, s in parts.items()})
    lines = {line.split()[0]: line for line in t.format().splitlines()[1:]}
    decode, prefill = lines["decode"], lines["prefill"]
    assert (
        "outside matmuls 4.00 ms/step (40%): attention 2.00, norms 1.00, other 1.00; in matmuls setup 0.50, wait 1.00"
        in decode
    )
    assert "routing" not in decode  # a part that took nothing is left out
    assert "outside matmuls 5.00 ms/step (25%); in matmuls setup 1.00" in prefill


def test_a_step_faster_than_its_floor_reprobes_once_then_raises_the_roofline():
    """A roofline a step beats is wrong (a busy probe, a peak ridge's kernels beat): the first
    time the machine is probed again; a step that still beats it raises the beaten term to its
    own rate. The report says so and no fraction exceeds 100%."""
    probes = []
    faster = dataclasses.replace(HW, bandwidth_bytes_per_s=2 * HW.bandwidth_bytes_per_s)

    def hardware_fn(reprobe=False):
        probes.append(reprobe)
        return faster if reprobe else HW

    t = Telemetry(pricing=ModelPricing(TINY_SHAPE, 2, 2, 2), compute_dtype="bf16", hardware_fn=hardware_fn)
    cost = step_cost(TINY_SHAPE, [], DECODE, 2, 2, 2)
    memory_floor = cost.bytes / HW.bandwidth_bytes_per_s
    assert cost.flops / HW.peak("bf16") < memory_floor  # memory-bound: the bandwidth is what gets raised
    t.record([], DECODE, 2 * memory_floor)  # an ordinary step: nothing happens
    assert t.report()["notices"] == [] and probes == [False]
    t.record([], DECODE, memory_floor / 4)  # 4x faster than the floor
    rep = t.report()
    assert probes == [False, True]  # re-probed once
    assert len(rep["notices"]) == 2 and rep["notices"][0].startswith("re-probed the roofline")
    assert rep["notices"][1].startswith("raised the roofline")
    assert rep["hardware"]["bandwidth_gb_per_s"] == pytest.approx(cost.bytes / (memory_floor / 4) / 1e9)
    assert rep["phases"]["decode"]["roofline_fraction"] <= 1.0
    t.record([], DECODE, memory_floor / 8)  # faster again: no second probe, raised again
    rep = t.report()
    assert probes == [False, True] and len(rep["notices"]) == 2  # one line for the raises
    assert rep["notices"][1].startswith("raised the roofline to what a step reached (2 times; the last)")
    assert rep["hardware"]["bandwidth_gb_per_s"] == pytest.approx(cost.bytes / (memory_floor / 8) / 1e9)
    assert rep["phases"]["decode"]["roofline_fraction"] <= 1.0
    assert "note: raised the roofline" in t.format()


def test_a_pipelined_step_never_moves_the_roofline():
    """Asynchronous scheduling records a step's pipeline period, which can be shorter than the
    step's own device time (H200, 2026-11-27: a 2048-token prefill "ran" in 1.15 ms and raised
    the peak to 3.4 PFLOP/s). Such a step neither re-probes nor raises the ceiling, and shows
    at most 100%."""
    probes = []

    def hardware_fn(reprobe=False):
        probes.append(reprobe)
        return HW

    t = Telemetry(pricing=ModelPricing(TINY_SHAPE, 2, 2, 2), compute_dtype="bf16", hardware_fn=hardware_fn)
    cost = step_cost(TINY_SHAPE, [], DECODE, 2, 2, 2)
    floor = cost.bytes / HW.bandwidth_bytes_per_s
    t.record([], DECODE, floor / 4, pipelined=True)
    rep = t.report()
    assert probes == [False] and rep["notices"] == []
    assert rep["hardware"]["bandwidth_gb_per_s"] == pytest.approx(HW.bandwidth_bytes_per_s / 1e9)
    assert rep["phases"]["decode"]["roofline_fraction"] == pytest.approx(1.0)  # at most its period: 100%
    t.record([], DECODE, floor / 4)  # the same time, measured as the step's own: a raise
    assert t.report()["notices"] and probes == [False, True]


def test_the_floor_is_the_analyzers_and_a_step_that_beats_it_raises_the_terms_it_rests_on():
    """One floor convention: the telemetry's floor of a step is the analyzer's roofline time
    (``StepCost.time_s``). A prefill whose floor rests mostly on the peak (compute-bound
    matmuls, memory-bound norms) and that beat it raises the peak alone, by what brings its
    floor to its time, and leaves the bandwidth that decode steps are held to; one that ran in
    half of it, faster than its memory-bound operators alone allow, raises both by 2x; a
    memory-bound decode step raises the bandwidth alone."""
    peak, bandwidth = 1e12, 100e9
    cost = step_cost(TINY_SHAPE, PREFILL, [], 2, 2, 2)
    bounds = {op.bound(peak, bandwidth) for op in cost.ops}
    assert bounds == {"compute", "memory"}
    floor = sum(max(op.flops / peak, op.bytes / bandwidth) for op in cost.ops)
    assert floor > max(cost.flops / peak, cost.bytes / bandwidth)  # not the max of the totals
    compute_s = sum(op.flops / peak for op in cost.ops if op.bound(peak, bandwidth) == "compute")
    memory_alone = sum(op.bytes / bandwidth for op in cost.ops)
    assert compute_s > floor - compute_s and memory_alone < 0.8 * floor  # mostly the peak's
    ceiling = Ceiling(peak, bandwidth)
    assert ceiling.floor_s(cost, 0.8 * floor) == pytest.approx(0.8 * floor)
    assert ceiling.bandwidth == bandwidth and ceiling.peak_flops > peak / 0.8  # the norms' time stays
    assert ceiling.floor_s(cost) == pytest.approx(0.8 * floor) and len(ceiling.notices) == 1

    ceiling = Ceiling(peak, bandwidth)
    assert ceiling.floor_s(cost) == pytest.approx(floor) == pytest.approx(cost.time_s(peak, bandwidth))
    assert floor / 2 < memory_alone  # the peak alone cannot bring the floor there
    assert ceiling.floor_s(cost, floor / 2) == pytest.approx(floor / 2)
    assert ceiling.peak_flops == pytest.approx(2 * peak) and ceiling.bandwidth == pytest.approx(2 * bandwidth)
    assert ceiling.floor_s(cost) == pytest.approx(floor / 2) and len(ceiling.notices) == 1

    decode = step_cost(TINY_SHAPE, [], DECODE, 2, 2, 2)
    ceiling = Ceiling(peak, bandwidth)
    memory_floor = decode.bytes / bandwidth
    assert ceiling.floor_s(decode) == pytest.approx(memory_floor)  # every op memory-bound
    ceiling.floor_s(decode, memory_floor / 3)
    # at 3x some operators turn compute-bound: the bandwidth goes as far as the floor needs
    assert ceiling.peak_flops == peak and ceiling.bandwidth >= 3 * bandwidth
    assert ceiling.floor_s(decode) == pytest.approx(memory_floor / 3)


def test_reset_empties_the_records_and_totals():
    t = make_telemetry()
    t.record(PREFILL, (), 0.004)
    t.report()
    t.record((), DECODE, 0.002)  # pending, not yet priced
    t.reset()
    assert len(t.recent) == 0 and t.report()["phases"] == {}
    assert all(s.steps == 0 and s.bytes == 0 for s in t.phases().values())
    t.record((), DECODE, 0.002)
    assert t.report()["phases"]["decode"]["steps"] == 1 and "prefill" not in t.report()["phases"]
    assert t.hardware_resolved  # reset keeps the roofline


def test_recent_keeps_the_last_steps():
    t = make_telemetry()
    for i in range(t.recent.maxlen + 3):
        t.record([], [i + 1], 1e-4)
    assert len(t.recent) == t.recent.maxlen and t.recent[0].decode_contexts == (4,)
    assert t.report()["phases"]["decode"]["steps"] == t.recent.maxlen + 3  # totals keep everything


def test_an_engine_records_the_analyzers_generation(stories_dir):
    """A real engine step by step: one prefill of the prompt, then decodes at contexts
    prompt_len + 1 .. prompt_len + output_len - 1, each priced as the analyzer prices it."""
    from ridge.engine.llm import LLM
    from ridge.sampling import SamplingParams

    llm = LLM(str(stories_dir), dtype="float32")
    t = llm.engine.telemetry
    p = t.pricing
    assert (p.weight_bytes, p.kv_bytes, p.act_bytes, p.router_bytes, t.compute_dtype) == (4, 4, 4, 4, "fp32")
    t._hardware = HW  # no probe
    t.reset()
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    records = list(t.recent)
    assert [r.phase for r in records] == ["prefill"] + ["decode"] * 5
    assert records[0].prefill_chunks == ((5, 5),)
    az = Analyzer(
        p.model,
        Roof("fp32", HW.peak("fp32"), HW.bandwidth_bytes_per_s),
        Workload(prompt_len=5, output_len=6, precision=Precision(32, 32, 32)),
        Conventions(),
    )
    contexts = az.workload.generation_contexts()
    assert [r.decode_contexts for r in records[1:]] == [(c,) for c in contexts]
    assert t.price(records[0]).bytes == az.prefill(1).cost.bytes
    assert [t.price(r).flops for r in records[1:]] == [az.decode(1, c).cost.flops for c in contexts]
    assert all(r.wall_s > 0 for r in records)
    rep = t.report()["phases"]
    assert rep["prefill"]["tokens"] == 5 and rep["decode"]["tokens"] == 5


# ---- the probe's output -----------------------------------------------------------------------

TINY_PROBE = ProbeSettings(
    bandwidth_bytes=1 << 20,
    bandwidth_repeats=4,
    matmul_sizes=(16, 32),
    matmul_repeats=2,
    matmul_budget_s=0.05,
    dtypes=("fp32",),
    ridge_kernels=False,
)


def test_measurement_is_the_median_and_range_of_its_samples():
    odd = Measurement.of([3.0, 1.0, 2.0])
    assert (odd.median, odd.low, odd.high, odd.samples) == (2.0, 1.0, 3.0, 3)
    even = Measurement.of([4.0, 1.0, 3.0, 2.0])
    assert (even.median, even.low, even.high, even.samples) == (2.5, 1.0, 4.0, 4)
    assert even.to_json() == {"median": 2.5, "low": 1.0, "high": 4.0, "samples": 4}
    assert Measurement.from_json(json.loads(json.dumps(even.to_json()))) == even
    with pytest.raises(ValueError):
        Measurement.of([0.0, 1.0])  # a rate is positive


def test_probe_bandwidth_returns_a_median_with_its_spread():
    m = probe_bandwidth(ProbeSettings(bandwidth_bytes=1 << 20, bandwidth_repeats=5))
    assert isinstance(m, Measurement) and m.samples == 5
    assert 0 < m.low <= m.median <= m.high and math.isfinite(m.high)
    assert set(m.to_json()) == {"median", "low", "high", "samples"}


def test_probe_settings_reject_what_cannot_be_probed():
    for bad in (
        dict(bandwidth_bytes=1024),
        dict(bandwidth_repeats=0),
        dict(matmul_repeats=0),
        dict(matmul_sizes=()),
        dict(matmul_sizes=(64, 32)),
        dict(dtypes=("fp8",)),
    ):
        with pytest.raises(ValueError, match="ProbeSettings"):
            ProbeSettings(**bad)


def test_local_hardware_file_format(tmp_path):
    """The cache is a hardware JSON file plus the fingerprint, the probe settings and the load
    other processes put on the CPUs meanwhile; every number it states is the best of the probe
    beside it (a ceiling: slower trials measured a disturbance)."""
    hw = local_hardware(cache_dir=tmp_path, settings=TINY_PROBE)
    data = json.loads((tmp_path / probe.CACHE_FILE_NAME).read_text())
    assert set(data) == {
        "name",
        "peak_flops",
        "bandwidth_bytes_per_s",
        "memory_bytes",
        "source",
        "measured_at",
        "bandwidth_probe",
        "flops_probes",
        "fingerprint",
        "probe_settings",
        "other_load",
    }
    assert 0 <= data["other_load"] <= 1 and "of the CPUs during the probe" in data["source"]
    assert data["name"] == "local" and set(data["peak_flops"]) == {"fp32"} == set(data["flops_probes"])
    assert data["bandwidth_bytes_per_s"] == data["bandwidth_probe"]["high"] == hw.bandwidth_bytes_per_s
    assert data["bandwidth_probe"]["samples"] == TINY_PROBE.bandwidth_repeats
    assert data["peak_flops"]["fp32"] == data["flops_probes"]["fp32"]["high"]
    assert data["flops_probes"]["fp32"]["samples"] == TINY_PROBE.matmul_repeats
    for m in (data["bandwidth_probe"], data["flops_probes"]["fp32"]):
        assert 0 < m["low"] <= m["median"] <= m["high"]
    assert data["probe_settings"] == json.loads(json.dumps(dataclasses.asdict(TINY_PROBE)))
    assert set(data["fingerprint"]) == {"probe", "cpu", "logical_cpus", "threads", "torch"}
    assert dt.datetime.fromisoformat(data["measured_at"]).tzinfo is not None
    assert "1 MiB" in data["source"]  # the probe size is stated with the numbers


@pytest.mark.parametrize("content", ["not json {", json.dumps({"name": "local", "fingerprint": "x"})])
def test_an_unusable_cache_is_probed_again_and_overwritten(tmp_path, monkeypatch, content):
    fresh = dataclasses.replace(HW, name="local", measured_at="2030-01-01T00:00:00+00:00")
    monkeypatch.setattr(probe, "probe_local_with_load", lambda settings: (fresh, 0.0))
    path = tmp_path / probe.CACHE_FILE_NAME
    path.write_text(content)
    assert local_hardware(cache_dir=tmp_path) == fresh
    assert Hardware.from_json(json.loads(path.read_text())) == fresh


@pytest.mark.parametrize(
    "change",
    [
        {"measured_at": (dt.datetime.now(dt.UTC) - dt.timedelta(days=2)).isoformat(timespec="seconds")},
        {"other_load": 0.6},  # taken while other processes kept the CPUs busy
        {"other_load": None},  # a cache that does not say under what load it was taken
    ],
)
def test_a_stale_or_busy_cache_is_probed_again(tmp_path, monkeypatch, change):
    """The cache said nothing of when or under what load it was taken and was reused forever
    (one probe at 20.7 GB/s under load, against 62 quiet, priced every later step)."""
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    payload = {
        **dataclasses.replace(HW, name="local", measured_at=now).to_json(),
        "fingerprint": probe.machine_fingerprint(),
        "other_load": 0.01,
    }
    (tmp_path / probe.CACHE_FILE_NAME).write_text(json.dumps(payload))
    fresh = dataclasses.replace(HW, name="local", bandwidth_bytes_per_s=62e9)
    monkeypatch.setattr(probe, "probe_local_with_load", lambda settings: (fresh, 0.0))
    assert local_hardware(cache_dir=tmp_path).bandwidth_bytes_per_s == HW.bandwidth_bytes_per_s  # current: reused
    (tmp_path / probe.CACHE_FILE_NAME).write_text(json.dumps({**payload, **change}))
    assert local_hardware(cache_dir=tmp_path) == fresh
    assert json.loads((tmp_path / probe.CACHE_FILE_NAME).read_text())["other_load"] == 0.0


def test_the_probed_peak_is_the_best_of_torch_and_ridges_kernels(monkeypatch):
    """ridge's GEMM beats torch.matmul on some CPUs: a peak from torch alone put prefill at 148%
    and 225% of its roofline. A fake extension here runs 'twice as fast' as torch."""
    monkeypatch.setattr(probe, "_seconds", lambda run: run())
    monkeypatch.setattr(probe, "_matmul_runner", lambda dtype, n: lambda: 2.0)
    monkeypatch.setattr(probe, "_ridge_matmul_runner", lambda kernels, n: lambda: 1.0)
    settings = ProbeSettings(matmul_sizes=(16,), matmul_repeats=2, matmul_budget_s=100.0)
    assert probe.probe_matmul("bf16", settings, kernels=object()).high == pytest.approx(2 * 16**3 / 1.0)
    assert probe.probe_matmul("bf16", settings, kernels=None).high == pytest.approx(2 * 16**3 / 2.0)
    assert probe.probe_matmul("fp32", settings, kernels=object()).high == pytest.approx(2 * 16**3 / 2.0)


def test_a_cache_with_a_broken_measurement_is_probed_again(tmp_path, monkeypatch):
    payload = {
        **dataclasses.replace(HW, name="local").to_json(),
        "fingerprint": probe.machine_fingerprint(),
        "bandwidth_probe": {"median": 5.0, "low": 6.0, "high": 7.0, "samples": 3},
    }
    (tmp_path / probe.CACHE_FILE_NAME).write_text(json.dumps(payload))
    fresh = dataclasses.replace(HW, name="local")
    monkeypatch.setattr(probe, "probe_local_with_load", lambda settings: (fresh, 0.0))
    assert local_hardware(cache_dir=tmp_path) == fresh
