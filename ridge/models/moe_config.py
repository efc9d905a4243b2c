"""What a mixture-of-experts feed-forward is, and how Mixtral's and Qwen's configs say it.

``MoEConfig`` is the shape ``models/moe.py`` runs (DeepSeek's reading of its own configs is
in ``deepseek_config.py``). The readers take a Hugging Face config dict and return the
``MoEConfig`` of its sparse layers, or raise ``ValueError`` naming what they cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# how a router picks its top_k experts (vLLM / DeepSeek names)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward: ``top_k`` of ``num_experts`` per token.

    norm_topk_prob: renormalize the top-k router probabilities to sum to 1 (Mixtral always).
    shared_intermediate_size: always-on shared expert(s) run for every token; 0 for none.
        Qwen2-MoE scales its one shared expert by a sigmoid gate (``shared_expert_gate``);
        DeepSeek adds its ``n_shared_experts`` (one MLP of their summed width) ungated.
    sparse_layers: the layers whose feed-forward is the MoE (the others are dense MLPs).
    scoring: ``softmax`` (Mixtral, Qwen, DeepSeek-V2) or ``sigmoid`` (DeepSeek-V3) router scores.
    topk_method: ``greedy`` top-k; ``group_limited_greedy`` (V2: experts in ``n_group``
        groups, only the ``topk_group`` groups with the best single score compete);
        ``noaux_tc`` (V3: scores plus ``e_score_correction_bias`` choose, groups ranked by
        their two best, weights are the uncorrected scores).
    routed_scaling_factor: multiplies the routed experts' weights (DeepSeek).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int
    sparse_layers: tuple[int, ...]
    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert
    shared_name: str = "shared_expert"  # the checkpoint's name (DeepSeek: shared_experts)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"model config: need 1 <= num_experts_per_tok ({self.top_k}) <= experts ({self.num_experts})"
            )
        if self.intermediate_size < 1:
            raise ValueError(f"model config: expert intermediate size must be >= 1, got {self.intermediate_size}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"model config: scoring_func must be softmax or sigmoid, got {self.scoring!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"model config: topk_method must be one of {', '.join(TOPK_METHODS)}, got {self.topk_method!r}"
            )
        if self.topk_method != "greedy":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"model config: n_group ({self.n_group}) must divide the {self.num_experts} experts")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"model config: need 1 <= topk_group ({self.topk_group}) <= n_group ({self.n_group})")
            per_group = self.num_experts // self.n_group
            if self.topk_group * per_group < self.top_k:
                raise ValueError(
                    f"model config: topk_group ({self.topk_group}) groups of {per_group} experts hold fewer "
                    f"than num_experts_per_tok ({self.top_k})"
                )
            if self.topk_method == "noaux_tc" and per_group < 2:
                raise ValueError("model config: noaux_tc ranks groups by their two best experts; need >= 2 per group")


# Routing features of other MoE families (DeepSeek's grouped top-k, sigmoid scores, scaled
# weights, ...): a Mixtral or Qwen config that sets one is refused, not misread.
# key -> the value that means "not used"
FOREIGN_ROUTING_KEYS: dict[str, Any] = {
    "n_group": None,
    "topk_group": None,
    "topk_method": None,
    "scoring_func": "softmax",
    "routed_scaling_factor": 1.0,
    "n_shared_experts": None,
    "first_k_dense_replace": None,
    "e_score_correction_bias": None,
}


def _refuse_foreign_routing(arch: str, hf: dict[str, Any], lenient: bool, notes: list[str]) -> None:
    unsupported = sorted(k for k, unused in FOREIGN_ROUTING_KEYS.items() if hf.get(k, unused) not in (unused, None))
    if unsupported and lenient:
        notes.append(f"MoE field(s) of other families ignored: {', '.join(unsupported)}")
    elif unsupported:
        raise ValueError(
            f"{arch} config sets MoE field(s) ridge does not support: "
            + ", ".join(f"{k}={hf[k]!r}" for k in unsupported)
            + " (ridge runs softmax top-k routing, renormalized or not, with an optional shared expert)"
        )


def read_mixtral_moe(arch: str, hf: dict[str, Any], layers: int, lenient: bool, notes: list[str]) -> MoEConfig:
    """Mixtral: every layer sparse, top-k renormalized, no shared expert."""
    _refuse_foreign_routing(arch, hf, lenient, notes)
    return MoEConfig(
        int(hf["num_local_experts"]),
        int(hf["num_experts_per_tok"]),
        int(hf["intermediate_size"]),
        True,
        0,
        tuple(range(layers)),
    )


def read_qwen_moe(arch: str, hf: dict[str, Any], layers: int, lenient: bool, notes: list[str]) -> MoEConfig:
    """Qwen2-MoE and Qwen3-MoE: sparse every ``decoder_sparse_step`` layers but the
    ``mlp_only_layers``; Qwen2-MoE adds a gated shared expert."""
    _refuse_foreign_routing(arch, hf, lenient, notes)
    # Qwen's published configs say num_experts; transformers 5 writes num_local_experts
    experts = int(hf["num_experts"] if hf.get("num_experts") is not None else hf["num_local_experts"])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in hf.get("mlp_only_layers") or []}
    sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(
        experts,
        int(hf["num_experts_per_tok"]),
        int(hf["moe_intermediate_size"]),
        bool(hf.get("norm_topk_prob", False)),
        shared,
        sparse,
        shared_expert_gate=shared > 0,
    )
