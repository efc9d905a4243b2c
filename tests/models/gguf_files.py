"""GGUF files made in tests with the ``gguf`` package: stories260K's F32 file rewritten with
its linear weights in another type (llama.cpp's own quantizer code), or with raw blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

LINEAR_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")


def is_linear(name: str) -> bool:
    return name.rsplit(".", 2)[-2] in LINEAR_TENSORS or name == "output.weight"


def rewrite(
    src: Path,
    dst: Path,
    tensor_fn: Callable[[str, np.ndarray], tuple[np.ndarray, GGMLQuantizationType] | None],
    arch: str | None = None,
    skip_keys: tuple[str, ...] = (),
    bools: dict[str, bool] | None = None,
    uints: dict[str, int] | None = None,
    rename: dict[str, str] | None = None,
) -> Path:
    """Copy ``src`` into ``dst``: metadata as is (less ``skip_keys`` and the keys of ``uints``,
    plus ``bools`` and ``uints``), each tensor through ``tensor_fn(name, values)``, which returns
    (bytes or values, type), None to keep the tensor as it is, or "drop"; ``rename`` replaces
    parts of tensor names."""
    reader = GGUFReader(src)
    writer = _writer_with_metadata(reader, dst, arch, (*skip_keys, *(uints or {})))
    for key, value in (bools or {}).items():
        writer.add_bool(key, value)
    for key, value in (uints or {}).items():
        writer.add_uint32(key, value)
    for t in reader.tensors:
        values = np.array(t.data)
        out = tensor_fn(t.name, values)
        name = t.name
        for old, new in (rename or {}).items():
            name = name.replace(old, new)
        if out is None:
            writer.add_tensor(name, values)
        elif out != "drop":
            data, qtype = out
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _writer_with_metadata(reader: GGUFReader, dst: Path, arch: str | None, skip_keys=()) -> GGUFWriter:
    """A writer of ``dst`` holding the reader's metadata (less ``skip_keys``)."""
    writer = GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in skip_keys:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    return writer


def one_tensor_per_expert(src: Path, dst: Path) -> Path:
    """``src`` with each stacked expert tensor (blk.N.ffn_gate_exps: E experts' matrices) written
    as E tensors of its own (blk.N.ffn_gate.E), as llama.cpp wrote Mixtral's files until early
    2024 (dense tensors only: the test files' F32)."""
    reader = GGUFReader(src)
    writer = _writer_with_metadata(reader, dst, None)
    for t in reader.tensors:
        values = np.array(t.data)
        stem, _, leaf = t.name.rpartition(".")
        if stem.endswith("_exps"):
            for e, matrix in enumerate(values):
                writer.add_tensor(f"{stem.removesuffix('_exps')}.{e}.{leaf}", np.ascontiguousarray(matrix))
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def quantize_any(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """llama.cpp's quantizer code where gguf has it; IQ4_NL (which it lacks): each block's
    scale from its largest magnitude, each weight the nearest table value (valid IQ4_NL blocks,
    not llama.cpp's scale search)."""
    if qtype != GGMLQuantizationType.IQ4_NL:
        return quantize(values, qtype)
    from ridge.quantization.formats import IQ4_NL_VALUES

    table = np.array(IQ4_NL_VALUES, dtype=np.float32)
    blocks = values.astype(np.float32).reshape(values.shape[0], -1, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / 127).astype(np.float16)
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d.astype(np.float32)))
    codes = np.abs(blocks[..., None] * inv[..., None] - table).argmin(-1).astype(np.uint8)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([d.view(np.uint8), nibbles], axis=-1).reshape(values.shape[0], -1)


def quantized(src: Path, dst: Path, qtype: GGMLQuantizationType) -> Path:
    """Every linear weight whose K allows it in ``qtype`` (stories' ffn_down, K = 172, stays F32)."""

    def fn(name, values):
        if is_linear(name) and values.shape[-1] % 32 == 0:
            return quantize_any(values, qtype), qtype
        return None

    return rewrite(src, dst, fn)


def llama_cpp_greedy(path: Path, prompt: list[int], steps: int) -> list[int]:
    """llama.cpp's greedy tokens for ``prompt`` (llama-cpp-python, through the comparisons'
    runner; callers skip where it is not installed)."""
    from ridge.bench.peers import LlamaCppRunner

    runner = LlamaCppRunner(path, threads=2, context_per_seq=64)
    try:
        return runner.run_batch([prompt], steps).tokens[0]
    finally:
        runner.close()


def q4_k_m_style_llama(directory: Path) -> Path:
    """A random 2-layer Llama (hidden 256) as a GGUF file laid out as a Q4_K_M file is: q, k,
    gate, up and o in Q4_K, v and down in Q6_K (random blocks), so its qkv holds two formats."""
    import torch
    import transformers

    from ridge.models.export import write_gguf
    from ridge.quantization.formats import FORMATS_BY_GGML_TYPE
    from ridge.quantization.random_blocks import random_blocks

    from .hf_tiny import COMMON

    T = GGMLQuantizationType
    config = transformers.LlamaConfig(
        **{**COMMON, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2}
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory / "hf")
    dense = write_gguf(directory / "hf", config.to_dict(), directory / "dense.gguf")

    def fn(name, values):
        kind = name.rsplit(".", 2)[-2]
        qtype = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K}.get(kind, T.Q4_K)
        if kind in LINEAR_TENSORS[:-1]:
            blocks = random_blocks(FORMATS_BY_GGML_TYPE[qtype], values.shape[0], values.shape[1], seed=len(name))
            return blocks.numpy(), qtype
        return None

    return rewrite(dense, directory / "mixed.gguf", fn)
