"""The one table of element types, against the libraries that define the names it uses."""

from __future__ import annotations

import json
import struct

import gguf
import pytest
import safetensors.torch
import torch

from ridge.dtypes import GGUF_DENSE_TYPES, GGUF_FILE_TYPES, RUN_DTYPES, TABLE, canonical_dtype


@pytest.mark.parametrize("row", [d for d in TABLE if d.torch is not None], ids=lambda d: d.name)
def test_each_row_agrees_with_torch_and_safetensors(row):
    assert torch.empty((), dtype=row.torch).element_size() == row.bytes
    if row.safetensors is not None:  # the name safetensors writes for a tensor of this dtype
        blob = safetensors.torch.save({"t": torch.zeros(2, dtype=row.torch)})
        (length,) = struct.unpack("<Q", blob[:8])
        assert json.loads(blob[8 : 8 + length])["t"]["dtype"] == row.safetensors


def test_gguf_names_are_gguf_types():
    for name, dtype in GGUF_DENSE_TYPES.items():
        assert gguf.GGMLQuantizationType[name].name == name
        # gguf's own bytes per element of the type
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert size / block == torch.empty((), dtype=dtype).element_size()
    for file_type in GGUF_FILE_TYPES.values():
        assert gguf.LlamaFileType[file_type].name == file_type


def test_names_are_unique_and_aliases_resolve():
    for field in ("name", "short", "safetensors", "gguf"):
        names = [getattr(d, field) for d in TABLE if getattr(d, field) is not None]
        assert len(names) == len(set(names)), field
    for d in TABLE:
        for alias in d.aliases:
            assert canonical_dtype(alias) == d.name
    assert all(canonical_dtype(name) == name for name in RUN_DTYPES)
    with pytest.raises(ValueError, match="unsupported dtype 'int8'; choose one of float32, bfloat16, float16"):
        canonical_dtype("int8")
