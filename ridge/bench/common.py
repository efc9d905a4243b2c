"""Pieces shared by the engine benchmarks: summaries of samples (``ridge.stats``), random prompts, the machine line."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform

import torch

from ridge.layers.cpu_kernels import loaded_prefetch_policy
from ridge.stats import percentile


def summarize(values: list[float]) -> dict:
    """Median and spread (p10, p90, min, max) of a sample."""
    if not values:
        return {
            "median": float("nan"),
            "p10": float("nan"),
            "p90": float("nan"),
            "min": float("nan"),
            "max": float("nan"),
            "n": 0,
        }
    ordered = sorted(values)
    return {
        "median": percentile(ordered, 50),
        "p10": percentile(ordered, 10),
        "p90": percentile(ordered, 90),
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def random_prompts(count: int, lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts (ids 3.. to skip the usual specials), reproducible for a seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths[:count]]


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '8:512' -> (8, 512)."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"bad length range {text!r}: need 1 <= lo <= hi")
    return lo_i, hi_i


def machine() -> dict:
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_prefetch": loaded_prefetch_policy(),  # the CPU kernels' (None: not loaded)
    }


def dump_json(payload: dict) -> str:
    return json.dumps(payload, indent=2, default=float)
