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
    # layer name (numbers folded: "layers.*.mlp.down_proj") -> what its layers got, and why if
    # not quantized -> how many of them (a GGUF file can keep one kind in two formats)
    decisions: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def from_name(cls, name: str | None) -> QuantizationConfig:
        return cls(None if name in (None, "", "none") else get_format(name))

    def method_for(self, name: str, in_features: int, tied: bool = False) -> LinearMethod:
        key = ".".join("*" if part.isdigit() else part for part in name.split("."))
        stored = self.file_formats.get(name)
        if isinstance(stored, tuple) and not tied:
            self._decide(key, f"{'+'.join(f.name for f in stored)} (per shard, from the file)")
            return ShardedLinearMethod(stored)
        if stored is not None and not tied:
            self._decide(key, f"{stored.name} ({stored.ggml_name}, {stored.bits_per_weight:g} bits, from the file)")
            return BlockQuantLinearMethod(stored)
        if self.format is None:
            return UNQUANTIZED
        if tied:
            self._decide(key, "unquantized (tied to the embedding, which stays as loaded)")
            return UNQUANTIZED
        if in_features % self.format.block:
            self._decide(key, f"unquantized (K = {in_features} is not a multiple of {self.format.block})")
            return UNQUANTIZED
        self._decide(key, f"{self.format.name} ({self.format.ggml_name}, {self.format.bits_per_weight:g} bits)")
        return BlockQuantLinearMethod(self.format)

    def _decide(self, key: str, what: str) -> None:
        counts = self.decisions.setdefault(key, {})
        counts[what] = counts.get(what, 0) + 1

    def summary(self) -> list[str]:
        """One line per kind of layer, for the start-up log; where its layers got different
        methods (a Q4_K_M file's ffn_down: Q6_K in some layers, Q4_K in the others), each with
        how many layers got it."""
        lines = []
        for key, counts in self.decisions.items():
            if len(counts) == 1:
                lines.append(f"{key}: {next(iter(counts))}")
            else:
                said = (f"{what} in {n} layer{'s' if n > 1 else ''}" for what, n in counts.items())
                lines.append(f"{key}: " + "; ".join(said))
        return lines
