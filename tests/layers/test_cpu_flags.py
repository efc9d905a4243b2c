"""Which CPUs ridge compiles its extension for: the features its kernels execute."""

from __future__ import annotations

import pytest

from ridge.layers import cpu_kernels


@pytest.mark.parametrize(
    "flags,usable",
    [
        ({"avx512_bf16", "avx512_vnni", "gfni"}, True),  # Zen 4, Sapphire Rapids and later
        ({"avx512_bf16", "avx512_vnni"}, False),  # Cooper Lake: BF16 without GFNI
        ({"avx512_vnni", "gfni"}, False),  # Ice Lake: no BF16
        (set(), False),
    ],
)
def test_the_extension_needs_bf16_vnni_and_gfni(monkeypatch, flags, usable):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    assert cpu_kernels.cpu_has_avx512_bf16() is usable
