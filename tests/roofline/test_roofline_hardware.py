"""Hardware presets, overrides, JSON round trips, and the local probe with its on-disk cache.

The probe runs at a tiny size here (format, not timing); the real one takes a few seconds.
"""

import datetime as dt
import json

import pytest

from ridge.roofline import probe
from ridge.roofline.hardware import GIB, HARDWARE_PRESETS, Hardware, Measurement, resolve_hardware
from ridge.roofline.probe import ProbeSettings, local_hardware

ISSUE_HARDWARE = ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l40s", "rtx-4090", "mi300x")
TINY = ProbeSettings(
    bandwidth_bytes=1 << 20,
    bandwidth_repeats=3,
    matmul_sizes=(16, 32),
    matmul_repeats=2,
    matmul_budget_s=0.2,
    dtypes=("fp32", "bf16"),
    ridge_kernels=False,
)


@pytest.mark.parametrize("name", ISSUE_HARDWARE)
def test_presets_have_dense_peaks_bandwidth_memory_and_a_source(name):
    hw = HARDWARE_PRESETS[name]
    assert hw.peak("bf16") > hw.peak("fp32") > 0
    assert hw.bandwidth_bytes_per_s > 0 and hw.memory_bytes >= 24 * GIB
    assert hw.source and ("datasheet" in hw.source or "whitepaper" in hw.source)
    assert 50 < hw.ridge_point("bf16") < 500


def test_h100_numbers_are_dense_not_sparse():
    hw = HARDWARE_PRESETS["h100-sxm"]
    assert hw.peak("bf16") == pytest.approx(989.4e12)
    assert hw.bandwidth_bytes_per_s == pytest.approx(3.35e12)


def test_overrides_and_custom_hardware():
    hw = resolve_hardware("h100-sxm", dtype="bf16", bandwidth_gbs=2000, memory_gib=40)
    assert hw.bandwidth_bytes_per_s == 2e12 and hw.memory_bytes == 40 * GIB
    assert hw.peak("bf16") == HARDWARE_PRESETS["h100-sxm"].peak("bf16")
    assert "user-set" in hw.source
    custom = resolve_hardware("custom", dtype="bf16", peak_tflops=100, bandwidth_gbs=1000)
    assert custom.ridge_point("bf16") == pytest.approx(100)
    with pytest.raises(ValueError, match="needs --peak-tflops"):
        resolve_hardware("custom", bandwidth_gbs=1000)
    with pytest.raises(ValueError, match="not one of"):
        resolve_hardware("tpu-v9")
    with pytest.raises(ValueError, match="no int4 peak"):
        HARDWARE_PRESETS["h100-sxm"].peak("int4")


def test_hardware_validates_itself():
    with pytest.raises(ValueError, match="bandwidth"):
        Hardware("x", {"bf16": 1e12}, 0, 1e9, "test")
    with pytest.raises(ValueError, match="unknown dtype"):
        Hardware("x", {"bf17": 1e12}, 1e9, 1e9, "test")
    with pytest.raises(ValueError):
        Measurement(median=5, low=6, high=7, samples=3)


def test_a_kernel_peak_replaces_the_dtype_peak_and_says_its_share_of_it():
    hw = Hardware("local", {"bf16": 1e12, "int8": 2e12}, 5e10, 1e10, "probed")
    kernel = hw.with_kernel_peak("int8", Measurement(median=0.9e12, low=0.8e12, high=1e12, samples=3), "q2_k kernel")
    assert kernel.peak("int8") == 1e12 and kernel.peak("bf16") == 1e12
    assert kernel.flops_probes["int8"].median == 0.9e12
    assert "int8 peak: q2_k kernel, 1000 GFLOP/s (50% of the int8 matmul peak, 2000 GFLOP/s)" in kernel.source
    # torch's int8 GEMM without VNNI (AVX2 alone) is far slower than ridge's kernel: a multiple
    slow = Hardware("local", {"bf16": 1e11, "int8": 5e9}, 2e10, 1e10, "probed").with_kernel_peak(
        "int8", Measurement(median=9e10, low=8e10, high=9.5e10, samples=3), "q4_k kernel"
    )
    assert "int8 peak: q4_k kernel, 95 GFLOP/s (19.0x the int8 matmul peak, 5.0 GFLOP/s)" in slow.source
    # no int8 peak to compare with (a CPU without an int8 matmul probe): the kernel's figure alone
    alone = Hardware("local", {"bf16": 1e12}, 5e10, 1e10, "probed").with_kernel_peak(
        "int8", Measurement(median=1e12, low=1e12, high=1e12, samples=1), "q2_k kernel"
    )
    assert alone.source.endswith("int8 peak: q2_k kernel, 1000 GFLOP/s") and alone.peak("int8") == 1e12


def test_hardware_json_round_trip(tmp_path):
    hw = HARDWARE_PRESETS["mi300x"]
    assert Hardware.from_json(json.loads(json.dumps(hw.to_json()))) == hw
    path = tmp_path / "hw.json"
    path.write_text(
        json.dumps({"name": "mine", "peak_flops": {"bf16": 1e14}, "bandwidth_bytes_per_s": 1e12, "memory_bytes": 1e10})
    )
    assert resolve_hardware(str(path)).ridge_point("bf16") == pytest.approx(100)


def test_local_probe_reports_bandwidth_and_flops_with_spread(tmp_path):
    hw = local_hardware(cache_dir=tmp_path, settings=TINY)
    assert hw.name == "local"
    assert set(hw.peak_flops) == {"fp32", "bf16"}
    assert hw.bandwidth_probe.samples == 3
    assert hw.bandwidth_bytes_per_s == hw.bandwidth_probe.high  # a ceiling: the best trial
    for dtype, m in hw.flops_probes.items():
        assert hw.peak(dtype) == m.high
    assert dt.datetime.fromisoformat(hw.measured_at).date() == dt.datetime.now(dt.UTC).date()
    assert hw.memory_bytes > 0 and "measured on this machine" in hw.source


def test_local_probe_is_cached_with_the_date_and_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "other_load", lambda: 0.0)  # a busy machine's probe is not kept (tested below)
    first = local_hardware(cache_dir=tmp_path, settings=TINY)
    cached = json.loads((tmp_path / probe.CACHE_FILE_NAME).read_text())
    assert cached["measured_at"] == first.measured_at
    assert cached["fingerprint"] == probe.machine_fingerprint()

    def no_probe(settings):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(probe, "probe_local", no_probe)
    assert local_hardware(cache_dir=tmp_path, settings=TINY) == first
    # The cache file is itself a hardware JSON file.
    assert resolve_hardware(str(tmp_path / probe.CACHE_FILE_NAME)) == first


def test_local_probe_reruns_when_asked_or_when_the_machine_changed(tmp_path, monkeypatch):
    local_hardware(cache_dir=tmp_path, settings=TINY)
    calls = []
    real = probe.probe_local

    def counting(settings):
        calls.append(settings)
        return real(settings)

    monkeypatch.setattr(probe, "probe_local", counting)
    local_hardware(cache_dir=tmp_path, reprobe=True, settings=TINY)
    monkeypatch.setattr(probe, "machine_fingerprint", lambda: {"cpu": "another one"})
    local_hardware(cache_dir=tmp_path, settings=TINY)
    assert len(calls) == 2


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path / "c"))
    assert probe.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("RIDGE_CACHE_DIR")
    assert probe.default_cache_dir().parts[-2:] == (".cache", "ridge")


def test_matmul_probe_stops_growing_when_over_budget(monkeypatch):
    """A dtype that is slow here (fp16 on CPUs without it) must not run the big sizes."""
    sizes = []
    real_runner = probe._matmul_runner

    def recording_runner(dtype, n):
        sizes.append(n)
        return real_runner(dtype, n)

    monkeypatch.setattr(probe, "_matmul_runner", recording_runner)
    monkeypatch.setattr(probe, "_seconds", lambda run: 0.5)  # every run "takes" half a second
    settings = ProbeSettings(matmul_sizes=(8, 16, 32), matmul_repeats=2, matmul_budget_s=2.0)
    measured = probe.probe_matmul("fp32", settings)
    assert measured is not None and sizes == [8, 16]  # 16 is priced by one run, then dropped


def test_the_matmul_probe_times_a_model_layers_layout(monkeypatch):
    """x @ W^T with W as (out, in), as every linear layer runs it: torch.matmul of two
    row-major squares took a bf16 path 10-60x slower on an AVX2-only EPYC, which no layer
    runs, and put every decode step at 'over 1000% of its floor'."""
    calls = []
    real = probe.F.linear

    def recording(x, weight, *args):
        calls.append((tuple(x.shape), tuple(weight.shape), weight.dtype))
        return real(x, weight, *args)

    monkeypatch.setattr(probe.F, "linear", recording)
    run = probe._matmul_runner("bf16", 16)
    run()
    assert calls == [((16, 16), (16, 16), probe.torch.bfloat16)]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q6_k", "iq4_xs", "q2_k"])
def test_a_block_kernels_ceiling_is_probed_where_ridges_kernels_take_the_format(fmt):
    """ridge analyze --weight-format's compute ceiling: the format's own kernel (AVX-512 or
    AVX2), timed in cache on 64 rows; None where no ridge kernel runs here."""
    from ridge.layers.cpu_kernels import cpu_has_avx2, cpu_has_avx512_bf16

    measured = probe.probe_block_kernel(fmt, repeats=2, warmup_s=0.0, min_s=0.0)
    if not (cpu_has_avx512_bf16() or cpu_has_avx2()):
        assert measured is None
        return
    assert measured is not None and measured.samples >= 2
    assert 1e9 < measured.low <= measured.high < 1e14  # GFLOP/s to 100 TFLOP/s, not a unit slip
    assert probe.probe_block_kernel("no_such_format") is None


def test_ridges_bf16_layer_is_a_matmul_candidate_where_its_kernels_run():
    """The bf16 candidate runs the kernel set's own linear layer on the weight as a model
    holds it (AVX-512: packed for its GEMM; AVX2: torch's float32 GEMM on the widened weight)."""
    kernels = probe._ridge_kernels()
    if kernels is None:
        pytest.skip("ridge's CPU kernels do not run here")
    run = probe._ridge_matmul_runner(kernels, 32)
    out = run()
    assert out.shape == (32, 32) and out.dtype == probe.torch.bfloat16 and bool(out.isfinite().all())
