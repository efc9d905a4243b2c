"""Shared fixtures: tiny Hugging Face models saved to disk, and the shared real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Hypothesis: derandomized in CI (the same examples every run: a flaky test would throw a whole
# submission away), its full random search locally. Registered here, before any test module
# builds its own settings objects, which inherit from the loaded profile.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

# ../shared beside the checkout; RIDGE_SHARED_DIR points elsewhere (a copy carried to a GPU box).
SHARED = Path(os.environ.get("RIDGE_SHARED_DIR") or Path(__file__).resolve().parents[1].parent / "shared")
STORIES = SHARED / "models" / "stories260K"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"the real model is absent: {STORIES} (it lives in ../shared beside the checkout)")
    return STORIES
