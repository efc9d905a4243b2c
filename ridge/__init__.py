"""ridge: a readable LLM inference engine that knows its roofline.

``from ridge import LLM, SamplingParams``; the heavy modules load on first use, so the
CLI's light commands (``ridge analyze``) start fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]

_EXPORTS = {
    "LLM": "ridge.engine.llm",
    "LLMEngine": "ridge.engine.engine",
    "EngineConfig": "ridge.config",
    "SamplingParams": "ridge.sampling",
    "RequestOutput": "ridge.engine.outputs",
    "CompletionOutput": "ridge.engine.outputs",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ridge' has no attribute {name!r}")
