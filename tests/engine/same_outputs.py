"""Comparing an engine's outputs with another run's: floats within a tolerance, all else equal."""

from __future__ import annotations


def same(got, want, tol: float = 1e-5) -> bool:
    """``got`` equals ``want`` item by item (lists and tuples recursively), floats within ``tol``:
    logprobs from a float32 step whose batch differs from the other run's may differ in the
    matmul's last bits."""
    if isinstance(got, float) and isinstance(want, float):
        return abs(got - want) < tol
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(g, w, tol) for g, w in zip(got, want))
    return got == want
