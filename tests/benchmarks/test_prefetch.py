"""benchmarks/prefetch.py: the kernels under each prefetch policy in turn, written per CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ridge.layers.cpu_kernels import cpu_has_avx512_bf16

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefetch.py"


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
def test_each_policy_is_timed_on_the_same_bytes_and_recorded(tmp_path):
    out = tmp_path / "prefetch.json"
    cmd = [sys.executable, str(SCRIPT), "--layers", "1", "--formats", "int4,bf16", "--rows", "1,8", "--rounds", "2"]
    cmd += ["--policies", "intel; amd,quant_near_rows=1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (record,) = json.loads(out.read_text()).values()
    assert record["rounds"] == 2 and record["layers"] == 1
    assert record["policies"]["amd,quant_near_rows=1"]["quant_near_rows"] == 1
    assert set(record["cpu_table"]) == set(record["policies"]["intel"])  # one table of the same keys
    for name in ("int4", "bf16"):
        entry = record["formats"][name]
        assert entry["bytes"] > 0 and set(entry["rows"]) == {"1", "8"}
        for cell in entry["rows"].values():
            assert set(cell) == {"intel", "amd,quant_near_rows=1"}
            assert cell["intel"]["vs_first"] == 1.0
            assert all(c["gb_per_s"] > 0 and c["vs_first"] > 0 for c in cell.values())


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
def test_whole_steps_of_a_file_under_each_policy_give_the_same_tokens(stories_dir, tmp_path):
    gguf_types = pytest.importorskip("gguf").GGMLQuantizationType
    from ..models.gguf_files import quantized

    source = stories_dir.parent / "stories260K-gguf" / "stories260K.gguf"
    if not source.is_file():
        pytest.skip(f"{source} is absent")
    path = quantized(source, tmp_path / "q8_0.gguf", gguf_types.Q8_0)
    out = tmp_path / "steps.json"
    cmd = [sys.executable, str(SCRIPT), "--steps", str(path), "--tokens", "8", "--rounds", "2"]
    cmd += ["--policies", "cpu;cpu,quant_far_scales=1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (record,) = json.loads(out.read_text()).values()
    assert record["rounds"] == 2 and record["tokens"] == 8 and record["num_scheduler_steps"] == 8
    assert record["policies"]["cpu,quant_far_scales=1"]["quant_far_scales"] == 1
    (cell,) = record["steps"].values()
    assert set(cell) == {"cpu", "cpu,quant_far_scales=1"} and cell["cpu"]["vs_first"] == 1.0
    assert all(c["ms_per_token"] > 0 and c["vs_first"] > 0 for c in cell.values())
