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

from ridge.models.presets import PRESETS, get_preset

# Families whose config layout ridge knows; any other model_type with Llama-style keys is read
# as a Llama-style decoder and says so in ``notes``.
KNOWN_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
)


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
class MLAShape:
    """DeepSeek multi-head latent attention ranks.

    The KV cache holds, per token and layer, the compressed latent (``kv_lora_rank``) and the
    shared rotary key (``qk_rope_head_dim``); ``q_lora_rank`` None means a direct q projection.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        _require_positive(
            "MLAShape",
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
        )
        if self.q_lora_rank is not None:
            _require_positive("MLAShape", q_lora_rank=self.q_lora_rank)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Elements cached per token per layer: latent + rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    mla: MLAShape | None = None
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
        """Read a Hugging Face ``config.json`` dict (HF key names; nested ``text_config`` ok).

        Raises ValueError naming the missing or inconsistent key.
        """
        if not isinstance(config, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(config).__name__}")
        if isinstance(config.get("text_config"), dict):
            merged = dict(config["text_config"])
            for key in ("architectures", "tie_word_embeddings"):
                merged.setdefault(key, config.get(key))
            config = merged
        model_type = str(config.get("model_type") or "")
        label = name or _name_from_config(config)
        notes: list[str] = []

        def need(key: str) -> Any:
            value = config.get(key)
            if value is None:
                raise ValueError(f"model config {label!r}: missing required key {key!r}")
            return value

        hidden = int(need("hidden_size"))
        layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        vocab = int(need("vocab_size"))
        if model_type not in KNOWN_MODEL_TYPES:
            notes.append(
                f"model_type {model_type or '(none)'!r} is not one ridge knows; read as a "
                "Llama-style decoder (gated MLP, RMSNorm, no biases)"
            )

        mla = None
        if config.get("kv_lora_rank"):
            mla = MLAShape(
                kv_lora_rank=int(config["kv_lora_rank"]),
                qk_nope_head_dim=int(need("qk_nope_head_dim")),
                qk_rope_head_dim=int(need("qk_rope_head_dim")),
                v_head_dim=int(need("v_head_dim")),
                q_lora_rank=int(config["q_lora_rank"]) if config.get("q_lora_rank") else None,
            )
            kv_heads = heads  # MLA has no KV heads of its own; the latent is shared by all heads.
            head_dim = mla.qk_head_dim
            if config.get("num_nextn_predict_layers"):
                notes.append(
                    f"{config['num_nextn_predict_layers']} multi-token-prediction layer(s) "
                    "not counted (not used by ordinary decoding)"
                )

        moe, dense_layers = _read_moe(config, model_type, layers, label)
        window = None
        if config.get("sliding_window") and config.get("use_sliding_window", True):
            window = int(config["sliding_window"])
            if window >= int(config.get("max_position_embeddings") or 0) > 0:
                window = None  # a window as long as the context changes nothing
            elif config.get("max_window_layers") not in (None, layers):
                notes.append("per-layer sliding windows are read as applying to every layer")
        if window is not None:
            notes.append(f"sliding-window attention: each query sees the last {window} tokens")
        quant = config.get("quantization_config")
        if isinstance(quant, dict):
            notes.append(
                f"checkpoint is quantized ({quant.get('quant_method', '?')}); pass --weight-bits "
                "to match it (the analysis uses the bits you give)"
            )

        attention_bias = bool(config.get("attention_bias", False))
        qwen2_family = model_type in ("qwen2", "qwen2_moe")
        return cls(
            name=label,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(config.get("intermediate_size") or 0),
            vocab_size=vocab,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes q/k/v biases; Llama's attention_bias covers q, k, v and o.
            qkv_bias=qwen2_family or (attention_bias and mla is None),
            o_bias=attention_bias and not qwen2_family and mla is None,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=window,
            max_context=int(config["max_position_embeddings"]) if config.get("max_position_embeddings") else None,
            moe=moe,
            num_dense_layers=dense_layers if moe is not None else None,
            mla=mla,
            notes=tuple(notes),
        )


def _name_from_config(config: dict[str, Any]) -> str:
    path = config.get("_name_or_path")
    if path:
        return str(path)
    archs = config.get("architectures") or []
    return str(archs[0]) if archs else str(config.get("model_type") or "model")


def _read_moe(config: dict[str, Any], model_type: str, layers: int, label: str) -> tuple[MoEShape | None, int]:
    """The MoE block and the number of dense-MLP layers, from any of HF's spellings."""
    experts = config.get("n_routed_experts") or config.get("num_local_experts") or config.get("num_experts")
    if not experts or int(experts) <= 1:
        return None, layers
    top_k = config.get("num_experts_per_tok")
    if not top_k:
        raise ValueError(f"model config {label!r}: MoE config without 'num_experts_per_tok'")
    # Mixtral's experts use intermediate_size; DeepSeek and Qwen use moe_intermediate_size.
    expert_ff = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
    shared = 0
    if config.get("n_shared_experts"):
        shared = int(config["n_shared_experts"]) * expert_ff
    elif config.get("shared_expert_intermediate_size"):
        shared = int(config["shared_expert_intermediate_size"])
    moe = MoEShape(
        num_experts=int(experts),
        experts_per_token=int(top_k),
        expert_intermediate_size=expert_ff,
        shared_intermediate_size=shared,
        shared_expert_gate=model_type == "qwen2_moe" and shared > 0,
        router_bias=config.get("topk_method") == "noaux_tc",
    )
    if "first_k_dense_replace" in config:  # DeepSeek
        first_dense = int(config.get("first_k_dense_replace") or 0)
        freq = int(config.get("moe_layer_freq") or 1)
        moe_layers = sum(1 for i in range(layers) if i >= first_dense and i % freq == 0)
    else:  # Qwen-MoE; Mixtral has neither key, so every layer is MoE
        step = int(config.get("decoder_sparse_step") or 1)
        dense_only = set(config.get("mlp_only_layers") or [])
        moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return moe, layers - moe_layers


def load_model_shape(spec: str) -> ModelShape:
    """A preset name, a path to a ``config.json``, a model directory holding one, or a GGUF file."""
    if spec in PRESETS:
        return ModelShape.from_preset(spec)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        from ridge.models.gguf_file import GGUFModel

        return ModelShape.from_hf_config(GGUFModel(path).hf_config, name=path.stem)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        name = path.parent.name if path.name == "config.json" else path.stem
        return ModelShape.from_hf_config(config, name=name)
    known = ", ".join(sorted(PRESETS))
    raise ValueError(f"--model {spec!r} is neither a preset ({known}) nor a config.json / model directory")


def ceil_div(numerator: int, denominator: int) -> int:
    """Integer ceiling division (a tensor-parallel shard of a width that does not divide)."""
    return -(-numerator // denominator)
