"""The memory-mapped safetensors reader against the safetensors library itself."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from ridge.models.safetensors_mmap import SafetensorsFile


@pytest.fixture
def checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(5, 7, generator=gen).bfloat16(),
        "b.f32": torch.randn(3, generator=gen),
        "c.f16": torch.randn(2, 2, 2, generator=gen).half(),
        "d.i64": torch.arange(9),
        "e.scalar": torch.tensor(3.5),
        "f.empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def test_every_tensor_equals_what_safetensors_reads(checkpoint):
    want = load_file(checkpoint)
    f = SafetensorsFile(checkpoint)
    assert sorted(f.keys()) == sorted(want)
    for name, tensor in want.items():
        got = f.get_tensor(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name


def test_writing_a_view_never_reaches_the_file(checkpoint):
    before = checkpoint.read_bytes()
    SafetensorsFile(checkpoint).get_tensor("a.bf16").fill_(7)
    assert checkpoint.read_bytes() == before


@pytest.mark.parametrize(
    "make",
    [
        lambda: b"",
        lambda: b"\x00garbage" * 10,
        lambda: struct.pack("<Q", 4) + b"[1]\n",
        lambda: struct.pack("<Q", 2) + b"{}",  # no tensors: fine (checked below)
        lambda: (lambda h: struct.pack("<Q", len(h)) + h + b"\x00" * 8)(
            json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
        ),
        lambda: (lambda h: struct.pack("<Q", len(h)) + h)(
            json.dumps({"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}).encode()
        ),
    ],
)
def test_corrupt_files_are_value_errors_naming_the_file(tmp_path, make):
    path = tmp_path / "bad.safetensors"
    data = make()
    path.write_bytes(data)
    if data == struct.pack("<Q", 2) + b"{}":
        assert SafetensorsFile(path).keys() == []
        return
    with pytest.raises(ValueError, match="bad.safetensors"):
        SafetensorsFile(path)
