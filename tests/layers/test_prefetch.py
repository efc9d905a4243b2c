"""The streaming kernels' prefetch policy (csrc/prefetch.cpp, cpu_kernels.apply_prefetch): the CPU
vendor's (and, for AMD, family's) table by default, changed by ``$RIDGE_PREFETCH`` or between calls, never a result."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ridge.layers.cpu_kernels import (
    PrefetchEnvError,
    apply_prefetch,
    cpu_has_avx512_bf16,
    load_extension,
    loaded_prefetch_policy,
    prefetch_setting,
)
from ridge.layers.kernels import QUANT_KERNEL_CODES
from ridge.quantization.formats import FORMATS
from ridge.quantization.random_blocks import random_blocks

needs_kernels = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
KEYS = {
    "bf16_far",
    "quant_near_rows",
    "quant_near_every",
    "int8_near_rows",
    "quant_far_nta",
    "quant_far_lines",
    "quant_far_kib",
    "quant_interleave",
    "q3_k_set1_rows",
    "quant_shift_rows",
    "quant_far_scales",
    "quant_alternate",
}


@pytest.fixture
def ext():
    module = load_extension()
    before = module.prefetch_policy()
    yield module
    module.set_prefetch_policy(before)


def cpuinfo(field: str) -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.split(":")[0].strip() == field:
                return line.split(":")[1].strip()
    return ""


def cpu_vendor() -> str:
    return cpuinfo("vendor_id")


def cpu_family() -> int:
    return int(cpuinfo("cpu family") or 0)


def test_the_setting_is_a_table_and_overrides():
    assert prefetch_setting("amd") == ("amd", {})
    assert prefetch_setting(" intel , quant_near_rows=4,bf16_far=0 ") == (
        "intel",
        {"quant_near_rows": 4, "bf16_far": 0},
    )
    assert prefetch_setting("quant_near_every=0") == (None, {"quant_near_every": 0})
    with pytest.raises(PrefetchEnvError, match="RIDGE_PREFETCH: 'quant_near_rows=many' is not key=integer"):
        prefetch_setting("amd,quant_near_rows=many")
    with pytest.raises(PrefetchEnvError, match="RIDGE_PREFETCH: two tables, 'amd' and 'intel'"):
        prefetch_setting("amd,intel")


@needs_kernels
def test_the_default_is_the_cpu_vendors_table(ext):
    amd, zen5, intel = (ext.prefetch_preset(name) for name in ("amd", "zen5", "intel"))
    assert set(amd) == set(zen5) == set(intel) == KEYS and amd != intel
    want = intel
    if cpu_vendor() == "AuthenticAMD":
        want = zen5 if cpu_family() >= 26 else amd
    assert ext.prefetch_preset("cpu") == want
    if not os.environ.get("RIDGE_PREFETCH"):
        assert ext.prefetch_policy() == want
    assert loaded_prefetch_policy() == ext.prefetch_policy()  # what benchmarks record


@needs_kernels
def test_bad_policies_are_refused_and_change_nothing(ext):
    before = ext.prefetch_policy()
    for text, message in [
        ("arm", "unknown prefetch preset 'arm'"),
        ("amd,quant_near=4", "unknown prefetch key 'quant_near'"),
        ("bf16_far=2", "prefetch bf16_far must be 0 or 1, got 2"),
        ("quant_interleave=2", "prefetch quant_interleave must be 0 or 1, got 2"),
        ("quant_near_rows=-1", "prefetch quant_near_rows must be >= 0, got -1"),
        ("int8_near_rows=-2", "prefetch int8_near_rows must be >= 0, got -2"),
        ("quant_far_kib=2000000", "prefetch quant_far_kib must be at most 1048576, got 2000000"),
    ]:
        with pytest.raises(PrefetchEnvError, match=f"RIDGE_PREFETCH={text!r}: {message}"):
            apply_prefetch(ext, text)
        assert ext.prefetch_policy() == before
    assert apply_prefetch(ext, "amd,quant_near_rows=2") == ext.prefetch_preset("amd") | {"quant_near_rows": 2}


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k"])
def test_no_policy_changes_a_result(ext, name):
    n, k = 512, 2048  # 0.3-0.6 MB packed: past the far fetch's 64 KiB in each thread's run
    code = QUANT_KERNEL_CODES[name]
    packed = ext.pack_quant(random_blocks(FORMATS[name], n, k, seed=3), code, n, k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    wp = ext.pack_vnni(w)
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16() for m in (1, 2, 4, 8, 16)]
    outputs = {}
    for text in (
        "intel",
        "amd",
        "zen5",
        "intel,quant_near_rows=17,int8_near_rows=17",
        "amd,quant_near_rows=1,int8_near_rows=1",
        "intel,quant_near_every=0",
        "zen5,quant_far_nta=0",
        "intel,quant_far_nta=1",
        "zen5,quant_far_lines=0",
        "intel,quant_far_lines=1",
        "zen5,quant_far_kib=64",
        "zen5,quant_near_rows=1",
        "intel,quant_far_kib=0",
        "intel,q3_k_set1_rows=1",
        "zen5,q3_k_set1_rows=17",
        "intel,quant_shift_rows=4",
        "amd,quant_shift_rows=17",
        "zen5,quant_shift_rows=8,q3_k_set1_rows=4",
        "intel,quant_interleave=0",
        "zen5,quant_interleave=1",
        "amd,quant_interleave=1,quant_near_rows=1,int8_near_rows=1",
        "amd,quant_far_scales=1",
        "intel,quant_far_scales=1",
        "zen5,quant_far_scales=1,quant_near_rows=17,int8_near_rows=17",
        "amd,quant_alternate=1",
        "intel,quant_alternate=1",
    ):
        apply_prefetch(ext, text)
        quant = [ext.linear_quant(x, packed, code, n, None) for x in xs]
        outputs[text] = quant + [ext.linear_bf16(x, wp, n, None) for x in xs]
    first = next(iter(outputs.values()))
    for text, got in outputs.items():
        assert all(torch.equal(a, b) for a, b in zip(first, got)), text


@needs_kernels
@pytest.mark.parametrize(
    "setting,want",
    [
        (
            "amd,quant_near_rows=2",
            '{"bf16_far": 0, "int8_near_rows": 8, "q3_k_set1_rows": 17, "quant_alternate": 0, "quant_far_kib": 64, "quant_far_lines": 0, "quant_far_nta": 0, "quant_far_scales": 0, "quant_interleave": 0, "quant_near_every": 0, "quant_near_rows": 2, "quant_shift_rows": 4}',  # noqa: E501
        ),
        (
            "bf16_far",
            "PrefetchEnvError: RIDGE_PREFETCH='bf16_far': unknown prefetch preset 'bf16_far' (amd, zen5, intel, cpu)",
        ),  # noqa: E501
    ],
)
def test_the_environment_sets_the_policy_at_load_or_stops_it(setting, want):
    # a bad setting raises where the kernels are chosen: never a silent fall back to torch's ops
    code = (
        "import json, torch\n"
        "from ridge.layers.cpu_kernels import select_kernels\n"
        "try:\n"
        "    kernels = select_kernels('auto', torch.device('cpu'), torch.bfloat16)\n"
        "    print(json.dumps(kernels.ext.prefetch_policy(), sort_keys=True))\n"
        "except Exception as exc:\n"
        "    print(f'{type(exc).__name__}: {exc}')\n"
    )
    env = dict(os.environ, RIDGE_PREFETCH=setting)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == want
