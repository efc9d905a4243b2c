"""How DeepSeek-V2 and V3 configs describe their latent attention and their experts.

``MLAConfig`` is the shape ``layers/mla.py`` runs; ``read_deepseek_mla`` and
``read_deepseek_moe`` read a Hugging Face config dict, raising ``ValueError`` for what ridge
does not run (``models/deepseek.py`` is the model they describe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ridge.models.moe_config import MoEConfig


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention.

    Per token and layer the cache holds the compressed latent (``kv_lora_rank``) and the
    rotary key shared by all heads (``qk_rope_head_dim``); ``kv_b_proj`` expands the latent
    into each head's no-RoPE key (``qk_nope_head_dim``) and value (``v_head_dim``).
    ``q_lora_rank`` None: q comes from a direct projection. ``rope_interleave``: the rotary
    dims are stored as interleaved pairs (DeepSeek's layout; V2 always).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    rope_interleave: bool

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model config: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"model config: q_lora_rank must be >= 1 or null, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Cached values per token and layer: latent + rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def read_deepseek_mla(arch: str, hf: dict[str, Any]) -> MLAConfig:
    if hf.get("attention_bias"):
        raise ValueError(f"{arch} config sets attention_bias=true; ridge runs MLA without projection biases")
    return MLAConfig(
        int(hf["kv_lora_rank"]),
        int(hf["qk_nope_head_dim"]),
        int(hf["qk_rope_head_dim"]),
        int(hf["v_head_dim"]),
        int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
        # V2 rotates interleaved pairs (complex multiply); V3 says which with rope_interleave
        arch == "DeepseekV2ForCausalLM" or bool(hf.get("rope_interleave", True)),
    )


def read_deepseek_moe(arch: str, hf: dict[str, Any], layers: int, lenient: bool, notes: list[str]) -> MoEConfig | None:
    """The experts after the first ``first_k_dense_replace`` dense layers; None for a config
    without routed experts. V2 routes with softmax scores (greedy or group-limited), V3 with
    sigmoid scores and the bias-corrected grouped choice."""
    experts = int(hf.get("n_routed_experts") or 0)
    if experts == 0:
        return None
    if int(hf.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"{arch} config sets moe_layer_freq={hf['moe_layer_freq']!r}; ridge runs 1 (every layer)")
    v3 = arch == "DeepseekV3ForCausalLM"
    if v3:
        # transformers (and DeepSeek's release) run V3's router one way: sigmoid scores and the
        # bias-corrected grouped choice, whatever topk_method / scoring_func say
        scoring, method = "sigmoid", "noaux_tc"
        odd = {k: hf[k] for k in ("scoring_func", "topk_method") if hf.get(k) not in (None, "sigmoid", "noaux_tc")}
        if odd:
            raise ValueError(f"{arch} config sets {odd}; DeepSeek-V3 routes with sigmoid scores and noaux_tc")
    else:
        scoring, method = "softmax", str(hf.get("topk_method") or "greedy")
        if method == "noaux_tc":
            raise ValueError(f"{arch} config sets topk_method='noaux_tc' (DeepSeek-V3's router) on a V2 model")
        if hf.get("norm_topk_prob"):
            raise ValueError(f"{arch} config sets norm_topk_prob=true; DeepSeek-V2 does not renormalize its weights")
    inter = int(hf["moe_intermediate_size"])
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    return MoEConfig(
        experts,
        int(hf["num_experts_per_tok"]),
        inter,
        bool(hf.get("norm_topk_prob", False)) if v3 else False,
        int(hf.get("n_shared_experts") or 0) * inter,
        tuple(range(first_dense, layers)),
        scoring=scoring,
        topk_method=method,
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        shared_name="shared_experts",
    )
