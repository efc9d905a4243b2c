"""The element types ridge reads, runs and prices: one row each, the way llama.cpp keeps one
``type_traits`` entry per type. Every name table elsewhere is derived from these rows:
``--dtype``'s names and aliases (``config.py``), the analyzer's dtypes and their bytes
(``roofline/ops.py``), the probe's torch dtypes (``roofline/probe.py``), the safetensors and
GGUF names of a checkpoint's dense tensors (``models/``).

(The block formats, Q8_0 to IQ4_XS, have their own table: ``quantization/formats.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    """One element type.

    name: ridge's name (``--dtype``, ``LLM(dtype=...)``, a config's ``torch_dtype``).
    short: the analyzer's name (``ridge analyze --dtype``, hardware peaks); None: not priced.
    bytes: storage per element.
    torch: the torch dtype; None for a type only the analyzer prices (tf32, fp4, int4).
    aliases: other names ``--dtype`` takes for it.
    runs: a dtype models run in (the choices of ``--dtype``).
    safetensors, gguf: the type's name in those files, where they hold it.
    gguf_file_type: GGUF's ``general.file_type`` of a file whose weights are all this type.
    """

    name: str
    short: str | None
    bytes: float
    torch: torch.dtype | None
    aliases: tuple[str, ...] = ()
    runs: bool = False
    safetensors: str | None = None
    gguf: str | None = None
    gguf_file_type: str | None = None


TABLE: tuple[DType, ...] = (
    DType("float32", "fp32", 4.0, torch.float32, ("fp32", "float"), True, "F32", "F32", "ALL_F32"),
    DType("tfloat32", "tf32", 4.0, None),
    DType("bfloat16", "bf16", 2.0, torch.bfloat16, ("bf16",), True, "BF16", "BF16", "MOSTLY_BF16"),
    DType("float16", "fp16", 2.0, torch.float16, ("fp16", "half"), True, "F16", "F16", "MOSTLY_F16"),
    DType("float8_e4m3fn", "fp8", 1.0, torch.float8_e4m3fn, safetensors="F8_E4M3"),
    DType("float8_e5m2", None, 1.0, torch.float8_e5m2, safetensors="F8_E5M2"),
    DType("int8", "int8", 1.0, torch.int8, safetensors="I8"),
    DType("fp4", "fp4", 0.5, None),
    DType("int4", "int4", 0.5, None),
    DType("float64", None, 8.0, torch.float64, safetensors="F64"),
    DType("int64", None, 8.0, torch.int64, safetensors="I64"),
    DType("int32", None, 4.0, torch.int32, safetensors="I32"),
    DType("int16", None, 2.0, torch.int16, safetensors="I16"),
    DType("uint8", None, 1.0, torch.uint8, safetensors="U8"),
    DType("bool", None, 1.0, torch.bool, safetensors="BOOL"),
)

# --dtype: ridge's names -> torch dtypes, and the aliases it takes
RUN_DTYPES: dict[str, torch.dtype] = {d.name: d.torch for d in TABLE if d.runs}
RUN_DTYPE_ALIASES: dict[str, str] = {alias: d.name for d in TABLE if d.runs for alias in d.aliases}
# the analyzer's names -> bytes per element, and -> torch dtypes (those torch has)
PRICED_BYTES: dict[str, float] = {d.short: d.bytes for d in TABLE if d.short}
PRICED_TORCH: dict[str, torch.dtype] = {d.short: d.torch for d in TABLE if d.short and d.torch is not None}
# a checkpoint's dense tensors: the file's type name -> torch dtype
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {d.safetensors: d.torch for d in TABLE if d.safetensors}
GGUF_DENSE_TYPES: dict[str, torch.dtype] = {d.gguf: d.torch for d in TABLE if d.gguf}
GGUF_FILE_TYPES: dict[torch.dtype, str] = {d.torch: d.gguf_file_type for d in TABLE if d.gguf_file_type}


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; a clear error for anything ridge does not run."""
    name = RUN_DTYPE_ALIASES.get(name, name)
    if name not in RUN_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(RUN_DTYPES)} (or 'auto')")
    return name
