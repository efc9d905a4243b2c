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
# Without a GPU the Triton kernels (layers/triton_kernels.py) run in Triton's interpreter on CPU
# tensors. Triton reads this when it is first imported, which a test module's import of
# transformers can do, so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# ../shared beside the checkout; RIDGE_SHARED_DIR points elsewhere (a copy carried to a GPU box).
SHARED = Path(os.environ.get("RIDGE_SHARED_DIR") or Path(__file__).resolve().parents[1].parent / "shared")
STORIES = SHARED / "models" / "stories260K"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"the real model is absent: {STORIES} (it lives in ../shared beside the checkout)")
    return STORIES


# A chat template in the shape of Qwen2.5's (the hermes tool-call format): the tools in a system
# turn (short: stories260K's context is 512 tokens), an assistant's calls as <tool_call> blocks, tool results as
# <tool_response> blocks in a user turn. Written for the tests; stories260K has no template.
HERMES_TEMPLATE = """
{%- if tools %}
{{- '<|system|>\\nTools:\\n' }}
{%- for tool in tools %}
{%- set params = (tool.function.parameters or {}).get('properties') or {} %}
{{- tool.function.name + '(' + params | list | join(', ') + ')\\n' }}
{%- endfor %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{{- '<|user|>\\n<tool_response>\\n' + message.content + '\\n</tool_response>\\n' }}
{%- else %}
{{- '<|' + message.role + '|>\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}
"""


@pytest.fixture(scope="session")
def stories_tools_dir(stories_dir, tmp_path_factory) -> Path:
    """stories260K with ``HERMES_TEMPLATE`` as its chat template (the weights are links)."""
    import json

    out = tmp_path_factory.mktemp("stories-tools")
    for f in stories_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((stories_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    return out
