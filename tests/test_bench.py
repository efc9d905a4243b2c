"""``ridge bench latency`` and ``ridge bench throughput`` with ``--json`` on the tiny real model.

Smoke tests of structure and consistency, never of speed. The local roofline is a fixed
``Hardware`` (the engine's ``local_hardware`` is patched) and the per-round bandwidth probe
returns a fixed measurement, so nothing is probed and every floor can be recomputed here.
"""

from __future__ import annotations

import json
import random
import statistics

import pytest

from ridge.bench import throughput
from ridge.bench.throughput import draw_lengths
from ridge.cli import main
from ridge.layers.cpu_kernels import loaded_prefetch_policy
from ridge.roofline import probe
from ridge.roofline.hardware import GIB, Hardware, Measurement
from ridge.roofline.ops import step_cost
from ridge.roofline.shapes import ModelShape

# Far faster than what a Python engine reaches on a 0.26M-parameter model, so fractions stay < 1.
FAKE_HW = Hardware("fake-local", {"fp32": 100e9, "bf16": 200e9}, 20e9, 16 * GIB, "made up for the tests")
FAKE_BW = 20e9


@pytest.fixture
def no_probes(monkeypatch):
    """A fixed roofline for the engine's telemetry and the latency bench's bandwidth probes;
    returns the list of ProbeSettings the bench asked to probe with.

    (RIDGE_CACHE_DIR is left alone: it also holds the compiled CPU kernels, which a fresh
    directory would rebuild for ~40 s; with ``local_hardware`` patched nothing is written there.)
    """
    import ridge.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "local_hardware", lambda *a, **k: FAKE_HW)
    calls = []

    def fake_probe(settings):
        calls.append(settings)
        return Measurement(FAKE_BW, FAKE_BW, FAKE_BW, settings.bandwidth_repeats)

    monkeypatch.setattr(probe, "probe_read_bandwidth", fake_probe)
    return calls


def bench(capsys, *argv) -> dict:
    rc = main(["bench", *argv, "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)  # --json prints JSON only


def model_args(stories_dir) -> list[str]:
    # On the CPU whatever the machine has: these tests pin the CPU's (patched) roofline.
    return ["--model", str(stories_dir), "--dtype", "float32", "--device", "cpu"]


# ---- latency ----------------------------------------------------------------------------------


def test_bench_latency_json(stories_dir, no_probes, capsys):
    out = bench(
        capsys,
        "latency",
        *model_args(stories_dir),
        "--batch",
        "1",
        "--batch",
        "2",
        "--input-len",
        "4",
        "--output-len",
        "4",
        "--rounds",
        "1",
        "--warmup-rounds",
        "0",
    )
    assert (out["model"], out["dtype"], out["device"]) == (str(stories_dir), "float32", "cpu")
    assert (out["input_len"], out["output_len"]) == (4, 4)
    assert {"date", "cpus", "torch", "torch_threads"} <= set(out["machine"])
    assert out["machine"]["cpu_prefetch"] == loaded_prefetch_policy()  # the CPU kernels' policy, if loaded
    assert [r["batch"] for r in out["results"]] == [1, 2]
    assert len(no_probes) == 2 * 2  # before and after each round, for each batch
    shape = ModelShape.from_hf_config(json.loads((stories_dir / "config.json").read_text()))
    for r in out["results"]:
        b, d, p = r["batch"], r["decode"], r["prefill"]
        assert r["peak_gflop_per_s"] == 100.0
        assert r["bandwidth_gb_per_s"]["median"] == 20.0 and r["bandwidth_gb_per_s"]["n"] == 1
        # output_len 4: the first token comes from prefill, then decodes at contexts 5, 6, 7
        step = d["ms_per_step"]
        assert step["n"] == 3 and 0 < step["min"] <= step["median"] <= step["max"]
        assert d["tokens_per_s"] == pytest.approx(b * 1000 / step["median"])
        floors = [
            1e3 * max(c.flops / 100e9, c.bytes / FAKE_BW)
            for c in (step_cost(shape, [], [ctx] * b, 4, 4, 4) for ctx in (5, 6, 7))
        ]
        assert [d["floor_ms"][k] for k in ("min", "median", "max")] == pytest.approx(floors)
        for key in ("roofline_fraction", "achieved_gb_per_s"):
            s = d[key]
            assert s["n"] == 3 and 0 < s["min"] <= s["median"] <= s["max"]
        assert d["roofline_fraction"]["max"] <= 1.0
        # a fraction is floor / wall, per step: its range brackets the ratio of the medians' range
        assert d["roofline_fraction"]["min"] <= d["floor_ms"]["max"] / step["min"]
        assert d["roofline_fraction"]["max"] >= d["floor_ms"]["min"] / step["max"]
        assert p["tokens_per_s"]["n"] == 1 and p["tokens_per_s"]["median"] > 0
        assert 0 < p["roofline_fraction"]["median"] <= 1.0


def test_bench_latency_splits_the_decode_steps_time_outside_the_matmuls(tmp_path, no_probes, capsys):
    """Where ridge's CPU kernels time their matmuls and the decode plan its ops (a bf16 Llama),
    the decode result says what the steps spent outside the matmuls, by kind of op, "other" the
    untimed rest, in ms per step; the text prints the same figures on a line."""
    from ridge.layers.cpu_kernels import cpu_has_avx512_bf16

    from .models.hf_tiny import build

    if not cpu_has_avx512_bf16():
        pytest.skip("ridge's CPU kernels need AVX-512 BF16")
    build("llama-gqa", tmp_path)
    args = ["--model", str(tmp_path), "--dtype", "bfloat16", "--device", "cpu", "--tokenizer", "bytes"]
    args += ["--num-kv-blocks", "64", "--input-len", "4", "--output-len", "6", "--warmup-rounds", "0"]
    d = bench(capsys, "latency", *args, "--rounds", "2")["results"][0]["decode"]
    split = d["outside_matmuls"]
    assert split is not None and 0 < split["share"] < 1
    assert 0 < split["ms_per_step"] < d["ms_per_step"]["max"]
    # the plan's ops by kind, and "other": together the time outside the matmuls
    assert {"attention", "norms", "other"} <= set(split["by_op_ms_per_step"])
    assert sum(split["by_op_ms_per_step"].values()) == pytest.approx(split["ms_per_step"])
    assert all(ms >= 0 for ms in split["in_matmuls_ms_per_step"].values())
    assert main(["bench", "latency", *args, "--rounds", "1"]) == 0
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if "outside matmuls" in line)
    assert "ms/step (" in line and "attention " in line and "other " in line


def test_no_fraction_above_100_percent_when_steps_beat_the_roofline(stories_dir, monkeypatch, capsys):
    """A roofline every step beats (a stale, busy probe; a peak below ridge's own kernels): the
    bench re-probes once, then raises the roofline to the steps' rates and says so; it reported
    prefill at 148% and 225% of its roofline."""
    import ridge.engine.engine as engine_module

    slow = Hardware("slow-local", {"fp32": 1e6, "bf16": 1e6}, 1e6, 16 * GIB, "made up: far too slow")
    reprobes = []

    def local_hardware(*args, reprobe=False, **kwargs):
        reprobes.append(reprobe)
        return slow

    monkeypatch.setattr(engine_module, "local_hardware", local_hardware)
    monkeypatch.setattr(probe, "probe_read_bandwidth", lambda settings: Measurement(1e6, 1e6, 1e6, 1))
    out = bench(
        capsys,
        "latency",
        *model_args(stories_dir),
        "--batch",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--rounds",
        "2",
        "--warmup-rounds",
        "0",
    )
    (r,) = out["results"]
    assert r["decode"]["roofline_fraction"]["max"] <= 1.0 and r["prefill"]["roofline_fraction"]["max"] <= 1.0
    assert reprobes.count(True) == 1  # once per bench
    assert any(n.startswith("re-probed") for n in r["notices"]) and any(n.startswith("raised") for n in r["notices"])
    assert r["peak_gflop_per_s"] > 1e6 / 1e9


def test_bench_latency_defaults_to_batch_one_and_text_output(stories_dir, no_probes, capsys):
    rc = main(
        [
            "bench",
            "latency",
            *model_args(stories_dir),
            "--input-len",
            "3",
            "--output-len",
            "2",
            "--rounds",
            "1",
            "--warmup-rounds",
            "1",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and len(no_probes) == 2 * 2  # the warm-up round probes too
    assert text.startswith("ridge bench latency:") and "batch 1:" in text and "batch 2" not in text
    assert "% of roofline" in text and "prompt 3 tokens, 2 new tokens" in text


# ---- throughput -------------------------------------------------------------------------------


def check_throughput(out: dict, prompt_lens: list[int], output_lens: list[int]) -> None:
    n = len(prompt_lens)
    assert out["requests"] == n
    assert out["prompt_tokens"] == sum(prompt_lens)
    assert out["output_tokens"] == sum(output_lens)  # exact: ignore_eos
    elapsed = out["elapsed_s"]
    assert elapsed > 0
    assert out["requests_per_s"] == pytest.approx(n / elapsed)
    assert out["input_tokens_per_s"] == pytest.approx(out["prompt_tokens"] / elapsed)
    assert out["output_tokens_per_s"] == pytest.approx(out["output_tokens"] / elapsed)
    assert out["total_tokens_per_s"] == pytest.approx((out["prompt_tokens"] + out["output_tokens"]) / elapsed)
    tel = out["telemetry"]
    assert tel["hardware"]["name"] == "fake-local" and tel["hardware"]["dtype"] == "fp32"
    phases = tel["phases"]
    assert set(phases) <= {"prefill", "decode", "mixed"} and phases
    # every prompt token and every generated token but each request's last goes through a step
    assert sum(p["tokens"] for p in phases.values()) == out["prompt_tokens"] + out["output_tokens"] - n
    for p in phases.values():
        assert p["steps"] > 0 and p["flops"] > 0 and p["bytes"] > 0 and p["wall_s"] > 0
        assert p["achieved_gb_per_s"] == pytest.approx(p["bytes"] / p["wall_s"] / 1e9)
        assert 0 < p["roofline_fraction"] <= 1.0
    assert sum(p["wall_s"] for p in phases.values()) <= elapsed


def expected_workload(num_prompts, input_len, output_len, seed=0, dist="uniform"):
    """The lengths the bench draws for these flags (the prompts' ids aside)."""
    rng = random.Random(seed)
    lo, _, hi = input_len.partition(":")
    in_lens = draw_lengths(rng, int(lo), int(hi or lo), num_prompts)
    lo, _, hi = output_len.partition(":")
    return in_lens, draw_lengths(rng, int(lo), int(hi or lo), num_prompts, dist)


def test_bench_throughput_json(stories_dir, no_probes, capsys):
    out = bench(
        capsys,
        "throughput",
        *model_args(stories_dir),
        "--num-prompts",
        "6",
        "--input-len",
        "3:9",
        "--output-len",
        "2:7",
        "--workload-seed",
        "3",
    )
    assert out["workload"] == {
        "num_prompts": 6,
        "input_len": "3:9",
        "output_len": "2:7",
        "output_dist": "uniform",
        "dataset": None,
        "seed": 3,
    }
    assert (out["scheduler"], out["max_num_seqs"], out["dtype"], out["device"]) == ("continuous", 256, "float32", "cpu")
    in_lens, out_lens = expected_workload(6, "3:9", "2:7", seed=3)
    assert all(3 <= n <= 9 for n in in_lens) and all(2 <= n <= 7 for n in out_lens)
    check_throughput(out, in_lens, out_lens)
    assert no_probes == []  # throughput reads the roofline, it does not probe


def test_bench_throughput_fixed_lengths_static_scheduler(stories_dir, no_probes, capsys):
    out = bench(
        capsys,
        "throughput",
        *model_args(stories_dir),
        "--num-prompts",
        "5",
        "--input-len",
        "6",
        "--output-len",
        "3",
        "--scheduler",
        "static",
        "--max-num-seqs",
        "2",
    )
    assert out["scheduler"] == "static" and out["max_num_seqs"] == 2
    check_throughput(out, [6] * 5, [3] * 5)
    # static batching, 2 at a time: no step ever mixes a prefill into running decodes
    assert "mixed" not in out["telemetry"]["phases"]
    assert out["telemetry"]["phases"]["prefill"]["steps"] == 3  # batches of 2, 2, 1


def test_bench_throughput_log_uniform_outputs(stories_dir, no_probes, capsys):
    out = bench(
        capsys,
        "throughput",
        *model_args(stories_dir),
        "--num-prompts",
        "8",
        "--input-len",
        "4",
        "--output-len",
        "2:24",
        "--output-dist",
        "log-uniform",
    )
    assert out["workload"]["output_dist"] == "log-uniform"
    in_lens, out_lens = expected_workload(8, "4", "2:24", dist="log-uniform")
    assert out_lens != expected_workload(8, "4", "2:24")[1]  # the flag reaches the draw
    check_throughput(out, in_lens, out_lens)


def test_bench_throughput_from_a_dataset(stories_dir, no_probes, capsys, tmp_path):
    rows = [
        {"prompt_token_ids": [5, 6, 7], "output_len": 4},
        {"prompt_token_ids": [9] * 8, "output_len": 2},
        {"prompt_token_ids": [11, 12], "max_tokens": 5},
        {"prompt_token_ids": [3, 4], "output_len": 9},
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = bench(capsys, "throughput", *model_args(stories_dir), "--dataset", str(path), "--num-prompts", "3")
    assert out["workload"]["dataset"] == str(path) and out["workload"]["num_prompts"] == 3
    check_throughput(out, [3, 8, 2], [4, 2, 5])  # the first --num-prompts rows


def test_draw_lengths():
    rng = random.Random(0)
    uniform = draw_lengths(rng, 8, 512, 2000)
    log_uniform = draw_lengths(rng, 8, 512, 2000, "log-uniform")
    assert len(uniform) == len(log_uniform) == 2000
    assert all(8 <= n <= 512 for n in uniform + log_uniform)
    assert all(isinstance(n, int) for n in uniform + log_uniform)
    # log-uniform: many short, a long tail; its median is near the geometric mean (64), uniform's near 260
    assert statistics.median(log_uniform) < statistics.median(uniform)
    assert 48 < statistics.median(log_uniform) < 85 and 220 < statistics.median(uniform) < 300
    assert max(log_uniform) > 400  # the tail is there
    assert draw_lengths(random.Random(1), 8, 512, 50, "log-uniform") == draw_lengths(
        random.Random(1), 8, 512, 50, "log-uniform"
    )
    assert draw_lengths(rng, 7, 7, 5, "log-uniform") == [7] * 5 == draw_lengths(rng, 7, 7, 5)
    with pytest.raises(ValueError, match="unknown length distribution"):
        draw_lengths(rng, 8, 512, 10, "zipf")
    assert throughput.OUTPUT_DISTRIBUTIONS == ("uniform", "log-uniform")


# ---- bad input --------------------------------------------------------------------------------


def test_one_token_prompts_are_prefill_and_fresh_prompts_every_round(stories_dir, no_probes, capsys):
    """A one-token prompt's step is prefill, not decode; no round reuses another's prompt via the
    prefix cache, so prefill counts the tokens it computed."""
    out = bench(
        capsys,
        "latency",
        *model_args(stories_dir),
        "--batch",
        "2",
        "--input-len",
        "1",
        "--output-len",
        "3",
        "--rounds",
        "2",
        "--warmup-rounds",
        "1",
    )
    (r,) = out["results"]
    assert r["decode"]["ms_per_step"]["n"] == 2 * 2  # contexts 2 and 3, in each timed round
    assert r["prefill"]["tokens_per_s"]["median"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["latency", "--output-len", "0"],
        ["latency", "--rounds", "0"],
        ["latency", "--batch", "0"],
        ["throughput", "--output-len", "0"],
        ["throughput", "--input-len", "9:3"],
        ["throughput", "--num-prompts", "0"],
    ],
)
def test_bad_flags_exit_2_with_one_line(stories_dir, no_probes, capsys, argv):
    rc = main(["bench", argv[0], *model_args(stories_dir), *argv[1:], "--json"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ridge bench: error:")


def test_unknown_output_distribution_is_an_argparse_error(stories_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", *model_args(stories_dir), "--output-dist", "zipf"])
    assert exc.value.code == 2 and "--output-dist" in capsys.readouterr().err


def _quality(capsys, *flags):
    assert main(["bench", "quality", "--tokens", "120", "--num-kv-blocks", "64", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_quality_of_a_model_against_itself_is_zero_divergence(stories_dir, capsys):
    result = _quality(capsys, "--model", str(stories_dir))
    assert result["tokens"] == 125  # <s> and the prompt's 4 tokens, then 120 sampled
    assert abs(result["mean_kld"]) < 1e-6 and result["top_token_agreement"] == 1.0
    assert result["ppl_candidate"] == pytest.approx(result["ppl_reference"])


@pytest.mark.parametrize(
    "flags", [["--quantization", "int8"], ["--quantization", "int4"], ["--kv-cache-dtype", "int8"]]
)
def test_bench_quality_measures_what_quantization_costs(stories_dir, capsys, flags):
    result = _quality(capsys, "--model", str(stories_dir), *flags)
    assert 0 < result["mean_kld"] < 0.5 and 0.5 < result["top_token_agreement"] < 1.0 + 1e-9
    assert result["ppl_reference"] > 1 and result["ppl_candidate"] > 1
    int8 = flags == ["--quantization", "int8"]
    assert not int8 or result["mean_kld"] < 0.05
