"""Which CPUs ridge compiles its extension for: the features its kernels execute."""

from __future__ import annotations

import pytest

from ridge.layers import cpu_kernels


@pytest.mark.parametrize(
    "flags,usable",
    [
        ({"avx512_bf16", "avx512_vnni", "gfni", "avx512vbmi"}, True),  # Zen 4, Sapphire Rapids and later
        ({"avx512_bf16", "avx512_vnni"}, False),  # Cooper Lake: BF16 without GFNI or VBMI
        ({"avx512_bf16", "avx512_vnni", "gfni"}, False),  # no VBMI (the fp8 KV cache's byte permutes)
        ({"avx512_vnni", "gfni", "avx512vbmi"}, False),  # Ice Lake: no BF16
        (set(), False),
    ],
)
def test_the_extension_needs_bf16_vnni_gfni_and_vbmi(monkeypatch, flags, usable):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    assert cpu_kernels.cpu_has_avx512_bf16() is usable


@pytest.mark.parametrize(
    "flags,usable",
    [
        ({"avx2", "fma", "f16c"}, True),  # Haswell, Zen 1 and later
        ({"avx2", "fma"}, False),
        ({"avx", "f16c"}, False),
    ],
)
def test_the_avx2_kernels_need_avx2_fma_and_f16c(monkeypatch, flags, usable):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    assert cpu_kernels.cpu_has_avx2() is usable


@pytest.mark.parametrize(
    "flags,built",
    [
        ({"avx512_bf16", "avx512_vnni", "gfni", "avx512vbmi", "avx2", "fma", "f16c"}, ["ridge_cpu", "ridge_cpu_avx2"]),
        ({"avx2", "fma", "f16c"}, ["ridge_cpu_avx2"]),
        (set(), []),
    ],
)
def test_setup_compiles_the_extensions_this_cpu_runs(monkeypatch, capsys, flags, built):
    """``python -m ridge.layers.cpu_kernels`` (make setup): the AVX-512 kernels where the CPU
    has them, the AVX2 ones wherever AVX2 is (so their tests run on every x86 machine)."""
    compiled = []
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_kernels, "load_extension", lambda progress: compiled.append("ridge_cpu"))
    monkeypatch.setattr(cpu_kernels, "load_avx2_extension", lambda progress: compiled.append("ridge_cpu_avx2"))
    assert cpu_kernels.main([]) == 0
    assert compiled == built
    if not built:
        assert "neither AVX-512 BF16 nor AVX2" in capsys.readouterr().out
