"""Which method each linear layer gets: ``--quantization`` (vLLM's flag) as a policy.

Every decoder linear layer is quantized; ``lm_head`` too unless it is tied to the embedding
(the embedding stays as loaded, so a tied head does too). A layer whose K is not a multiple
of the block size stays unquantized. ``decisions`` says what happened to each kind of layer,
for the start-up log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ridge.quantization.formats import BlockFormat, get_format
from ridge.quantization.methods import (
    BlockQuantLinearMethod,
    LinearMethod,
    ShardedLinearMethod,
    UnquantizedLinearMethod,
)

UNQUANTIZED = UnquantizedLinearMethod()


@dataclass
class QuantizationConfig:
    format: BlockFormat | None = None  # None: every layer unquantized
    # layer name -> the format its checkpoint tensors already have (a GGUF file's): kept as is;
    # a tuple, one per shard, for a packed layer whose shards' formats differ
    file_formats: dict[str, BlockFormat | tuple[BlockFormat, ...] | None] = field(default_factory=dict)
    # layer name (numbers folded: "layers.*.mlp.down_proj") -> what it got, and why if not quantized
    decisions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_name(cls, name: str | None) -> QuantizationConfig:
        return cls(None if name in (None, "", "none") else get_format(name))

    def method_for(self, name: str, in_features: int, tied: bool = False) -> LinearMethod:
        key = ".".join("*" if part.isdigit() else part for part in name.split("."))
        stored = self.file_formats.get(name)
        if isinstance(stored, tuple) and not tied:
            self.decisions[key] = f"{'+'.join(f.name for f in stored)} (per shard, from the file)"
            return ShardedLinearMethod(stored)
        if stored is not None and not tied:
            self.decisions[key] = f"{stored.name} ({stored.ggml_name}, {stored.bits_per_weight:g} bits, from the file)"
            return BlockQuantLinearMethod(stored)
        if self.format is None:
            return UNQUANTIZED
        if tied:
            self.decisions[key] = "unquantized (tied to the embedding, which stays as loaded)"
            return UNQUANTIZED
        if in_features % self.format.block:
            self.decisions[key] = f"unquantized (K = {in_features} is not a multiple of {self.format.block})"
            return UNQUANTIZED
        self.decisions[key] = f"{self.format.name} ({self.format.ggml_name}, {self.format.bits_per_weight:g} bits)"
        return BlockQuantLinearMethod(self.format)

    def summary(self) -> list[str]:
        """One line per kind of layer, for the start-up log."""
        return [f"{key}: {what}" for key, what in self.decisions.items()]
