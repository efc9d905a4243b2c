"""The architecture table: the one place that names model classes."""

from __future__ import annotations

import pytest

from ridge.config import SUPPORTED_ARCHITECTURES
from ridge.models import registry


def test_every_architecture_resolves_to_a_class_with_the_interface():
    assert SUPPORTED_ARCHITECTURES == registry.SUPPORTED_ARCHITECTURES
    for arch in SUPPORTED_ARCHITECTURES:
        cls = registry.model_class(arch)
        assert isinstance(cls.packed_modules, dict)
        for method in ("materialize", "forward", "compute_logits", "set_kernels", "linear_layers", "kv_cache_spec"):
            assert callable(getattr(cls, method)), (arch, method)


def test_an_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture .GPT2LMHeadModel.*DeepseekV3ForCausalLM"):
        registry.model_class("GPT2LMHeadModel")
