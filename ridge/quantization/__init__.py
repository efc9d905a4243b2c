"""Quantized weights: llama.cpp's block formats (``formats``), the per-layer methods that
hold and apply them (``methods``), and the policy that assigns methods (``config``)."""

from ridge.quantization.config import QuantizationConfig
from ridge.quantization.formats import BLOCK, FORMATS, BlockFormat, get_format
from ridge.quantization.methods import (
    BlockQuantLinearMethod,
    LinearMethod,
    ShardedLinearMethod,
    UnquantizedLinearMethod,
)

__all__ = [
    "BLOCK",
    "FORMATS",
    "BlockFormat",
    "BlockQuantLinearMethod",
    "LinearMethod",
    "QuantizationConfig",
    "ShardedLinearMethod",
    "UnquantizedLinearMethod",
    "get_format",
]
