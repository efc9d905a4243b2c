"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3): each token
runs top_k of num_experts gated MLPs, weighted by its router's scores.

Grouped execution: the step's (token, expert) pairs are sorted by expert, and each expert
that some token picked runs once over its rows; an expert no token picked is never read.

    topk ids   (T, k)  ->  flat (T k,)  -> stable sort by expert -> runs of rows per expert
    expert e:  y_e = expert_e(x[rows_e]) * weight[rows_e]   ->  out.index_add_(rows_e, y_e)

A layer's experts are stacked at load into one tensor per projection (``StackedExperts``:
``experts.gate_up_proj`` and ``experts.down_proj``, the loader mapping each checkpoint's
``experts.{e}.*`` onto expert e's rows as the model's ``expert_stacking`` table declares).
They are linear layers like any other, so quantization and ridge's kernels apply to them
unchanged; an expert's matmul reads only its own rows (``kernels.matmul(x, layer, rows)``). The router runs in
float32 (``Router``: softmax or sigmoid scores, greedy or group-limited top-k).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.distributed.parallel import TensorParallel
from ridge.layers.kernels import topk_route
from ridge.layers.linear import ExpertLinear, Linear, PackedLinear
from ridge.models.moe_config import MoEConfig
from ridge.quantization.config import QuantizationConfig


class SharedExpert(nn.Module):
    """An always-on gated MLP beside the routed experts (split like a dense MLP under tensor
    parallelism)."""

    def __init__(self, hidden: int, inter: int, quant: QuantizationConfig, prefix: str, tp: TensorParallel) -> None:
        super().__init__()
        part = tp.split(inter, "the shared expert's intermediate size")
        split = tp.enabled
        self.gate_up_proj = PackedLinear(
            hidden,
            [part.length, part.length],
            bias=False,
            method=quant.method_for(f"{prefix}.gate_up_proj", hidden),
            tp_rows=[part, part] if split else None,
            full=([inter, inter], hidden) if split else None,
        )
        self.down_proj = Linear(
            part.length,
            hidden,
            bias=False,
            method=quant.method_for(f"{prefix}.down_proj", part.length),
            tp_cols=part if split else None,
            full=([hidden], inter) if split else None,
        )

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return ops.matmul(ops.silu_mul(ops.matmul(x, self.gate_up_proj)), self.down_proj)


class StackedExperts(nn.Module):
    """A layer's ``num_experts`` gated MLPs as two stacked projections. Under tensor
    parallelism every expert is split along its intermediate dimension: a rank holds each
    expert's slice of gate/up rows and of down's columns."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, quant: QuantizationConfig, prefix: str, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        part = tp.split(inter, "the experts' intermediate size")
        split = tp.enabled
        self.gate_up_proj = ExpertLinear(
            num_experts,
            hidden,
            [part.length, part.length],
            method=quant.method_for(f"{prefix}.gate_up_proj", hidden),
            tp_rows=[part, part] if split else None,
            full=([inter, inter], hidden) if split else None,
        )
        self.down_proj = ExpertLinear(
            num_experts,
            part.length,
            [hidden],
            method=quant.method_for(f"{prefix}.down_proj", part.length),
            tp_cols=part if split else None,
            full=([hidden], inter) if split else None,
        )

    def forward(self, rows: torch.Tensor, counts: list[int], ops) -> torch.Tensor:
        """rows sorted by expert, counts[e] of them for expert e -> each row through its
        expert (one grouped matmul per projection; SiLU-gating once over all rows)."""
        gate_up = ops.grouped_matmul(rows, self.gate_up_proj, counts)
        return ops.grouped_matmul(ops.silu_mul(gate_up), self.down_proj, counts)

    def forward_expert(self, x: torch.Tensor, expert: int, ops) -> torch.Tensor:
        """Expert ``expert`` on rows x: only its rows of each projection are read."""
        gate_up = ops.matmul(x, self.gate_up_proj, self.gate_up_proj.expert_rows(expert))
        return ops.matmul(ops.silu_mul(gate_up), self.down_proj, self.down_proj.expert_rows(expert))


class Router(nn.Module):
    """Scores every expert for each token and picks ``top_k``, in float32, as Hugging Face does
    (``topk_route`` in ``layers/kernels.py``). greedy: the top_k scores. group_limited_greedy
    (DeepSeek-V2): experts sit in n_group groups; only the topk_group groups with the best
    single score compete. noaux_tc (DeepSeek-V3): the choice ranks scores +
    e_score_correction_bias, groups by the sum of their two best; the weights are the
    uncorrected scores.
    """

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden), requires_grad=False)
        if moe.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts), requires_grad=False)

    def keep_float32(self) -> None:
        """The router's tensors stay float32 in any model dtype: it scores in float32 anyway
        (a bf16 weight converts exactly, so this converts once instead of every step), and a
        bf16 correction bias would change choices."""
        self.weight = nn.Parameter(self.weight.detach().float(), requires_grad=False)
        if self.moe.topk_method == "noaux_tc":
            bias = self.e_score_correction_bias
            self.e_score_correction_bias = nn.Parameter(bias.detach().float(), requires_grad=False)

    def for_kernels(self, kernels) -> None:
        """The weight as ``kernels`` read it best: bf16 where they read a bf16 router
        (``reads_bf16_router``: the CPU kernels and their decode plans) and every value is
        exactly a bf16 (a bf16 checkpoint's router, or a GGUF file's F32 router converted from
        one): half the bytes a step reads, the same logits, since a bf16 widens to its float32
        exactly. Otherwise float32 (``keep_float32``)."""
        w = self.weight.detach()
        if not kernels.reads_bf16_router:
            self.keep_float32()
        elif w.dtype is torch.float32 and torch.equal(w, w.bfloat16().float()):
            self.weight = nn.Parameter(w.bfloat16(), requires_grad=False)

    def route_args(self) -> tuple:
        """What ``topk_route`` (and the router kernel) takes after x and the router's weight:
        top_k, softmax (else sigmoid), renormalize, the renormalization's eps (sigmoid scores
        can all be ~0, and V3 guards the division as transformers does), scaling, n_group,
        topk_group and noaux_tc's correction bias (groups of 1 and no bias: greedy)."""
        moe = self.moe
        grouped = moe.topk_method != "greedy"
        return (
            moe.top_k,
            moe.scoring == "softmax",
            moe.norm_topk_prob,
            1e-20 if moe.scoring == "sigmoid" else 0.0,
            moe.routed_scaling_factor,
            moe.n_group if grouped else 1,
            moe.topk_group if grouped else 1,
            self.e_score_correction_bias if moe.topk_method == "noaux_tc" else None,
        )

    def forward(self, x: torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, k) expert ids and their weights (in x's dtype): ``topk_route``, through
        ``ops.route_topk`` where ops are given (one kernel on CPU, which the decode plan calls too)."""
        route = ops.route_topk if ops is not None else topk_route
        return route(x, self.weight, *self.route_args())


class SparseMoE(nn.Module):
    """Under tensor parallelism the router and the shared expert's gate are replicated, the
    experts and shared experts split; the output is a partial sum (the layer all-reduces it)."""

    def __init__(
        self, cfg: ModelConfig, quant: QuantizationConfig, prefix: str, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        moe = cfg.moe
        self.top_k = moe.top_k
        # the router (and the shared expert's gate): plain parameters, never quantized or repacked
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = StackedExperts(
            moe.num_experts, cfg.hidden_size, moe.intermediate_size, quant, f"{prefix}.experts", tp
        )
        # always-on shared expert(s), under the checkpoint's name (Qwen2-MoE: shared_expert,
        # sigmoid-gated; DeepSeek: shared_experts, their widths summed into one MLP)
        self.shared_name = moe.shared_name if moe.shared_intermediate_size else None
        if self.shared_name:
            shared = SharedExpert(
                cfg.hidden_size, moe.shared_intermediate_size, quant, f"{prefix}.{moe.shared_name}", tp
            )
            setattr(self, self.shared_name, shared)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        self.experts_touched = 0  # experts run in the last forward (what the step read)

    @property
    def shared_mlp(self) -> SharedExpert | None:
        """The shared expert(s), whatever the checkpoint calls them."""
        return getattr(self, self.shared_name) if self.shared_name else None

    def route(self, x: torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, k) expert ids and their weights (in x's dtype), as Hugging Face computes them."""
        return self.gate(x, ops)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        ids, weights = self.route(x, ops)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts.num_experts).tolist()
        token_of = order // self.top_k  # the token of each sorted (token, expert) pair
        rows = x.index_select(0, token_of)  # (T k, d): each expert's tokens side by side
        self.experts_touched = sum(1 for c in counts if c)
        ys = self.experts.forward(rows, counts, ops) * weights.flatten()[order, None]
        # back to (token, k) order, then each token's k outputs summed (in float32, rounded
        # once): one gather for all experts, and a token's sum is the same whatever else is
        # in the batch
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        by_token = ys.index_select(0, unsort).view(x.shape[0], self.top_k, -1)
        out = by_token.sum(dim=1, dtype=torch.float32).to(x.dtype)
        shared = self.shared_mlp
        if shared is not None:
            y = shared(x, ops)
            if self.shared_expert_gate is not None:
                y = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * y
            out += y
        return out
