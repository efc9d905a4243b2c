"""benchmarks/decode_attention.py: jobs of several KV heads against one, alternated on the same
pools, the outputs checked equal, written per CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ridge.layers.cpu_kernels import cpu_has_avx512_bf16, load_extension

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_attention.py"


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
def test_each_bound_is_timed_on_the_same_pools_and_recorded(tmp_path):
    out = tmp_path / "decode_attention.json"
    cmd = [sys.executable, str(SCRIPT), "--layers", "1", "--rounds", "2", "--kinds", "bf16,int8"]
    cmd += ["--shapes", "2x100,1x600:8:2:32", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (record,) = json.loads(out.read_text()).values()
    own = load_extension().kv_grouped_default()  # 1 MiB, or never on Zen 4 (csrc/paged_rows.h)
    assert record["rounds"] == 2 and record["layers"] == 1 and record["default_bound_bytes"] == own
    for kind in ("bf16", "int8"):
        for shape in ("2x100", "1x600:8:2:32"):
            cell = record["results"][kind][shape]
            assert set(cell) == {"default", "never", "always"}
            assert cell["never"]["vs_never"] == 1.0 and all(c["gb_per_s"] > 0 for c in cell.values())
    old = record
    subprocess.run([*cmd[:-2], "--kinds", "bf16", "--json", str(out)], check=True, capture_output=True, timeout=300)
    (again,) = json.loads(out.read_text()).values()  # a rerun on this CPU replaces its entry
    assert set(again["results"]) == {"bf16"} and again["cpu"] == old["cpu"]
