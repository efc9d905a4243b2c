"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): each token runs top_k of
num_experts gated MLPs, weighted by its router probabilities.

Grouped execution: the step's (token, expert) pairs are sorted by expert, and each expert
that some token picked runs once over its rows; an expert no token picked is never read.

    topk ids   (T, k)  ->  flat (T k,)  -> stable sort by expert -> runs of rows per expert
    expert e:  y_e = expert_e(x[rows_e]) * weight[rows_e]   ->  out.index_add_(rows_e, y_e)

Each expert is a packed gate/up projection and a down projection: linear layers like any
other, so quantization and ridge's kernels apply to them unchanged. The router runs in
float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.layers.linear import Linear, PackedLinear
from ridge.quantization.config import QuantizationConfig


class Expert(nn.Module):
    """A gated MLP; ``down_name`` is the checkpoint's name of its down projection (Mixtral: w2)."""

    def __init__(self, hidden: int, inter: int, quant: QuantizationConfig, prefix: str, down_name: str) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(
            hidden, [inter, inter], bias=False, method=quant.method_for(f"{prefix}.gate_up_proj", hidden)
        )
        self.down_name = down_name
        setattr(
            self, down_name, Linear(inter, hidden, bias=False, method=quant.method_for(f"{prefix}.{down_name}", inter))
        )

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return ops.matmul(ops.silu_mul(ops.matmul(x, self.gate_up_proj)), getattr(self, self.down_name))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        # the router (and the shared expert's gate): plain parameters, never quantized or repacked
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        down = "w2" if cfg.architecture == "MixtralForCausalLM" else "down_proj"
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, moe.intermediate_size, quant, f"{prefix}.experts.{e}", down)
            for e in range(moe.num_experts)
        )
        self.shared_expert = None
        if moe.shared_intermediate_size:
            self.shared_expert = Expert(
                cfg.hidden_size, moe.shared_intermediate_size, quant, f"{prefix}.shared_expert", "down_proj"
            )
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.experts_touched = 0  # experts run in the last forward (what the step read)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, k) expert ids and their weights (in x's dtype), as Hugging Face computes them."""
        logits = F.linear(x.float(), self.gate.weight.float())
        probs = logits.softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        ids, weights = self.route(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // self.top_k  # the token of each sorted (token, expert) pair
        weight_of = weights.flatten()[order]
        out = torch.zeros_like(x)
        start, touched = 0, 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = token_of[start : start + count]
                y = expert(x[rows], ops) * weight_of[start : start + count, None]
                out.index_add_(0, rows, y)
                touched += 1
            start += count
        self.experts_touched = touched
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out += gate * self.shared_expert(x, ops)
        return out
