"""The shape of a decoder-only transformer, read from a Hugging Face ``config.json``.

``ModelShape`` holds only what FLOPs and bytes depend on: widths, head counts, layer counts,
MoE routing, MLA ranks, biases, sliding window. It is built from a config dict
(``ModelShape.from_hf_config``), a preset name (``ModelShape.from_preset``), or a path to a
``config.json`` or a model directory (``load_model_shape``). Parameter counts live in
``ops.parameter_inventory`` so that shapes, parameters and costs share one definition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ridge.config import ModelConfig
from ridge.models.deepseek_config import MLAConfig
from ridge.models.presets import PRESETS, get_preset


def _require_positive(owner: str, **values: int | None) -> None:
    for name, value in values.items():
        if value is None or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class MoEShape:
    """Routed mixture-of-experts MLP: each token goes to ``experts_per_token`` of ``num_experts``.

    ``shared_intermediate_size`` is the total width of always-on shared experts (0 if none);
    ``shared_expert_gate`` is Qwen2-MoE's sigmoid gate (a d -> 1 linear) on the shared expert;
    ``router_bias`` is DeepSeek-V3's per-expert score-correction bias.
    """

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_bias: bool = False

    def __post_init__(self) -> None:
        _require_positive(
            "MoEShape",
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
            expert_intermediate_size=self.expert_intermediate_size,
        )
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"MoEShape: experts_per_token ({self.experts_per_token}) exceeds num_experts ({self.num_experts})"
            )
        if self.shared_intermediate_size < 0:
            raise ValueError("MoEShape: shared_intermediate_size must be >= 0")

    def expected_experts_touched(self, tokens: float) -> float:
        """Expected distinct experts a layer reads for ``tokens`` tokens under uniform routing.

        Each token picks a uniformly random set of ``experts_per_token`` experts, so one expert is
        missed by a token with probability ``1 - k/E`` and by all of them with ``(1 - k/E)^T``.
        """
        if tokens <= 0:
            return 0.0
        miss = 1.0 - self.experts_per_token / self.num_experts
        return self.num_experts * (1.0 - miss**tokens)


@dataclass(frozen=True)
class ModelShape:
    """Everything the roofline needs about a decoder-only model; validates itself.

    Layers are ``num_dense_layers`` with a dense gated MLP (``intermediate_size``) followed by
    ``num_layers - num_dense_layers`` MoE layers (only when ``moe`` is set). Every MLP is gated
    (gate, up, down), as in all supported families.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    max_context: int | None = None  # max_position_embeddings: the longest sequence it was trained for
    moe: MoEShape | None = None
    num_dense_layers: int | None = None
    mla: MLAConfig | None = None  # the engine's own: latent ranks, qk_head_dim, cache_dim
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        _require_positive(
            f"ModelShape {self.name!r}",
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape {self.name!r}: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        dense = self.dense_layers
        if not 0 <= dense <= self.num_layers:
            raise ValueError(
                f"ModelShape {self.name!r}: num_dense_layers must be in [0, {self.num_layers}], got {dense}"
            )
        if dense > 0 and self.intermediate_size <= 0:
            raise ValueError(f"ModelShape {self.name!r}: dense layers need intermediate_size > 0")
        if self.moe is None and self.num_dense_layers not in (None, self.num_layers):
            raise ValueError(f"ModelShape {self.name!r}: num_dense_layers set without moe")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelShape {self.name!r}: sliding_window must be positive or None")
        if self.mla is not None and self.sliding_window is not None:
            raise ValueError(f"ModelShape {self.name!r}: MLA with a sliding window is not modelled")

    # ---- derived layout -------------------------------------------------------------------
    @property
    def dense_layers(self) -> int:
        if self.moe is None:
            return self.num_layers
        return 0 if self.num_dense_layers is None else self.num_dense_layers

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers

    @property
    def is_moe(self) -> bool:
        return self.moe is not None and self.moe_layers > 0

    @property
    def q_width(self) -> int:
        """Width of the concatenated query heads (MLA: nope + rope per head)."""
        per_head = self.mla.qk_head_dim if self.mla else self.head_dim
        return self.num_heads * per_head

    @property
    def kv_width(self) -> int:
        """Width of one of K or V over all KV heads (standard attention only)."""
        return self.num_kv_heads * self.head_dim

    @property
    def attn_out_width(self) -> int:
        """Input width of o_proj: all heads' value outputs."""
        per_head = self.mla.v_head_dim if self.mla else self.head_dim
        return self.num_heads * per_head

    def kv_cache_elements_per_token(self) -> int:
        """Cached elements per token over all layers: 2 * kv_heads * head_dim, or MLA's latent."""
        per_layer = self.mla.cache_dim if self.mla else 2 * self.kv_width
        return per_layer * self.num_layers

    def cached_tokens(self, context_len: int) -> int:
        """Tokens whose K/V a sequence of ``context_len`` keeps (a sliding window caps it)."""
        if self.sliding_window is None:
            return context_len
        return min(context_len, self.sliding_window)

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        """Shape of the built-in preset ``name`` (see ``ridge.models.presets``)."""
        return cls.from_hf_config(get_preset(name), name=name)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str | None = None) -> ModelShape:
        """Read a Hugging Face ``config.json`` dict (HF key names; nested ``text_config`` ok)
        through the engine's own parser (``ModelConfig.from_hf_config``, leniently), so the
        analyzer and the engine read every config the same way.

        Raises ValueError naming the missing or inconsistent key.
        """
        if not isinstance(config, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(config).__name__}")
        label = name or _name_from_config(config)
        try:
            parsed = ModelConfig.from_hf_config(config, lenient=True)
        except ValueError as exc:
            raise ValueError(f"model config {label!r}: {exc}") from None
        return cls.from_model_config(parsed, label)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, name: str) -> ModelShape:
        """The roofline's view of the engine's ``ModelConfig``: widths, counts, MoE, MLA."""
        moe, dense_layers = None, cfg.num_layers
        if cfg.moe is not None:
            m = cfg.moe
            moe = MoEShape(
                num_experts=m.num_experts,
                experts_per_token=m.top_k,
                expert_intermediate_size=m.intermediate_size,
                shared_intermediate_size=m.shared_intermediate_size,
                shared_expert_gate=m.shared_expert_gate,
                router_bias=m.topk_method == "noaux_tc",
            )
            dense_layers = cfg.num_layers - len(m.sparse_layers)
        return cls(
            name=name,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            tie_word_embeddings=cfg.tie_word_embeddings,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm=cfg.qk_norm,
            sliding_window=cfg.sliding_window,
            max_context=cfg.max_position_embeddings,
            moe=moe,
            num_dense_layers=dense_layers if moe is not None else None,
            mla=cfg.mla,
            notes=cfg.notes,
        )


def _name_from_config(config: dict[str, Any]) -> str:
    path = config.get("_name_or_path")
    if path:
        return str(path)
    archs = config.get("architectures") or []
    return str(archs[0]) if archs else str(config.get("model_type") or "model")


def load_model_shape(spec: str) -> ModelShape:
    """A preset name, a path to a ``config.json``, a model directory holding one, or a GGUF file."""
    return load_model(spec)[0]


def load_model(spec: str) -> tuple[ModelShape, dict[str, int] | None]:
    """``load_model_shape``'s shape, and for a GGUF file the weights of its matrices by the
    format ridge holds them in (``GGUFModel.weights_by_format``; None for a preset or a config,
    whose weights have no format of their own). The file is opened once."""
    if spec in PRESETS:
        return ModelShape.from_preset(spec), None
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        from ridge.models.gguf_file import GGUFModel

        gguf = GGUFModel(path)
        return ModelShape.from_hf_config(gguf.hf_config, name=path.stem), gguf.weights_by_format()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        name = path.parent.name if path.name == "config.json" else path.stem
        return ModelShape.from_hf_config(config, name=name), None
    known = ", ".join(sorted(PRESETS))
    raise ValueError(f"--model {spec!r} is neither a preset ({known}) nor a config.json / model directory")


def ceil_div(numerator: int, denominator: int) -> int:
    """Integer ceiling division (a tensor-parallel shard of a width that does not divide)."""
    return -(-numerator // denominator)
