"""``ridge analyze`` end to end: tables, the JSON contract, the plot, --matmul, errors."""

import argparse
import json

import pytest

from ridge.cli import main as ridge_main
from ridge.layers.cpu_kernels import cpu_has_avx2, cpu_has_avx512_bf16
from ridge.models.presets import PRESETS
from ridge.roofline import cli
from ridge.roofline.probe import ProbeSettings, local_hardware

CONTRACT_OP_KEYS = {"name", "m", "k", "n", "flops", "bytes", "intensity", "bound", "time_s"}
CONTRACT_DECODE_KEYS = {"batch", "context_len", "flops", "bytes", "time_s", "tokens_per_s", "bound", "ops"}


def run(argv, capsys):
    """Run through the same parser wiring ``ridge.cli`` uses; returns (exit code, stdout, stderr)."""
    code = ridge_main(["analyze", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_register_adds_analyze_with_a_func():
    parser = argparse.ArgumentParser(prog="ridge")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["analyze", "--model", "llama-3.1-8b"])
    assert callable(args.func)


def test_issue_example_prints_the_tables(capsys):
    code, out, _ = run(
        [
            "--model",
            "llama-3.1-8b",
            "--hardware",
            "h100-sxm",
            "--prompt-len",
            "2048",
            "--output-len",
            "256",
            "--batch",
            "1,8,64,256",
        ],
        capsys,
    )
    assert code == 0
    assert "Prefill: 1 x 2048 tokens" in out
    for batch in (1, 8, 64, 256):
        assert f"Decode step: batch {batch}, context 2176" in out
    for op in (
        "qkv_proj",
        "attn_scores",
        "attn_weighted_sum",
        "o_proj",
        "gate_up_proj",
        "down_proj",
        "input_norm",
        "lm_head",
    ):
        assert op in out
    assert "conventions" in out and "attention FLOPs: causal" in out and "decimal GB" in out
    assert "ridge point 295.3" in out
    assert "decode floor" in out and "largest batch" in out


def test_json_contract(capsys):
    code, out, _ = run(
        ["--model", "mixtral-8x7b", "--hardware", "h100-sxm", "--batch", "1,16", "--json", "--spec-k", "3"], capsys
    )
    assert code == 0
    doc = json.loads(out)
    assert {"params_total", "params_active", "weight_bytes", "kv_bytes_per_token"} <= set(doc["model"])
    assert {"peak_flops", "bandwidth_bytes_per_s", "ridge_point"} <= set(doc["hardware"])
    assert {"flops", "bytes", "time_s", "ops"} <= set(doc["prefill"])
    assert [d["batch"] for d in doc["decode"]] == [1, 16]
    for phase in [doc["prefill"], *doc["decode"]]:
        for op in phase["ops"]:
            assert CONTRACT_OP_KEYS <= set(op)
    for decode in doc["decode"]:
        assert CONTRACT_DECODE_KEYS <= set(decode)
        assert decode["time_s"] >= decode["flops"] / doc["hardware"]["peak_flops"]
    assert {"max_batch", "compute_bound_batch"} <= set(doc)
    assert doc["model"]["params_active"] < doc["model"]["params_total"]
    assert doc["conventions"]["attention"] == "causal"
    assert doc["summary"]["batches"][1]["experts_touched_per_layer"] == pytest.approx(8 * (1 - 0.75**16))
    assert len(doc["spec_verify"]) == 2 and doc["summary"]["batches"][0]["spec_speedup"] > 1


def test_plot_writes_a_png(tmp_path, capsys):
    target = tmp_path / "roofline.png"
    code, out, _ = run(
        ["--model", "qwen3-30b-a3b", "--hardware", "a100-80gb", "--batch", "1,32", "--plot", str(target), "--no-ops"],
        capsys,
    )
    assert code == 0 and "plot written" in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matmul_mode(capsys):
    code, out, _ = run(["--matmul", "100", "4096", "4096", "--dtype", "fp32", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0
    assert doc["flops"] == 2 * 100 * 4096 * 4096
    assert doc["intensity"] == pytest.approx(47.67, abs=0.01)
    assert doc["bound"] == "compute" and doc["compute_bound_m"] == 41  # fp32 ridge of an H100: 20
    code, out, _ = run(["--matmul", "1", "4096", "4096", "--dtype", "int4"], capsys)
    assert code == 0 and "no int4 peak" in out


def test_local_hardware_from_the_cache(tmp_path, monkeypatch, capsys):
    """--hardware local reads $RIDGE_CACHE_DIR (seeded here by a tiny probe) and prints the
    probe's date and spread."""
    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))
    local_hardware(
        cache_dir=tmp_path,
        settings=ProbeSettings(
            bandwidth_bytes=1 << 20,
            bandwidth_repeats=3,
            matmul_sizes=(32,),
            matmul_repeats=2,
            dtypes=("fp32", "bf16"),
            ridge_kernels=False,
        ),
    )
    code, out, _ = run(
        ["--model", "tiny", "--hardware", "local", "--batch", "1,4", "--prompt-len", "64", "--output-len", "8"], capsys
    )
    assert code == 0
    assert "local:" in out and "probe spread: bandwidth" in out and "measured 20" in out
    code, out, _ = run(["--model", "tiny", "--hardware", "local", "--json", "--prompt-len", "64"], capsys)
    assert json.loads(out)["hardware"]["name"] == "local"


@pytest.mark.skipif(
    not (cpu_has_avx512_bf16() or cpu_has_avx2()), reason="ridge's quantized kernels need AVX-512 BF16 + VNNI or AVX2"
)
def test_a_block_format_on_local_hardware_takes_its_kernels_ceiling(tmp_path, monkeypatch, capsys):
    """--weight-format q4_k on --hardware local: the compute ceiling is ridge's Q4_K kernel,
    measured in cache (int8 activations), stated beside the probe; a bf16 model keeps bf16's."""
    probed = local_hardware(  # a tiny probe (the extension stays where it is built: no RIDGE_CACHE_DIR)
        cache_dir=tmp_path,
        settings=ProbeSettings(
            bandwidth_bytes=1 << 20, bandwidth_repeats=3, matmul_sizes=(32,), matmul_repeats=2, dtypes=("bf16",)
        ),
    )
    monkeypatch.setattr(cli, "resolve_hardware", lambda spec, reprobe=False: probed)
    argv = ["--model", "tiny", "--hardware", "local", "--batch", "1,64", "--prompt-len", "64", "--output-len", "8"]
    code, out, _ = run([*argv, "--weight-format", "q4_k", "--json"], capsys)
    hardware = json.loads(out)["hardware"]
    assert code == 0 and hardware["compute_dtype"] == "int8"
    assert hardware["peak_flops"] == hardware["peak_flops_by_dtype"]["int8"] > 1e9  # the kernel's, in FLOP/s
    assert "int8 peak: ridge's q4_k kernel (64 rows, in cache)" in hardware["source"]
    code, out, _ = run([*argv, "--json"], capsys)
    assert json.loads(out)["hardware"]["compute_dtype"] == "bf16"


def test_a_gguf_file_is_priced_at_its_own_formats(tmp_path, capsys):
    """--model file.gguf without --weight-bits / --weight-format: each matrix in the format the
    file holds it in (stories' Q8_0 file keeps ffn_down, K = 172, in F32, which loads dense)."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType

    from ridge.models.gguf_file import GGUFModel
    from ridge.roofline.ops import WEIGHT_FORMATS
    from tests.conftest import STORIES
    from tests.models.gguf_files import quantized

    source = STORIES.parent / "stories260K-gguf" / "stories260K.gguf"
    if not source.is_file():
        pytest.skip(f"{source} is absent")
    path = quantized(source, tmp_path / "stories-Q8_0.gguf", GGMLQuantizationType.Q8_0)
    counts = GGUFModel(path).weights_by_format()
    expected = sum(WEIGHT_FORMATS[f][1] * n for f, n in counts.items()) / sum(counts.values())
    argv = ["--model", str(path), "--hardware", "h100-sxm", "--batch", "1", "--prompt-len", "16", "--json"]
    code, out, _ = run(argv, capsys)
    workload = json.loads(out)["workload"]
    assert code == 0 and 8.5 < expected < 16
    assert workload["weight_storage_bits"] == pytest.approx(expected)
    assert set(workload["weight_mix"]) == {"int8", "bf16"} and workload["weight_bits"] == 8
    code, out, _ = run([*argv[:-1], "--no-ops"], capsys)
    assert "the file's int8" in out.replace("\n", " ")
    code, out, _ = run([*argv, "--weight-bits", "16"], capsys)  # asked for: the file's formats give way
    assert json.loads(out)["workload"]["weight_storage_bits"] == 16 and json.loads(out)["workload"]["weight_mix"] == {}


def test_model_from_a_directory_and_workload_options(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-3.2-1b"]))
    code, out, _ = run(
        [
            "--model",
            str(tmp_path),
            "--hardware",
            "rtx-4090",
            "--weight-bits",
            "4",
            "--kv-bits",
            "8",
            "--tp",
            "2",
            "--attention",
            "full",
            "--embedding",
            "full",
            "--units",
            "GiB",
            "--unfused",
            "--context-len",
            "1000,4000",
            "--json",
        ],
        capsys,
    )
    doc = json.loads(out)
    assert code == 0
    assert doc["conventions"] == {
        **doc["conventions"],
        "attention": "full",
        "embedding": "full",
        "tensor_parallel": 2,
        "fused_projections": False,
        "units": "GiB",
    }
    assert [d["context_len"] for d in doc["decode"]] == [1000, 4000] * 4
    assert doc["model"]["kv_bytes_per_token"] == 16 * 2 * 8 * 64 * 1  # 8-bit KV


def test_custom_hardware_flags(capsys):
    code, out, _ = run(
        [
            "--model",
            "llama-2-7b",
            "--peak-tflops",
            "100",
            "--bandwidth-gbs",
            "1000",
            "--memory-gib",
            "16",
            "--json",
            "--batch",
            "1",
        ],
        capsys,
    )
    doc = json.loads(out)
    assert code == 0 and doc["hardware"]["name"] == "custom"
    assert doc["hardware"]["ridge_point"] == pytest.approx(100)
    # 16 GiB minus 13.5 GB of weights, in sequences of 2304 tokens x 512 KiB of KV
    assert doc["max_batch"] == int((16 * 2**30 - doc["model"]["weight_bytes"]) // (2304 * 524_288)) == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nope"], "neither a preset"),
        (["--hardware", "tpu-v9"], "not one of"),
        (["--tp", "3"], "does not divide"),
        (["--spec-acceptance", "1.5"], "spec-acceptance"),
        (["--plot", "out.svg"], ".png"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_small_models_warnings_and_a_model_that_does_not_fit(stories_dir, capsys):
    """stories260K read "0.00B params"; a prompt past the model's context passed silently; a
    model larger than memory read "largest batch 0"."""
    code, out, _ = run(["--model", str(stories_dir), "--hardware", "h100-sxm", "--prompt-len", "2048"], capsys)
    assert code == 0
    assert "260K params" in out and "0.00B" not in out
    assert "warning" in out and "exceeds the model's context (512 tokens)" in out
    code, out, _ = run(["--model", str(stories_dir), "--hardware", "h100-sxm", "--prompt-len", "64", "--json"], capsys)
    assert json.loads(out)["warnings"] == []
    code, out, _ = run(["--model", "llama-2-70b", "--hardware", "rtx-4090"], capsys)
    assert code == 0
    assert "largest batch 0" not in out and "does not fit: the weights alone" in out


def test_tp_with_a_link_prints_each_phases_collectives(capsys):
    import json

    code = ridge_main(
        ["analyze", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--tp", "2", "--link", "nvlink4", "--json"]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["link"]["name"].startswith("nvlink4")
    comm = data["decode"][0]["comm"]
    assert comm["collectives"] == 2 * 32 + 1 and comm["time_s"] > 0
    code = ridge_main(["analyze", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--tp", "2", "--link", "25:20"])
    assert code == 0 and "custom (25 GB/s, 20 us)" in capsys.readouterr().out


def test_a_bad_link_is_one_line(capsys):
    code = ridge_main(["analyze", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--tp", "2", "--link", "fast"])
    assert code == 2
    assert "--link must be local" in capsys.readouterr().err
