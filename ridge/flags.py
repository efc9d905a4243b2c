"""Flags whose value is a JSON object (``--speculative-config``, ``--kv-transfer-config``):
JSON text from the command line, or a dict from Python."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: Any, flag: str) -> dict:
    """``value`` as a dict; ValueError naming ``flag`` when it is not a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e.msg} (at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value
