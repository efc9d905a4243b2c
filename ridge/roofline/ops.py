"""FLOPs and bytes of every operator of a decoder step: the one source of truth.

``step_cost`` prices one engine step (any mix of prefill chunks and decodes); the analyzer's
prefill and decode phases, its sweeps and the engine's telemetry all call it. Parameter counts
(``parameter_inventory``) use the same per-GPU widths, so shapes, parameters and costs agree.

Conventions (also stated by every report):
- FLOPs: 2 per multiply-add of a matmul; RMSNorm 4 per element; softmax, RoPE, SiLU-gating,
  residual adds and sampling are not counted (fused into neighbours, well under 1%).
- Bytes: the minimum traffic, every operand element read or written once (ideal on-chip reuse,
  flash-style attention that never writes the score matrix).
- Weights: matrices (incl. embedding and lm_head) at the weight precision, no quantization-scale
  overhead; norm weights and biases at 16 bits (32 if weights are 32-bit).
- Attention is per sequence; linear layers run once over the step's flattened tokens, so each
  weight is read once per step. MoE: uniform routing, expected distinct experts read per layer.
- Tensor parallel: the cost is per GPU (heads, MLP and vocab sharded; norms, router and MLA's
  down-projections replicated). Communication (``CommCost``) is priced apart, on a ``Link``:
  two all-reduces of the step's hidden states per layer (after attention, after the
  feed-forward) and one gather of the logits to rank 0; a ring all-reduce sends 2 (N-1)/N of
  its payload per rank. A collective sits on the step's critical path: its time adds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ridge.dtypes import PRICED_BYTES
from ridge.quantization.formats import FORMAT_ALIASES, FORMATS
from ridge.roofline.shapes import ModelShape, ceil_div

# Bytes per element of the dtypes a single matmul (``--matmul``) or a peak can be quoted in
# (ridge/dtypes.py's rows the analyzer prices).
DTYPE_BYTES: Mapping[str, float] = MappingProxyType(PRICED_BYTES)

ATTENTION_CONVENTIONS = ("causal", "full")
EMBEDDING_CONVENTIONS = ("gathered", "full")
OP_KINDS = ("linear", "attention", "norm", "embedding")

NORM_FLOPS_PER_ELEMENT = 4  # square, sum, scale by rsqrt, scale by weight


# Storage formats of weights: (bits the arithmetic sees, bits stored per weight incl. scales
# and minimums). The block formats come from their one table (quantization/formats.py), under
# ridge's names and llama.cpp's (q8_0, q4_0, q4_1).
WEIGHT_FORMATS = {
    "fp32": (32, 32.0),
    "bf16": (16, 16.0),
    "fp16": (16, 16.0),
    **{name: (fmt.arithmetic_bits, fmt.bits_per_weight) for name, fmt in FORMATS.items()},
    **{alias: (FORMATS[name].arithmetic_bits, FORMATS[name].bits_per_weight) for alias, name in FORMAT_ALIASES.items()},
}


@dataclass(frozen=True)
class Precision:
    """Storage precision of weights, activations and the KV cache, in bits.

    ``weight_storage_bits``: bits a weight really takes in memory (a block format's scales
    and minimums included: Q8_0 is 8.5); defaults to ``weight_bits``.
    """

    weight_bits: int = 16
    activation_bits: int = 16
    kv_bits: int = 16
    weight_storage_bits: float | None = None
    # a model file's matrices in several formats: (format, share of the weights), largest first
    weight_mix: tuple[tuple[str, float], ...] = ()

    @classmethod
    def for_weight_format(cls, name: str, activation_bits: int = 16, kv_bits: int = 16) -> Precision:
        key = name.lower()
        if key not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {name!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
        bits, stored = WEIGHT_FORMATS[key]
        return cls(bits, activation_bits, kv_bits, stored)

    @classmethod
    def for_weight_mix(cls, weights: Mapping[str, int], activation_bits: int = 16, kv_bits: int = 16) -> Precision:
        """A model file whose matrices each keep their own format (a GGUF file's
        ``weights_by_format``: Q4_K_M holds Q4_K and Q6_K): the arithmetic of the format that
        holds the most weights, and the stored bits averaged over every weight, so a step that
        reads each matrix once reads exactly the file's bytes."""
        total = sum(weights.values())
        if total <= 0:
            raise ValueError("a weight mix needs at least one weight")
        unknown = sorted(name for name in weights if name.lower() not in WEIGHT_FORMATS)
        if unknown:
            raise ValueError(f"unknown weight formats {unknown}; known: {', '.join(WEIGHT_FORMATS)}")
        mix = tuple(sorted(((name.lower(), count / total) for name, count in weights.items()), key=lambda m: -m[1]))
        stored = sum(WEIGHT_FORMATS[name][1] * share for name, share in mix)
        return cls(WEIGHT_FORMATS[mix[0][0]][0], activation_bits, kv_bits, stored, mix)

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("weight_bits", self.weight_bits, (32, 16, 8, 4)),
            ("activation_bits", self.activation_bits, (32, 16, 8, 4)),
            ("kv_bits", self.kv_bits, (32, 16, 8, 4)),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

    @property
    def weight_bytes(self) -> float:
        return (self.weight_storage_bits or self.weight_bits) / 8

    @property
    def activation_bytes(self) -> float:
        return self.activation_bits / 8

    @property
    def kv_bytes(self) -> float:
        return self.kv_bits / 8


@dataclass(frozen=True)
class CostConventions:
    """Choices the numbers depend on; every report prints them.

    attention: "causal" counts each query against the keys before it (the FLOPs a causal
    kernel does); "full" counts the whole query x context rectangle.
    embedding: "gathered" reads only the looked-up rows of the input-embedding table; "full"
    reads the whole table every step.
    tensor_parallel: GPUs sharing each layer; costs are per GPU.
    fused_projections: q/k/v as one matmul and gate/up as one (the input is read once).
    """

    attention: str = "causal"
    embedding: str = "gathered"
    tensor_parallel: int = 1
    fused_projections: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CONVENTIONS:
            raise ValueError(f"attention must be one of {ATTENTION_CONVENTIONS}, got {self.attention!r}")
        if self.embedding not in EMBEDDING_CONVENTIONS:
            raise ValueError(f"embedding must be one of {EMBEDDING_CONVENTIONS}, got {self.embedding!r}")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be an integer >= 1, got {self.tensor_parallel!r}")


@dataclass(frozen=True)
class OpCost:
    """One operator of a step, summed over its ``count`` instances per layer and ``layers``.

    (m, k, n) is one instance's shape: rows x reduction x output columns for matmuls (for
    attention: queries x head dim x keys of one sequence and head; for norms and the embedding
    gather: rows x width in x width out). FLOPs and bytes are totals.
    """

    name: str
    kind: str
    m: int
    k: int
    n: int
    count: float
    layers: int
    flops: float
    weight_bytes: float
    activation_bytes: float
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"op {self.name!r}: kind must be one of {OP_KINDS}, got {self.kind!r}")
        for label in ("flops", "weight_bytes", "activation_bytes", "kv_read_bytes", "kv_write_bytes"):
            if getattr(self, label) < 0:
                raise ValueError(f"op {self.name!r}: {label} is negative")
        if self.layers < 1 or self.count <= 0:
            raise ValueError(f"op {self.name!r}: layers and count must be positive")

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved (0 for a pure gather)."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def time_s(self, peak_flops: float, bandwidth: float) -> float:
        """Roofline time: the slower of compute and memory, ``max(FLOPs/peak, bytes/bw)``."""
        return max(self.flops / peak_flops, self.bytes / bandwidth)

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        return "compute" if self.flops / peak_flops >= self.bytes / bandwidth else "memory"


@dataclass(frozen=True)
class CommCost:
    """A step's tensor-parallel communication, per rank: ``collectives`` (each pays the link's
    latency), ``payload_bytes`` (the tensors reduced or gathered) and ``link_bytes`` (what a
    rank sends over the link for them)."""

    collectives: int = 0
    payload_bytes: float = 0.0
    link_bytes: float = 0.0


@dataclass(frozen=True)
class Link:
    """What connects the ranks: a latency per collective and a bandwidth per rank."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = ""

    def time_s(self, comm: CommCost) -> float:
        return comm.collectives * self.latency_s + comm.link_bytes / self.bandwidth_bytes_per_s


# Nominal links (per rank, one direction; latency of a small NCCL all-reduce). ``local`` probes
# this machine instead: gloo over loopback between two processes (ridge/distributed/probe.py).
LINK_PRESETS: Mapping[str, Link] = MappingProxyType(
    {
        "nvlink4": Link("nvlink4 (H100 SXM, 900 GB/s bidirectional)", 450e9, 10e-6, "nominal"),
        "nvlink3": Link("nvlink3 (A100 SXM, 600 GB/s bidirectional)", 300e9, 10e-6, "nominal"),
        "pcie5": Link("PCIe 5.0 x16", 64e9, 15e-6, "nominal"),
        "pcie4": Link("PCIe 4.0 x16", 32e9, 15e-6, "nominal"),
        "ib-400g": Link("InfiniBand NDR 400 Gb/s", 50e9, 5e-6, "nominal"),
        "ethernet-100g": Link("100 Gb/s Ethernet (TCP)", 12.5e9, 30e-6, "nominal"),
    }
)


def comm_cost(model: ModelShape, tokens: int, logit_rows: int, act_bytes: float, tp: int) -> CommCost:
    """The communication of one step over ``tp`` ranks (zero for one rank)."""
    if tp == 1:
        return CommCost()
    hidden = tokens * model.hidden_size * act_bytes
    reduces = 2 * model.num_layers
    share = ceil_div(model.vocab_size, tp)
    logits = logit_rows * share * tp * act_bytes  # rank 0 receives every other rank's share
    return CommCost(
        collectives=reduces + 1,
        payload_bytes=reduces * hidden + logits,
        link_bytes=reduces * hidden * 2 * (tp - 1) / tp + logits * (tp - 1) / tp,
    )


@dataclass(frozen=True)
class StepCost:
    """All operators of one step (per GPU) plus the step's token and sequence counts, and its
    tensor-parallel communication (priced on a ``Link``, apart from the roofline)."""

    ops: tuple[OpCost, ...]
    tokens: int
    sequences: int
    comm: CommCost = CommCost()

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

    @property
    def weight_bytes(self) -> float:
        return sum(op.weight_bytes for op in self.ops)

    @property
    def activation_bytes(self) -> float:
        return sum(op.activation_bytes for op in self.ops)

    @property
    def kv_read_bytes(self) -> float:
        return sum(op.kv_read_bytes for op in self.ops)

    @property
    def kv_write_bytes(self) -> float:
        return sum(op.kv_write_bytes for op in self.ops)

    @property
    def bytes(self) -> float:
        return sum(op.bytes for op in self.ops)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    def time_s(self, peak_flops: float, bandwidth: float) -> float:
        """Roofline time of the step: each operator is its own kernel, bounded on its own."""
        return sum(op.time_s(peak_flops, bandwidth) for op in self.ops)

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        """Which side the step as a whole sits on (its intensity against the ridge point)."""
        return "compute" if self.flops / peak_flops >= self.bytes / bandwidth else "memory"

    def op(self, name: str) -> OpCost:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no op named {name!r}; ops: {[op.name for op in self.ops]}")


# ---- per-GPU widths and parameters ---------------------------------------------------------
@dataclass(frozen=True)
class ShardWidths:
    """Per-GPU widths under tensor parallelism (ceil where a width does not divide)."""

    heads: int
    kv_heads: int
    intermediate: int
    expert_intermediate: int
    shared_intermediate: int
    vocab: int

    @classmethod
    def of(cls, model: ModelShape, tensor_parallel: int) -> ShardWidths:
        tp = tensor_parallel
        if model.num_heads % tp:
            raise ValueError(f"tensor_parallel {tp} does not divide {model.name}'s {model.num_heads} heads")
        if model.num_kv_heads >= tp:
            if model.num_kv_heads % tp:
                raise ValueError(f"tensor_parallel {tp} does not divide {model.name}'s {model.num_kv_heads} KV heads")
            kv_heads = model.num_kv_heads // tp
        else:
            if tp % model.num_kv_heads:
                raise ValueError(
                    f"tensor_parallel {tp} is not a multiple of {model.name}'s {model.num_kv_heads} KV heads"
                )
            kv_heads = 1  # fewer KV heads than GPUs: each GPU keeps a replica of one
        moe = model.moe
        return cls(
            heads=model.num_heads // tp,
            kv_heads=kv_heads,
            intermediate=ceil_div(model.intermediate_size, tp),
            expert_intermediate=ceil_div(moe.expert_intermediate_size, tp) if moe else 0,
            shared_intermediate=ceil_div(moe.shared_intermediate_size, tp) if moe else 0,
            vocab=ceil_div(model.vocab_size, tp),
        )


# An MoE router's bytes per weight unless told otherwise: ridge scores experts in float32 and
# holds the router so, whatever the other weights' precision (models/moe.py Router.keep_float32;
# a GGUF file's router is F32 too). The CPU kernels read a router whose values are all bf16 as
# bf16 (Router.for_kernels): the engine prices its routers as it holds them (ModelInfo).
ROUTER_BYTES_PER_PARAM = 4.0


@dataclass(frozen=True)
class ParamGroup:
    """Parameters of one kind: ``params`` per layer (per GPU when sharded) x ``layers``.

    ``matrix`` groups are stored at the weight precision, the others (norm weights, biases)
    at 16 bits; ``router`` groups: an MoE's router at its own precision (``router_bytes_per_param``)
    and its bias in float32 (``Router`` keeps it so: a rounded bias would change choices);
    ``routed_expert`` marks the routed experts, of which a token uses k of E.
    """

    name: str
    params: int
    layers: int
    matrix: bool = True
    routed_expert: bool = False
    router: bool = False

    @property
    def total(self) -> int:
        return self.params * self.layers

    def bytes_per_param(self, weight_bytes_per_param: float, router_bytes_per_param: float) -> float:
        if self.router:
            return router_bytes_per_param if self.matrix else ROUTER_BYTES_PER_PARAM
        return weight_bytes_per_param if self.matrix else vector_bytes_per_param(weight_bytes_per_param)


def vector_bytes_per_param(weight_bytes_per_param: float) -> float:
    """Norm weights and biases stay at 16 bits when matrices are quantized (32 if fp32)."""
    return max(weight_bytes_per_param, 2.0)


def parameter_inventory(model: ModelShape, tensor_parallel: int = 1) -> tuple[ParamGroup, ...]:
    """Every parameter of the model, grouped; per GPU when ``tensor_parallel`` > 1."""
    w = ShardWidths.of(model, tensor_parallel)
    d = model.hidden_size
    groups = [
        ParamGroup("embed_tokens", w.vocab * d, 1),
        ParamGroup("final_norm", d, 1, matrix=False),
        ParamGroup("norms", 2 * d, model.num_layers, matrix=False),
    ]
    if not model.tie_word_embeddings:
        groups.append(ParamGroup("lm_head", w.vocab * d, 1))
    L = model.num_layers
    if model.mla is None:
        q, kv = w.heads * model.head_dim, w.kv_heads * model.head_dim
        groups += [ParamGroup("qkv_proj", d * (q + 2 * kv), L), ParamGroup("o_proj", q * d, L)]
        if model.qkv_bias:
            groups.append(ParamGroup("qkv_bias", q + 2 * kv, L, matrix=False))
        if model.o_bias:
            groups.append(ParamGroup("o_bias", d, L, matrix=False))
        if model.qk_norm:
            groups.append(ParamGroup("qk_norm", 2 * model.head_dim, L, matrix=False))
    else:
        mla = model.mla
        if mla.q_lora_rank:
            groups += [
                ParamGroup("q_a_proj", d * mla.q_lora_rank, L),
                ParamGroup("q_a_norm", mla.q_lora_rank, L, matrix=False),
                ParamGroup("q_b_proj", mla.q_lora_rank * w.heads * mla.qk_head_dim, L),
            ]
        else:
            groups.append(ParamGroup("q_proj", d * w.heads * mla.qk_head_dim, L))
        groups += [
            ParamGroup("kv_a_proj", d * mla.cache_dim, L),
            ParamGroup("kv_a_norm", mla.kv_lora_rank, L, matrix=False),
            ParamGroup("kv_b_proj", mla.kv_lora_rank * w.heads * (mla.qk_nope_head_dim + mla.v_head_dim), L),
            ParamGroup("o_proj", w.heads * mla.v_head_dim * d, L),
        ]
    if model.dense_layers:
        groups.append(ParamGroup("mlp", 3 * d * w.intermediate, model.dense_layers))
    if model.is_moe:
        moe, Lm = model.moe, model.moe_layers
        groups += [
            ParamGroup("router", d * moe.num_experts, Lm, router=True),
            ParamGroup("experts", moe.num_experts * 3 * d * w.expert_intermediate, Lm, routed_expert=True),
        ]
        if moe.router_bias:
            groups.append(ParamGroup("router_bias", moe.num_experts, Lm, matrix=False, router=True))
        if moe.shared_intermediate_size:
            groups.append(ParamGroup("shared_expert", 3 * d * w.shared_intermediate, Lm))
        if moe.shared_expert_gate:
            groups.append(ParamGroup("shared_expert_gate", d, Lm))
    return tuple(groups)


def params_total(model: ModelShape) -> int:
    return sum(g.total for g in parameter_inventory(model))


def params_active(model: ModelShape) -> float:
    """Parameters one token uses: everything but the routed experts it is not sent to."""
    fraction = model.moe.experts_per_token / model.moe.num_experts if model.is_moe else 1.0
    return sum(g.total * (fraction if g.routed_expert else 1) for g in parameter_inventory(model))


def weight_bytes(
    model: ModelShape,
    weight_bytes_per_param: float,
    tensor_parallel: int = 1,
    router_bytes_per_param: float = ROUTER_BYTES_PER_PARAM,
) -> float:
    """Bytes of all weights (per GPU under tensor parallelism); an MoE's routers at
    ``router_bytes_per_param``."""
    return sum(
        g.total * g.bytes_per_param(weight_bytes_per_param, router_bytes_per_param)
        for g in parameter_inventory(model, tensor_parallel)
    )


def kv_bytes_per_token(model: ModelShape, kv_bytes_per_elem: float, tensor_parallel: int = 1) -> float:
    """KV-cache bytes one token adds over all layers (per GPU under tensor parallelism).

    Standard attention: 2 (K and V) x kv_heads x head_dim; MLA: latent + rotary key, which every
    tensor-parallel GPU keeps whole.
    """
    if model.mla is not None or tensor_parallel == 1:
        return model.kv_cache_elements_per_token() * kv_bytes_per_elem
    kv_heads = ShardWidths.of(model, tensor_parallel).kv_heads
    return 2 * kv_heads * model.head_dim * model.num_layers * kv_bytes_per_elem


# ---- attention bookkeeping -----------------------------------------------------------------
def attended_pairs(queries: int, context_len: int, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs of a chunk of ``queries`` tokens ending at ``context_len``.

    Causal: the query at position p (1-based) sees keys 1..p, or the last ``window`` of them.
    Full: every query sees the whole (windowed) context.
    """
    if not causal:
        return queries * (context_len if window is None else min(context_len, window))
    first = context_len - queries + 1
    if window is None:
        return (first + context_len) * queries // 2
    pairs = 0
    last_unclipped = min(context_len, window)  # positions up to the window see all their keys
    if first <= last_unclipped:
        pairs += (first + last_unclipped) * (last_unclipped - first + 1) // 2
    first_clipped = max(first, window + 1)
    if first_clipped <= context_len:
        pairs += window * (context_len - first_clipped + 1)
    return pairs


def keys_read(queries: int, context_len: int, window: int | None = None) -> int:
    """Distinct cached keys a chunk touches (each read once)."""
    if window is None:
        return context_len
    return min(context_len, queries + window - 1)


@dataclass(frozen=True)
class _SequenceGroup:
    """Aggregates over a set of sequences: tokens, sequences, (q, k) pairs, keys read."""

    queries: int
    sequences: int
    pairs: int
    keys: int
    uniform_shape: tuple[int, int] | None  # (queries, keys) when every sequence has the same

    @classmethod
    def of(cls, shapes: Counter, causal: bool, window: int | None) -> _SequenceGroup:
        queries = sequences = pairs = keys = 0
        for (q, c), n in shapes.items():
            queries += n * q
            sequences += n
            pairs += n * attended_pairs(q, c, causal, window)
            keys += n * keys_read(q, c, window)
        uniform = None
        if len(shapes) == 1:
            ((q, c),) = shapes
            uniform = (q, keys_read(q, c, window))
        return cls(queries, sequences, pairs, keys, uniform)

    def shape(self) -> tuple[int, int]:
        """(m, n) of one sequence's attention matmul: exact if uniform, else the means."""
        if self.uniform_shape:
            return self.uniform_shape
        return max(1, round(self.queries / self.sequences)), max(1, round(self.keys / self.sequences))


# ---- the step -------------------------------------------------------------------------------
def step_cost(
    model: ModelShape,
    prefill_chunks: Sequence[tuple[int, int]],
    decode_context_lens: Sequence[int],
    weight_bytes_per_param: float,
    kv_bytes_per_elem: float,
    act_bytes: float,
    *,
    conventions: CostConventions = CostConventions(),
    logit_rows: int | None = None,
    experts_touched: float | None = None,
    router_bytes_per_param: float = ROUTER_BYTES_PER_PARAM,
) -> StepCost:
    """FLOPs and bytes of one forward step, per GPU, operator by operator.

    prefill_chunks: (num_query_tokens, context_len_after_chunk) per sequence prefilling now.
    decode_context_lens: context length (including the new token) of each decoding sequence.
    The step's tokens are flattened for the linear layers (each weight read once per step);
    attention is priced per sequence. ``logit_rows`` defaults to one row per sequence (the
    position that is sampled); pass more for speculative verification. ``experts_touched``:
    the distinct experts an MoE layer read in this step (mean over layers, as the engine
    measured it); default, the analyzer's expectation under uniform routing. An MoE's
    router is read at ``router_bytes_per_param``, not the weights' precision.
    Raises ValueError for an empty step or an inconsistent chunk.
    """
    sequences: Counter = Counter(tuple(chunk) for chunk in prefill_chunks)
    for context_len, count in Counter(decode_context_lens).items():
        sequences[(1, context_len)] += count
    return step_cost_from_counts(
        model,
        sequences,
        weight_bytes_per_param,
        kv_bytes_per_elem,
        act_bytes,
        conventions=conventions,
        logit_rows=logit_rows,
        experts_touched=experts_touched,
        router_bytes_per_param=router_bytes_per_param,
    )


def step_cost_from_counts(
    model: ModelShape,
    sequences: Mapping[tuple[int, int], int],
    weight_bytes_per_param: float,
    kv_bytes_per_elem: float,
    act_bytes: float,
    *,
    conventions: CostConventions = CostConventions(),
    logit_rows: int | None = None,
    experts_touched: float | None = None,
    router_bytes_per_param: float = ROUTER_BYTES_PER_PARAM,
) -> StepCost:
    """``step_cost`` with the step given as {(num_query_tokens, context_len): how many sequences}
    (a decode is num_query_tokens 1): O(distinct shapes), for sweeps over huge batches."""
    shapes: Counter = Counter()
    for (q, c), count in sequences.items():
        if q < 1 or c < q:
            raise ValueError(f"sequence ({q}, {c}): need 1 <= num_query_tokens <= context_len")
        if count < 0 or int(count) != count:
            raise ValueError(f"sequence ({q}, {c}): count must be a non-negative integer, got {count}")
        if count:
            shapes[(int(q), int(c))] += int(count)
    if not shapes:
        raise ValueError("a step needs at least one prefill chunk or decode")
    for label, value in (
        ("weight_bytes_per_param", weight_bytes_per_param),
        ("kv_bytes_per_elem", kv_bytes_per_elem),
        ("act_bytes", act_bytes),
        ("router_bytes_per_param", router_bytes_per_param),
    ):
        if value <= 0:
            raise ValueError(f"{label} must be positive, got {value}")
    builder = _StepBuilder(model, conventions, weight_bytes_per_param, kv_bytes_per_elem, act_bytes)
    builder.router_bytes = router_bytes_per_param
    builder.experts_touched = experts_touched
    tokens = sum(q * n for (q, _), n in shapes.items())
    count = sum(shapes.values())
    rows = count if logit_rows is None else logit_rows
    if not 1 <= rows <= tokens:
        raise ValueError(f"logit_rows must be in [1, {tokens}], got {logit_rows}")
    comm = comm_cost(model, tokens, rows, act_bytes, conventions.tensor_parallel)
    return StepCost(ops=tuple(builder.build(shapes, tokens, rows)), tokens=tokens, sequences=count, comm=comm)


class _StepBuilder:
    """Emits the ops of one step; one method per block of the layer."""

    def __init__(self, model: ModelShape, conventions: CostConventions, wb: float, kvb: float, ab: float) -> None:
        self.model = model
        self.conv = conventions
        self.w = ShardWidths.of(model, conventions.tensor_parallel)
        self.wb, self.kvb, self.ab = wb, kvb, ab
        self.vb = vector_bytes_per_param(wb)
        self.causal = conventions.attention == "causal"
        self.experts_touched: float | None = None  # measured per MoE layer (else expected)
        self.router_bytes = ROUTER_BYTES_PER_PARAM  # an MoE router's bytes per weight

    # -- primitives --
    def linear(
        self,
        name: str,
        rows: float,
        k: int,
        n: int,
        layers: int,
        *,
        count: float = 1,
        bias: bool = False,
        kv_out_cols: int = 0,
        kv_in: bool = False,
        m: int | None = None,
        router: bool = False,
    ) -> OpCost:
        """``count`` matmuls of (m, k) x (k, n) whose rows total ``rows``; weights read once each.

        kv_out_cols of the output go to the KV cache instead of activations; kv_in reads the
        input from the KV cache (MLA's latent); a router's weights are read at the router's
        precision, its bias in float32 (``ParamGroup``).
        """
        in_bytes = rows * k * (self.kvb if kv_in else self.ab)
        out_act = rows * (n - kv_out_cols) * self.ab
        wb, vb = (self.router_bytes, ROUTER_BYTES_PER_PARAM) if router else (self.wb, self.vb)
        weights = count * (k * n * wb + (n * vb if bias else 0))
        return OpCost(
            name=name,
            kind="linear",
            m=m if m is not None else max(1, round(rows / count)),
            k=k,
            n=n,
            count=count,
            layers=layers,
            flops=2 * rows * k * n * layers,
            weight_bytes=weights * layers,
            activation_bytes=(0 if kv_in else in_bytes) * layers + out_act * layers,
            kv_read_bytes=(in_bytes if kv_in else 0) * layers,
            kv_write_bytes=rows * kv_out_cols * self.kvb * layers,
        )

    def norm(self, name: str, rows: int, width: int, layers: int, *, to_cache: bool = False) -> OpCost:
        out = rows * width * (self.kvb if to_cache else self.ab)
        return OpCost(
            name=name,
            kind="norm",
            m=rows,
            k=width,
            n=width,
            count=1,
            layers=layers,
            flops=NORM_FLOPS_PER_ELEMENT * rows * width * layers,
            weight_bytes=width * self.vb * layers,
            activation_bytes=(rows * width * self.ab + (0 if to_cache else out)) * layers,
            kv_write_bytes=(out if to_cache else 0) * layers,
        )

    # -- the step --
    def build(self, shapes: Counter, tokens: int, logit_rows: int) -> list[OpCost]:
        model, L = self.model, self.model.num_layers
        d, T = model.hidden_size, tokens
        ops = [self.embedding(T), self.norm("input_norm", T, d, L)]
        ops += self.attention(shapes, T) if model.mla is None else self.mla_attention(shapes, T)
        ops.append(self.norm("post_attention_norm", T, d, L))
        if model.dense_layers:
            ops += self.gated_mlp("", T, self.w.intermediate, model.dense_layers)
        if model.is_moe:
            ops += self.moe(T)
        ops.append(self.norm("final_norm", T, d, 1))
        ops.append(self.linear("lm_head", logit_rows, d, self.w.vocab, 1))
        return ops

    def embedding(self, T: int) -> OpCost:
        d, tp = self.model.hidden_size, self.conv.tensor_parallel
        if self.conv.embedding == "full":
            table = self.w.vocab * d * self.wb
        else:  # vocab-parallel: each GPU gathers the rows that fall in its shard
            table = T * d * self.wb / tp
        return OpCost(
            name="embedding",
            kind="embedding",
            m=T,
            k=self.model.vocab_size,
            n=d,
            count=1,
            layers=1,
            flops=0,
            weight_bytes=table,
            activation_bytes=T * d * self.ab,
        )

    def attention(self, shapes: Counter, T: int) -> list[OpCost]:
        model, w, L = self.model, self.w, self.model.num_layers
        d, hd = model.hidden_size, model.head_dim
        q_cols, kv_cols = w.heads * hd, w.kv_heads * hd
        # Qwen3 normalizes K after the projection, so K reaches the cache through qk_norm.
        k_to_cache = 0 if model.qk_norm else kv_cols
        ops: list[OpCost] = []
        if self.conv.fused_projections:
            ops.append(
                self.linear(
                    "qkv_proj",
                    T,
                    d,
                    q_cols + 2 * kv_cols,
                    L,
                    bias=model.qkv_bias,
                    kv_out_cols=k_to_cache + kv_cols,
                )
            )
        else:
            ops += [
                self.linear("q_proj", T, d, q_cols, L, bias=model.qkv_bias),
                self.linear("k_proj", T, d, kv_cols, L, bias=model.qkv_bias, kv_out_cols=k_to_cache),
                self.linear("v_proj", T, d, kv_cols, L, bias=model.qkv_bias, kv_out_cols=kv_cols),
            ]
        if model.qk_norm:
            ops.append(
                OpCost(
                    name="qk_norm",
                    kind="norm",
                    m=T,
                    k=hd,
                    n=hd,
                    count=w.heads + w.kv_heads,
                    layers=L,
                    flops=NORM_FLOPS_PER_ELEMENT * T * (q_cols + kv_cols) * L,
                    weight_bytes=2 * hd * self.vb * L,
                    activation_bytes=T * (2 * q_cols + kv_cols) * self.ab * L,
                    kv_write_bytes=T * kv_cols * self.kvb * L,
                )
            )
        g = _SequenceGroup.of(shapes, self.causal, model.sliding_window)
        m, n = g.shape()
        instances = g.sequences * w.heads
        ops += [
            OpCost(
                name="attn_scores",
                kind="attention",
                m=m,
                k=hd,
                n=n,
                count=instances,
                layers=L,
                flops=2 * w.heads * hd * g.pairs * L,
                weight_bytes=0,
                activation_bytes=T * q_cols * self.ab * L,
                kv_read_bytes=g.keys * kv_cols * self.kvb * L,
            ),
            OpCost(
                name="attn_weighted_sum",
                kind="attention",
                m=m,
                k=n,
                n=hd,
                count=instances,
                layers=L,
                flops=2 * w.heads * hd * g.pairs * L,
                weight_bytes=0,
                activation_bytes=T * q_cols * self.ab * L,
                kv_read_bytes=g.keys * kv_cols * self.kvb * L,
            ),
            self.linear("o_proj", T, q_cols, d, L, bias=model.o_bias),
        ]
        return ops

    def mla_attention(self, shapes: Counter, T: int) -> list[OpCost]:
        """DeepSeek MLA. Each sequence takes the cheaper form (fewer FLOPs): long prefill chunks
        decompress their context's latent with kv_b_proj; decodes and short chunks attend in the
        latent space with kv_b_proj absorbed into the query and the output ("absorbed")."""
        model, w, L, mla = self.model, self.w, self.model.num_layers, self.model.mla
        d, H = model.hidden_size, w.heads
        nope, rope, v, r = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
        ops: list[OpCost] = []
        if mla.q_lora_rank:
            ops += [
                self.linear("q_a_proj", T, d, mla.q_lora_rank, L),
                self.norm("q_a_norm", T, mla.q_lora_rank, L),
                self.linear("q_b_proj", T, mla.q_lora_rank, H * mla.qk_head_dim, L),
            ]
        else:
            ops.append(self.linear("q_proj", T, d, H * mla.qk_head_dim, L))
        ops.append(self.linear("kv_a_proj", T, d, mla.cache_dim, L))
        ops.append(self._latent_norm(T))

        decompressed, absorbed = Counter(), Counter()
        for (q, c), n in shapes.items():
            pairs = attended_pairs(q, c, self.causal)
            cost_decompressed = c * r * (nope + v) + pairs * (mla.qk_head_dim + v)
            cost_absorbed = q * r * (nope + v) + pairs * (mla.cache_dim + r)
            (absorbed if cost_absorbed <= cost_decompressed else decompressed)[(q, c)] += n
        if decompressed:
            g = _SequenceGroup.of(decompressed, self.causal, None)
            m, n_keys = g.shape()
            ops += [
                self.linear("kv_b_proj", g.keys, r, H * (nope + v), L, kv_in=True),
                OpCost(
                    name="attn_scores",
                    kind="attention",
                    m=m,
                    k=mla.qk_head_dim,
                    n=n_keys,
                    count=g.sequences * H,
                    layers=L,
                    flops=2 * H * mla.qk_head_dim * g.pairs * L,
                    weight_bytes=0,
                    activation_bytes=(g.queries * H * mla.qk_head_dim + g.keys * H * nope) * self.ab * L,
                    kv_read_bytes=g.keys * rope * self.kvb * L,
                ),
                OpCost(
                    name="attn_weighted_sum",
                    kind="attention",
                    m=m,
                    k=n_keys,
                    n=v,
                    count=g.sequences * H,
                    layers=L,
                    flops=2 * H * v * g.pairs * L,
                    weight_bytes=0,
                    activation_bytes=(g.keys * H * v + g.queries * H * v) * self.ab * L,
                ),
            ]
        if absorbed:
            g = _SequenceGroup.of(absorbed, self.causal, None)
            m, n_keys = g.shape()
            Tq = g.queries
            ops += [
                self.linear("q_absorb", Tq * H, nope, r, L, count=H),
                OpCost(
                    name="attn_scores_latent",
                    kind="attention",
                    m=m,
                    k=mla.cache_dim,
                    n=n_keys,
                    count=g.sequences * H,
                    layers=L,
                    flops=2 * H * mla.cache_dim * g.pairs * L,
                    weight_bytes=0,
                    activation_bytes=Tq * H * mla.cache_dim * self.ab * L,
                    kv_read_bytes=g.keys * mla.cache_dim * self.kvb * L,
                ),
                # The same latent rows serve as values; a fused kernel streams them once.
                OpCost(
                    name="attn_weighted_sum_latent",
                    kind="attention",
                    m=m,
                    k=n_keys,
                    n=r,
                    count=g.sequences * H,
                    layers=L,
                    flops=2 * H * r * g.pairs * L,
                    weight_bytes=0,
                    activation_bytes=Tq * H * r * self.ab * L,
                ),
                self.linear("v_unabsorb", Tq * H, r, v, L, count=H),
            ]
        ops.append(self.linear("o_proj", T, H * v, d, L))
        return ops

    def _latent_norm(self, T: int) -> OpCost:
        """kv_a_norm normalizes the latent and writes latent + rotary key into the cache."""
        mla, L = self.model.mla, self.model.num_layers
        return OpCost(
            name="kv_a_norm",
            kind="norm",
            m=T,
            k=mla.cache_dim,
            n=mla.cache_dim,
            count=1,
            layers=L,
            flops=NORM_FLOPS_PER_ELEMENT * T * mla.kv_lora_rank * L,
            weight_bytes=mla.kv_lora_rank * self.vb * L,
            activation_bytes=T * mla.cache_dim * self.ab * L,
            kv_write_bytes=T * mla.cache_dim * self.kvb * L,
        )

    def gated_mlp(
        self, prefix: str, rows: float, width: int, layers: int, *, count: float = 1, m: int | None = None
    ) -> list[OpCost]:
        d = self.model.hidden_size
        if self.conv.fused_projections:
            up = [self.linear(f"{prefix}gate_up_proj", rows, d, 2 * width, layers, count=count, m=m)]
        else:
            up = [
                self.linear(f"{prefix}gate_proj", rows, d, width, layers, count=count, m=m),
                self.linear(f"{prefix}up_proj", rows, d, width, layers, count=count, m=m),
            ]
        return up + [self.linear(f"{prefix}down_proj", rows, width, d, layers, count=count, m=m)]

    def moe(self, T: int) -> list[OpCost]:
        model, moe, Lm = self.model, self.model.moe, self.model.moe_layers
        d = model.hidden_size
        routed = T * moe.experts_per_token
        touched = moe.expected_experts_touched(T) if self.experts_touched is None else self.experts_touched
        touched = min(max(touched, 1.0), float(moe.num_experts))
        ops = [self.linear("router", T, d, moe.num_experts, Lm, bias=moe.router_bias, router=True)]
        ops += self.gated_mlp(
            "experts_",
            routed,
            self.w.expert_intermediate,
            Lm,
            count=touched,
            m=max(1, round(routed / touched)),
        )
        if moe.shared_intermediate_size:
            ops += self.gated_mlp("shared_expert_", T, self.w.shared_intermediate, Lm)
        if moe.shared_expert_gate:
            ops.append(self.linear("shared_expert_gate", T, d, 1, Lm))
        return ops


# ---- a single matmul ------------------------------------------------------------------------
def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def matmul_cost(m: int, k: int, n: int, dtype: str) -> OpCost:
    """(m, k) x (k, n): FLOPs = 2mkn; minimum bytes = every input and output element once."""
    if min(m, k, n) < 1:
        raise ValueError(f"matmul dimensions must be positive, got {(m, k, n)}")
    size = dtype_bytes(dtype)
    return OpCost(
        name=f"matmul {m}x{k}x{n} {dtype}",
        kind="linear",
        m=m,
        k=k,
        n=n,
        count=1,
        layers=1,
        flops=2 * m * k * n,
        weight_bytes=k * n * size,
        activation_bytes=(m * k + m * n) * size,
    )


def matmul_compute_bound_rows(k: int, n: int, dtype: str, ridge_point: float) -> int | None:
    """Smallest row count m at which (m, k) x (k, n) reaches ``ridge_point`` FLOP/byte.

    From 2mkn / (b(mk + kn + mn)) >= R: m >= bRkn / (2kn - bR(k + n)); None if never.
    """
    b = dtype_bytes(dtype)
    denominator = 2 * k * n - b * ridge_point * (k + n)
    if denominator <= 0:
        return None
    m = max(1, int(-(-(b * ridge_point * k * n) // denominator)))
    # Guard the float rounding at the boundary with the exact test.
    while m > 1 and matmul_cost(m - 1, k, n, dtype).intensity >= ridge_point:
        m -= 1
    while matmul_cost(m, k, n, dtype).intensity < ridge_point:
        m += 1
    return m
