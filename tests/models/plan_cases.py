"""What the tests of the two CPU decode plans check alike (test_decode_plan.py: the AVX-512
plan, csrc/decode_layers.cpp; test_avx2_decode_plan.py: the AVX2 one, csrc/avx2_plan.cpp)."""

from __future__ import annotations

import pytest
import torch


def assert_refuses_bad_indices(plan, rotary, hidden: int, name: str) -> None:
    """A step whose slot, block id, context length or position lies outside what the plan
    holds is one clear error naming the plan (``name``), raised before any layer runs: h is
    untouched (the plan's kernels index without checks)."""
    h = torch.ones(1, hidden, dtype=torch.bfloat16)
    one, table = torch.ones(1, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
    far = torch.tensor([100000])
    cases = {  # the error, and the step's (slots, block tables, context lengths, positions)
        "slot 100000 is outside the pool": (far, table, one, one),
        "block id outside the pool": (one, table + 1000, one, one),
        "context length 100000 does not fit its table": (one, table, far, one),
        "position 100000 is outside the tables": (one, table, one, far),
    }
    for message, step in cases.items():
        with pytest.raises(RuntimeError, match=f"^{name}: {message}"):
            plan.run(h, *step, rotary.cos, rotary.sin)
    assert torch.equal(h, torch.ones_like(h))
