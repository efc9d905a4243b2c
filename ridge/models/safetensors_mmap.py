"""Safetensors files as memory-mapped tensors: a checkpoint loads without copying.

A ``.safetensors`` file is a little-endian u64 header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw data:

    [ n (8 bytes) | header JSON (n bytes) | data ............................... ]
                                           ^ offsets in the header count from here

The file is mapped copy-on-write (``MAP_PRIVATE``): the tensors are views of the page cache,
read from disk on first touch, shared with every other process that maps the file, and never
written back. A parameter of the checkpoint's dtype becomes such a view (no copy at all);
ridge's CPU kernels read it once to repack it.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from ridge.dtypes import SAFETENSORS_DTYPES

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


class SafetensorsFile:
    """The tensors of one file, by name, as views of a private memory map.

    Raises ValueError (naming the file) for a file that is not valid safetensors.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except ValueError as exc:  # an empty file cannot be mapped
                raise ValueError(f"{self.path}: not a safetensors file ({exc})") from None
        size = len(self._map)
        if size < 8:
            raise ValueError(f"{self.path}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", self._map[:8])
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{self.path}: not a safetensors file (header length {header_len})")
        try:
            header = json.loads(self._map[8 : 8 + header_len])
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{self.path}: corrupt safetensors header ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries = {}
        for name, entry in header.items():
            self._entries[name] = self._check(name, entry, size - self._data_start)

    def _check(self, name: str, entry: object, data_size: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{self.path}: tensor {name!r} has a bad header entry ({exc!r})") from None
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=1) < 0 or not 0 <= begin <= end <= data_size or end - begin != numel * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name!r} ({entry}) does not fit the file")
        return dtype, shape, begin, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        """A view of the mapped file (copy-on-write: writing to it never reaches the file)."""
        dtype, shape, begin, end = self._entries[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(
            self._map, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=self._data_start + begin
        )
        return flat.view(shape)
