"""The Llama family (Llama 2/3, TinyLlama, Mistral, Qwen2, Qwen3; and with a mixture-of-experts
feed-forward, ``models/moe.py``: Mixtral, Qwen2-MoE, Qwen3-MoE) as one module.

The differences are flags on ``ModelConfig``: q/k/v bias (Qwen2), q/k RMSNorm (Qwen3),
tied embeddings, GQA, RoPE scaling. Parameter names follow Hugging Face checkpoints except
for the packed projections, declared below as data for the loader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.distributed.parallel import Shard, TensorParallel
from ridge.kv.cache import KVCacheSpec, PagedKV
from ridge.layers.attention import AttentionMetadata, paged_attention
from ridge.layers.kernels import TorchKernels
from ridge.layers.linear import Linear, PackedLinear
from ridge.layers.norm import RMSNorm
from ridge.layers.rotary import RotaryEmbedding
from ridge.models.moe import Router, SparseMoE
from ridge.quantization.config import QuantizationConfig

# checkpoint module name -> (packed module name, shard index)
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# checkpoint expert projection (experts.{e}.<name>) -> (stacked layer under experts, shard
# within the expert, shards per expert): expert e's gate is shard 2e of experts.gate_up_proj
EXPERT_STACKING: dict[str, tuple[str, int, int]] = {
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
    "down_proj": ("down_proj", 0, 1),
}
# Mixtral names them w1 (gate), w3 (up) and w2 (down)
MIXTRAL_EXPERT_STACKING = {"w1": ("gate_up_proj", 0, 2), "w3": ("gate_up_proj", 1, 2), "w2": ("down_proj", 0, 1)}


@dataclass
class StepInputs:
    """What every layer of one forward pass shares: the kernels and the RoPE inputs."""

    kernels: TorchKernels
    rope: object


def rows_of(shard: Shard, width: int) -> Shard:
    """The rows of ``shard``'s heads (or experts, ...) when each is ``width`` rows."""
    return Shard(shard.start * width, shard.length * width)


class LlamaAttention(nn.Module):
    """Under tensor parallelism a rank holds its heads (``distributed/parallel.py``): q/k/v
    column-parallel, o row-parallel; the decoder layer all-reduces the output."""

    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig, prefix: str, tp: TensorParallel) -> None:
        super().__init__()
        heads, kv_heads = tp.split(cfg.num_heads, "the attention heads"), tp.kv_heads(cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.length, kv_heads.length, cfg.head_dim
        q_rows, kv_rows = rows_of(heads, cfg.head_dim), rows_of(kv_heads, cfg.head_dim)
        self.qkv_proj = PackedLinear(
            cfg.hidden_size,
            [q_rows.length, kv_rows.length, kv_rows.length],
            bias=cfg.qkv_bias,
            method=quant.method_for(f"{prefix}.qkv_proj", cfg.hidden_size),
            tp_rows=[q_rows, kv_rows, kv_rows] if tp.enabled else None,
            full=([cfg.q_size, cfg.kv_size, cfg.kv_size], cfg.hidden_size) if tp.enabled else None,
        )
        self.o_proj = Linear(
            q_rows.length,
            cfg.hidden_size,
            bias=cfg.o_bias,  # row-parallel: only rank 0 keeps its values (the loader zeroes the others')
            method=quant.method_for(f"{prefix}.o_proj", q_rows.length),
            tp_cols=q_rows if tp.enabled else None,
            full=([cfg.hidden_size], cfg.q_size) if tp.enabled else None,
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def add_to_plan(self, plan, norm, post_norm, cache: PagedKV, ops) -> bool:
        """This layer into the kernels' decode plan (``csrc/decode_layers.cpp``), with its layer's
        norms: False where forward() takes a path the plan does not hold."""
        k = cache.k
        if not (k.is_contiguous() and cache.v.is_contiguous()) or self.head_dim % 16:
            return False
        if not ops.plan_takes_cache(cache, self.head_dim):
            return False
        qkv, o = ops.plan_linear(self.qkv_proj), ops.plan_linear(self.o_proj)
        if qkv is None or o is None:
            return False
        q_norm = self.q_norm if self.qk_norm else None
        k_norm = self.k_norm if self.qk_norm else None
        if q_norm is not None and q_norm.eps != k_norm.eps:
            return False
        plan.add_layer(
            norm.weight,
            post_norm.weight,
            norm.eps,
            *qkv,
            *o,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,  # decode_attention's default scale, which forward() uses
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            0.0 if q_norm is None else q_norm.eps,
            k,
            cache.v,
            cache.k_scale,
            cache.v_scale,
            cache.kind == "fp8",
        )
        return True

    def forward(self, x, kv_cache: PagedKV, meta: AttentionMetadata, step: StepInputs):
        ops = step.kernels
        tokens = x.shape[0]
        qkv = ops.matmul(x, self.qkv_proj)
        q_size, kv_size = self.qkv_proj.output_sizes[:2]
        v = qkv[:, q_size + kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = ops.rms_norm(
                qkv[:, :q_size].view(tokens, self.num_heads, self.head_dim), self.q_norm.weight, self.q_norm.eps
            )
            k = ops.rms_norm(
                qkv[:, q_size : q_size + kv_size].view(tokens, self.num_kv_heads, self.head_dim),
                self.k_norm.weight,
                self.k_norm.eps,
            )
            q, k = ops.rope(q, step.rope), ops.rope(k, step.rope)
            written = False
        else:
            # q and k heads side by side: one rotation for both (and, where the kernels fuse it,
            # the KV write in the same launch)
            written = ops.rope_write_kv(qkv, self.num_heads, self.num_kv_heads, kv_cache, meta, step.rope)
            qk = qkv[:, : q_size + kv_size].view(tokens, -1, self.head_dim)
            if not written:
                qk = ops.rope(qk, step.rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, kv_cache, meta, ops, kv_written=written)
        return ops.matmul(out.flatten(1), self.o_proj)


class LlamaMLP(nn.Module):
    """Under tensor parallelism: gate/up column-parallel, down row-parallel (a partial sum)."""

    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig, prefix: str, tp: TensorParallel) -> None:
        super().__init__()
        inter = tp.split(cfg.intermediate_size, "the MLP's intermediate size")
        self.gate_up_proj = PackedLinear(
            cfg.hidden_size,
            [inter.length, inter.length],
            bias=cfg.mlp_bias,
            method=quant.method_for(f"{prefix}.gate_up_proj", cfg.hidden_size),
            tp_rows=[inter, inter] if tp.enabled else None,
            full=([cfg.intermediate_size] * 2, cfg.hidden_size) if tp.enabled else None,
        )
        self.down_proj = Linear(
            inter.length,
            cfg.hidden_size,
            bias=cfg.mlp_bias,
            method=quant.method_for(f"{prefix}.down_proj", inter.length),
            tp_cols=inter if tp.enabled else None,
            full=([cfg.hidden_size], cfg.intermediate_size) if tp.enabled else None,
        )

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return ops.matmul(ops.silu_mul(ops.matmul(x, self.gate_up_proj)), self.down_proj)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then a feed-forward; ``attention_cls`` is the model's attention
    (``LlamaAttention``, or DeepSeek's latent attention)."""

    def __init__(
        self, cfg: ModelConfig, quant: QuantizationConfig, prefix: str, attention_cls: type, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, quant, f"{prefix}.self_attn", tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the feed-forward under the checkpoint's name: a dense MLP, or the MoE of a sparse layer
        self.ffn_name = cfg.ffn_name
        layer = int(prefix.rsplit(".", 1)[1])
        if cfg.moe is not None and layer in cfg.moe.sparse_layers:
            ffn = SparseMoE(cfg, quant, f"{prefix}.{cfg.ffn_name}", tp)
        else:
            ffn = LlamaMLP(cfg, quant, f"{prefix}.{cfg.ffn_name}", tp)
        setattr(self, cfg.ffn_name, ffn)

    def forward(self, h, kv_cache, meta, step: StepInputs, pending: torch.Tensor | None = None) -> torch.Tensor:
        """h: the residual stream (T, hidden), updated in place. ``pending``: the previous
        layer's feed-forward output, added to h here with this layer's input norm (one op,
        ``add_rms_norm``); returns this layer's, for the next layer or the caller to add. Under
        tensor parallelism the attention's and the feed-forward's outputs are partial sums: each
        is all-reduced here."""
        ops, tp = step.kernels, self.tp
        norm, post_norm = self.input_layernorm, self.post_attention_layernorm
        if pending is None:
            x = ops.rms_norm(h, norm.weight, norm.eps)
        else:
            x = ops.add_rms_norm(pending, h, norm.weight, norm.eps)
        attn = self.self_attn.forward(x, kv_cache, meta, step)
        x = ops.add_rms_norm(tp.all_reduce(attn), h, post_norm.weight, post_norm.eps)
        return tp.all_reduce(getattr(self, self.ffn_name).forward(x, ops))


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_positions: int, quant: QuantizationConfig, attention_cls: type, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated (parallel.py says why)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, quant, f"model.layers.{i}", attention_cls, tp) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(): hidden states of the step's flat tokens; compute_logits(): only where we sample."""

    packed_modules = PACKED_MODULES
    expert_stacking = EXPERT_STACKING
    attention_cls = LlamaAttention
    file_copies: tuple[str, ...] = ()  # layers that are no Hugging Face checkpoint tensor (DeepSeek's)

    @classmethod
    def stacking_for(cls, cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
        """The checkpoint's expert projections -> the stacked layers they load into (Mixtral
        names its experts' w1, w3 and w2); what the loader reads a GGUF file's formats by too."""
        return MIXTRAL_EXPERT_STACKING if cfg.architecture == "MixtralForCausalLM" else cls.expert_stacking

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        quant: QuantizationConfig | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        quant = quant or QuantizationConfig()
        tp = tp or TensorParallel()
        self.tp = tp
        self.config = cfg
        self.quant_config = quant
        self.max_positions = max_positions
        self._moe_layers: list | None = None  # found on first use (experts_touched)
        self.expert_stacking = self.stacking_for(cfg)
        self.model = LlamaModel(cfg, max_positions, quant, self.attention_cls, tp)
        tied = cfg.tie_word_embeddings
        self.vocab_rows = tp.vocab(cfg.vocab_size)  # lm_head: this rank's share of the vocabulary
        self.lm_head = Linear(
            cfg.hidden_size,
            self.vocab_rows.length,
            bias=False,
            method=quant.method_for("lm_head", cfg.hidden_size, tied),
            tp_rows=[self.vocab_rows] if tp.enabled else None,
            full=([cfg.vocab_size], cfg.hidden_size) if tp.enabled else None,
        )
        if tied:
            self.tie_lm_head()
        self.kernels = TorchKernels()
        # --enforce-eager: every step op by op from Python, never through a decode plan
        self.eager = False
        self._plan_key: tuple | None = None  # the KV caches the plan below was built for
        self._plan: DecodePlanRun | None = None

    def materialize(self, device: torch.device) -> None:
        """After ``to_empty``: the RoPE tables again, and the tie (``to_empty`` makes new
        tensors, which unties them)."""
        cfg = self.config
        self.model.rotary.__init__(cfg.rotary_dim, self.max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.model.rotary.to(device)
        if cfg.tie_word_embeddings:
            self.tie_lm_head()
        for module in self.modules():
            if isinstance(module, Router):
                module.keep_float32()

    def tie_lm_head(self, split: bool = False) -> None:
        """lm_head computes with the embedding's Parameter itself (never freed by repacking).
        ``split`` (tensor parallelism, once the embedding is loaded): with a view of the rows
        of this rank's vocabulary share."""
        weight = self.model.embed_tokens.weight
        if split and self.tp.enabled:
            weight = nn.Parameter(self.vocab_rows.of(weight.data, 0), requires_grad=False)
        self.lm_head.weight = weight
        self.lm_head.weight_is_shared = True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[PagedKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # a fresh tensor: the residual stream, updated in place
        if meta.num_decode_tokens == h.shape[0] and not meta.prefills:
            plan = self.decode_plan(kv_caches, h.dtype)
            if plan is not None and plan.run(h, positions, meta, self.model.rotary, self.kernels):
                return h
        step = StepInputs(self.kernels, self.kernels.rope_state(self.model.rotary, positions, h.dtype))
        # forward() and ops.matmul directly, not nn.Module.__call__: ~2 us each, ~10 per layer
        # per step, and ridge registers no hooks.
        pending = None  # a layer's feed-forward output, added with the next layer's input norm
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            pending = layer.forward(h, kv_cache, meta, step, pending)
        if pending is not None:
            h.add_(pending)
        return h

    def decode_greedy(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[PagedKV],
        meta: AttentionMetadata,
        steps: int,
    ) -> torch.Tensor | None:
        """``steps`` greedy decode passes over a batch of decode rows in one call of the
        kernels' plan: each pass what ``forward``, ``compute_logits`` and the sampler's argmax
        compute, the next pass on the tokens it picked, one position on (``positions``, the
        slots and context lengths advance in place; the block tables hold every pass's
        position). (T, steps) token ids, or None where the plan does not take the step or the
        head (then nothing ran)."""
        if self.tp.enabled or meta.prefills or meta.num_decode_tokens != input_ids.shape[0]:
            return None
        plan = self.decode_plan(kv_caches, self.model.embed_tokens.weight.dtype)
        if plan is None or not plan.has_head:
            return None
        h = self.model.embed_tokens(input_ids)
        return plan.run_greedy(h, positions, meta, self.model.rotary, self.kernels, steps)

    def decode_plan(self, kv_caches: list[PagedKV], dtype: torch.dtype) -> DecodePlanRun | None:
        """The kernels' plan for a decode step over these caches (built on first use), or
        None: this model runs op by op (eager, or a part the plan does not cover)."""
        key = (id(kv_caches), len(kv_caches), kv_caches[0].k.data_ptr() if kv_caches else 0, dtype, self.eager)
        if key != self._plan_key:
            self._plan_key = key
            self._plan = None if self.eager else DecodePlanRun.build(self, kv_caches, dtype)
        return self._plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (R, hidden_size) rows that sample -> (R, vocab) logits (under tensor
        parallelism: gathered on rank 0, None on the others)."""
        norm = self.model.norm
        logits = self.kernels.matmul(self.kernels.rms_norm(hidden, norm.weight, norm.eps), self.lm_head)
        return self.tp.gather_vocab(logits, self.config.vocab_size)

    def kv_cache_spec(self) -> KVCacheSpec:
        """What each token keeps per layer: K and V for every KV head (this rank's)."""
        cfg = self.config
        return KVCacheSpec(cfg.num_layers, self.tp.kv_heads(cfg.num_kv_heads).length, cfg.head_dim)

    def experts_touched(self) -> float | None:
        """Distinct experts the last forward read per MoE layer (mean); None for a dense model."""
        if self._moe_layers is None:
            self._moe_layers = [m for m in self.modules() if isinstance(m, SparseMoE)]
        moes = self._moe_layers
        return sum(m.experts_touched for m in moes) / len(moes) if moes else None

    def linear_layers(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def decode_read_layers(self) -> list[Linear]:
        """The linear layers a decode step reads: all of them, less those a module names as
        prefill's only (``prefill_only()``: a deepseek2 file's kv_b_proj, whose rows the
        file's per-head copies hold for decode). Each parameter is then counted once."""
        skip = {id(m) for module in self.modules() if hasattr(module, "prefill_only") for m in module.prefill_only()}
        return [m for m in self.linear_layers() if id(m) not in skip]

    def linear_weight_bytes(self) -> int:
        """Bytes of the linear layers' weights, as held now, that a decode step reads once."""
        return sum(m.weight_nbytes() for m in self.decode_read_layers())

    def linear_weight_params(self) -> int:
        """The parameters behind ``linear_weight_bytes``."""
        return sum(m.in_features * m.out_features for m in self.decode_read_layers())

    def router_bytes_per_param(self) -> float | None:
        """Bytes per weight of the MoE routers as held now (float32, or bf16 where the kernels
        read one: ``Router.for_kernels``); None for a model without routers."""
        routers = [m.weight for m in self.modules() if isinstance(m, Router)]
        if not routers:
            return None
        return sum(w.nbytes for w in routers) / sum(w.numel() for w in routers)

    def set_kernels(self, kernels) -> None:
        """Run on ``kernels`` (``layers/kernels.py``): its matmul for every linear layer, its ops
        elsewhere. Each layer's method repacks its loaded weight for them."""
        self.kernels = kernels
        self._plan_key = self._plan = None  # a plan holds the previous kernels' packed weights
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weights_after_loading(module, kernels)
            elif isinstance(module, Router):
                module.for_kernels(kernels)


@dataclass
class DecodePlanRun:
    """A decode step's decoder layers in one call of the kernels' ``DecodePlan``
    (``csrc/decode_layers.cpp``): the kernels the Python forward calls, in its order and on its
    views, so the plan computes what op-by-op computes, bit for bit, without ~10 interpreted
    calls per layer (~1.5 ms of a 22-layer step). Built where every layer is what it covers:
    bf16 on the CPU kernels, a bf16, int8 or fp8 KV cache, no tensor parallelism, Llama
    attention or DeepSeek's latent attention (each adds itself: ``add_to_plan``),
    dense MLPs or MoEs (greedy, group-limited or noaux_tc routers) with packed weights."""

    plan: object
    moes: list  # per layer, its SparseMoE (experts_touched is set from the run) or None

    @property
    def has_head(self) -> bool:
        """The plan holds the final norm, the lm_head and the embedding (``run_greedy``)."""
        return getattr(self.plan, "has_head", lambda: False)()

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv_caches: list[PagedKV], dtype: torch.dtype) -> DecodePlanRun | None:
        ops = model.kernels
        plan = ops.decode_plan()
        layers = model.model.layers
        if plan is None or dtype is not torch.bfloat16 or model.tp.enabled or len(kv_caches) != len(layers):
            return None
        if model.model.rotary.cos.dtype is not torch.float32:
            return None
        moes = []
        for layer, cache in zip(layers, kv_caches):
            attn, ffn = layer.self_attn, getattr(layer, layer.ffn_name)
            norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
            if norm.eps != post_norm.eps:
                return None
            # each attention adds itself (Llama's, DeepSeek's latent attention), or is not covered
            add_to_plan = getattr(attn, "add_to_plan", None)
            if add_to_plan is None or not add_to_plan(plan, norm, post_norm, cache, ops):
                return None
            if not _plan_ffn(plan, ffn, ops, moes):
                return None
        # the head, for several greedy passes in one call (a plan without set_head runs them
        # one forward at a time)
        head = ops.plan_linear(model.lm_head) if hasattr(plan, "set_head") else None
        embed, norm = model.model.embed_tokens.weight, model.model.norm
        if head is not None and embed.dtype is torch.bfloat16 and embed.is_contiguous():
            plan.set_head(norm.weight, norm.eps, *head, embed)
        return cls(plan, moes)

    def run(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rotary, kernels) -> bool:
        """h (T, hidden): the residual stream after every layer, updated in place. False (h
        untouched) where the kernels' plan leaves this step to the Python forward."""
        ran = self.plan.run(*_plan_inputs(h, positions, meta, rotary))
        if ran is None:
            return False
        self._ran(*ran, kernels)
        return True

    def run_greedy(
        self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rotary, kernels, steps: int
    ):
        """``steps`` greedy passes from the embedded rows ``h`` (``decode_greedy``): (T, steps)
        tokens, or None (nothing ran) where the kernels' plan leaves these rows to the Python path."""
        ran = self.plan.run_greedy(*_plan_inputs(h, positions, meta, rotary), steps)
        if ran is None:
            return None
        tokens, matmul_s, touched = ran
        self._ran(matmul_s, touched, kernels)
        return tokens

    def _ran(self, matmul_s: float, touched: list[int], kernels) -> None:
        """A run's kernel time to the kernels' count, each MoE's experts read to the layer."""
        kernels.matmul_s += matmul_s
        for moe, used in zip(self.moes, touched):
            if moe is not None:
                moe.experts_touched = used


def _plan_inputs(h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rotary) -> tuple:
    """A decode step's inputs in the order the kernels' plan takes them (``run``, ``run_greedy``)."""
    return h, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, positions, rotary.cos, rotary.sin


def _plan_ffn(plan, ffn, ops, moes: list) -> bool:
    """The layer's feed-forward into the plan's last layer (False: not covered); its MoE, or
    None, appended to ``moes``."""
    if isinstance(ffn, SparseMoE):
        moes.append(ffn)
        return _plan_moe(plan, ffn, ops)
    if not isinstance(ffn, LlamaMLP):
        return False
    gate_up, down = ops.plan_linear(ffn.gate_up_proj), ops.plan_linear(ffn.down_proj)
    if gate_up is None or down is None:
        return False
    plan.set_mlp(*gate_up, *down)
    moes.append(None)
    return True


def _plan_moe(plan, moe: SparseMoE, ops) -> bool:
    """The MoE's router, experts and shared expert into the plan's last layer (False: not covered)."""
    cfg = moe.gate.moe
    gate_up, down = ops.plan_experts(moe.experts.gate_up_proj), ops.plan_experts(moe.experts.down_proj)
    if gate_up is None or down is None or moe.gate.weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if cfg.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        return False
    route_args = moe.gate.route_args()
    bias = route_args[-1]
    if bias is not None and bias.dtype is not torch.float32:
        return False
    shared = moe.shared_mlp
    if shared is not None:
        shared_gate_up, shared_down = ops.plan_linear(shared.gate_up_proj), ops.plan_linear(shared.down_proj)
        if shared_gate_up is None or shared_down is None or shared_gate_up[1] is not None or shared_down[1] is not None:
            return False
    plan.set_moe(moe.gate.weight, *route_args, gate_up, down)
    if shared is not None:
        gate = moe.shared_expert_gate
        plan.set_shared_expert(shared_gate_up[0], shared_down[0], None if gate is None else gate.weight)
    return True
