"""The ops a step is made of, behind one object the model receives at load time.

``TorchKernels`` is the reference: plain torch, any dtype and device (the parity tests run
it in float32 against Hugging Face). ``CpuKernels`` runs the same arithmetic with
ridge's AVX-512 extension on CPU: in bfloat16 the streaming GEMM for decode and fused
small ops (norms, RoPE, SiLU-gating), rounding where the torch path rounds; in bfloat16 and
float32 the paged decode attention, read from the pool without a gathered copy.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ridge.kv.cache import PagedKV
from ridge.layers.attention import (
    AttentionMetadata,
    PrefillChunk,
    decode_valid_mask,
    gather_values,
    prefill_attention,
    write_kv,
)
from ridge.layers.linear import ExpertLinear, Linear
from ridge.layers.rotary import RotaryEmbedding, rotate_half
from ridge.quantization.formats import IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, BlockFormat
from ridge.quantization.methods import PACKED_ROW_BLOCK, UnquantizedLinearMethod

# Query heads per KV head from which the generic decode-attention kernel gives way to GEMMs
MANY_HEADS_PER_KV_HEAD = 8
# Query heads on one shared KV head (MLA) from which bf16 decode attention puts heads in a
# vector's lanes (a full vector of 16)
SHARED_KV_MIN_HEADS = 16
# Each bit of an int32 word as an int32 (bit 31 is the sign): token bitmasks unpacked in one op
_BIT_VALUES = torch.tensor([1 << j if j < 31 else -(1 << 31) for j in range(32)], dtype=torch.int32)
# The formats the AVX2 kernels repack at load into blocks of 8 rows (csrc/avx2_blocks.cpp).
# Its repack_rows takes Q6_K too, but its layers stay in GGUF's layout (the kernel packs their
# blocks of 8 rows as it goes from 32 rows of x on: prefill). Q6_K in rows of 8 against GGUF's
# layout, both in 2 MiB pages, 22 TinyLlama-1.1B layers from memory, 2 threads, 9 alternated
# rounds on the 2-core Zen 3 EPYC (2026-12-03): 0.89x at one row, 1.19x at 2, 1.33x at 4; the
# Q6_K file's batch-1 decode 0.92x (6 alternated rounds, two engines in one process). Q8_0,
# which had stayed as loaded too (one row ran 5-15% slower in rows of 8 there, 2026-11-29, in
# 4 KiB pages and before the kernels stopped spilling registers), ran 1.30x at one row, 1.90x
# at 2, 2.1x at 4 and 8 in the same measurement, and its file decodes 1.24x faster at batch 1
# (1.05-1.39 a round, the same tokens): packed since stop 81. Q5_K and IQ4_XS in rows of 8,
# against GGUF's layout (same machine, 8 matrices of 5632 x 2048 from memory, 2 threads): 1.27x
# and 1.18x at one row, 1.50x and 1.40x at two. Q3_K and Q2_K, whose one-row kernels on GGUF's
# layout are compute-bound (2-core Intel Xeon running the AVX2 kernels, 2026-12-02, 80 matrices
# of 5632 x 2048 from memory, 2 threads, 5 alternated rounds): rows of 8 1.16x and 1.09x at one
# row, 1.11x and 1.13x at two, 1.42x and 1.90x at four, 1.71x and 2.01x at eight (Q6_K, kept
# as loaded, 0.81x at one row on that machine too).
AVX2_PACKED_FORMATS = frozenset(f.name for f in (Q8_0, Q4_0, Q4_1, IQ4_NL, Q4_K, Q5_K, IQ4_XS, Q3_K, Q2_K))
# The extension's format codes (csrc/linear_quant.cpp)
QUANT_KERNEL_CODES = {
    Q8_0.name: 0,
    Q4_0.name: 1,
    Q4_1.name: 2,
    IQ4_NL.name: 3,
    Q4_K.name: 4,
    IQ4_XS.name: 5,
    Q6_K.name: 6,
    Q5_K.name: 7,
    Q3_K.name: 8,
    Q2_K.name: 9,
}


def _takes(x: torch.Tensor, fmt: BlockFormat | None) -> bool:
    """Whether ridge's GEMMs take these activations: bf16 for bf16 weights; bf16 or float32
    for the block formats (x is quantized to int8 anyway, per its activation block)."""
    return x.dtype is torch.bfloat16 if fmt is None else x.dtype in (torch.bfloat16, torch.float32)


def check_route_groups(experts: int, n_group: int, topk_group: int) -> None:
    """The groups a routing config names: n_group dividing the experts, 1..n_group kept. Checked
    here, before any kernel runs (the CPU kernel checks it too)."""
    if n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group:
        raise RuntimeError(f"route_topk: {experts} experts in {n_group} groups, {topk_group} of them kept")


def topk_route(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    softmax: bool,
    norm_topk: bool,
    norm_eps: float,
    scaling: float,
    n_group: int = 1,
    topk_group: int = 1,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing, as Hugging Face's MoEs route: each token's scores against the router's
    rows in float32, softmax (or sigmoid), the top_k best first, renormalized over the k (their
    sum + ``norm_eps``) where asked, times ``scaling``; (T, k) ids and weights in x's dtype.

    Group-limited (DeepSeek; greedy where n_group is 1 and there is no bias): the experts sit
    in n_group groups and only the topk_group groups with the best group score compete: their
    best score (group_limited_greedy) or, with ``bias`` (noaux_tc's e_score_correction_bias,
    added to the scores for the choice only), the sum of their two best. The weights are the
    uncorrected scores.

        scores (T, E) -> view (T, n_group, E / n_group) -> group score -> keep topk_group groups
                      -> mask the other groups' experts -> top_k of what is left
    """
    check_route_groups(router.shape[0], n_group, topk_group)
    logits = F.linear(x.float(), router.float())  # (a no-op for a float32 router; a bf16 one widens exactly)
    scores = logits.softmax(dim=-1) if softmax else logits.sigmoid()
    if n_group == 1 and bias is None:
        weights, ids = scores.topk(top_k, dim=-1)
    else:
        choice = scores + bias.float() if bias is not None else scores
        grouped = choice.view(x.shape[0], n_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1) if bias is not None else grouped.amax(dim=-1)
        best_groups = group_score.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best_groups, True)
        keep = keep.repeat_interleave(router.shape[0] // n_group, dim=1)
        ids = choice.masked_fill(~keep, float("-inf") if bias is not None else 0.0).topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + norm_eps)
    if scaling != 1.0:
        weights = weights * scaling
    return ids, weights.to(x.dtype)


def kernel_route(ext, x: torch.Tensor, router: torch.Tensor, args: tuple) -> tuple | None:
    """``topk_route`` (args: what follows x and the router) through a CPU extension's router
    kernel (``CpuKernels``, ``Avx2Kernels``, and their decode plans); None where the kernel does
    not take these inputs (CPU bf16 rows, a float32 or bf16 router, a float32 bias)."""
    n_group, topk_group, bias = args[5], args[6], args[7]
    check_route_groups(router.shape[0], n_group, topk_group)
    if (
        x.dtype is not torch.bfloat16
        or x.device.type != "cpu"
        or router.dtype not in (torch.float32, torch.bfloat16)
        or x.dim() != 2
        or (bias is not None and bias.dtype is not torch.float32)
    ):
        return None
    return tuple(ext.route_topk(x, router, *args))


def kernel_argmax(ext, logits: torch.Tensor) -> torch.Tensor | None:
    """Greedy sampling through a CPU extension's ``argmax_rows`` (torch's argmax of the float32
    values: the first of equal maxima, a row's first NaN); None where it does not take them."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    return ext.argmax_rows(logits)


def prefill_rows_as_decodes(chunk, block_size: int) -> AttentionMetadata:
    """A prefill chunk's queries as decode rows (``prefill_attention`` on the CPU kernels): row i
    attends over the context up to its position, through the request's block table."""
    n, ctx = chunk.num_tokens, chunk.context_len
    blocks = (ctx + block_size - 1) // block_size
    return AttentionMetadata(
        slot_mapping=chunk.block_table[:0],
        num_decode_tokens=n,
        decode_block_tables=chunk.block_table[:blocks].expand(n, blocks),
        decode_context_lens=torch.arange(ctx - n + 1, ctx + 1),
    )


class TorchKernels:
    name = "torch"
    ext = None  # the CPU extension a subclass calls (CpuKernels, Avx2Kernels); None: torch alone
    # Prompt chunks of at most this many tokens run as decode rows (each row a query over its
    # context up to itself), batched in the step's one decode-attention call, instead of
    # through prefill attention per chunk (0: never; the runner asks, ``worker/runner.py``).
    short_chunk_rows = 0
    # Host seconds spent in matmul / grouped_matmul since the last take_matmul_s(): the
    # telemetry's matmul share of a step (meaningful where kernels run synchronously: CPU).
    matmul_s = 0.0

    def take_matmul_s(self) -> float:
        spent, self.matmul_s = self.matmul_s, 0.0
        return spent

    def take_step_parts(self) -> dict[str, float]:
        """Seconds by kind of op since the last call, where the kernels time them (the CPU
        extensions: ``csrc/step_parts.h``): the decode plans' attention, norms, ``rope_kv``,
        activation, MoE routing and combine, greedy sampling, and inside the matmuls' time the
        block-format matmul's ``matmul_setup`` and ``matmul_wait``. Empty without an extension."""
        return {} if self.ext is None else dict(self.ext.take_step_parts())

    def matmul(self, x: torch.Tensor, layer: Linear, rows: slice | None = None) -> torch.Tensor:
        """x @ W^T (+ b) in whatever form the layer's method holds W (``linear``), timed.

        ``rows``: only those output rows (one expert of a stacked layer, which has no bias)."""
        start = time.perf_counter()
        y = self.linear(x, layer, rows)
        self.matmul_s += time.perf_counter() - start
        return y

    def grouped_matmul(self, x: torch.Tensor, layer, counts: list[int]) -> torch.Tensor:
        """A stacked-expert layer (``ExpertLinear``) on rows sorted by expert: the first
        counts[0] rows through expert 0's rows of W, the next counts[1] through expert 1's, ...
        An expert with no rows is never read. Timed, as ``matmul``."""
        start = time.perf_counter()
        y = self.grouped_linear(x, layer, counts)
        self.matmul_s += time.perf_counter() - start
        return y

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor | Linear) -> torch.Tensor:
        """x (D, H, K) through a matrix per head -> (D, H, N): MLA's absorbed W_uk (into the
        query) and W_uv^T (out of the latent). ``w`` is dense (H, K, N), or a stacked per-head
        layer (``ExpertLinear``: head h's N x K matrix at ``expert_rows(h)``) in its format.
        Timed, as ``matmul``."""
        start = time.perf_counter()
        y = self.head_linear(x, w)
        self.matmul_s += time.perf_counter() - start
        return y

    # What subclasses override: the untimed matmuls.
    def linear(self, x: torch.Tensor, layer: Linear, rows: slice | None = None) -> torch.Tensor:
        """``matmul``, here through the layer method's torch reference."""
        if layer.parts is not None and rows is None:
            return self.linear_parts(x, layer)
        if rows is not None:
            return layer.method.apply_rows(layer, x, rows)
        return layer.method.apply(layer, x)

    def head_linear(self, x: torch.Tensor, w: torch.Tensor | Linear) -> torch.Tensor:
        """``head_matmul``, here torch's batched matmul; a stacked per-head layer through
        ``grouped_linear``, each head's rows its "expert's"."""
        if isinstance(w, Linear):
            rows, heads, k = x.shape
            y = self.grouped_linear(x.transpose(0, 1).reshape(heads * rows, k), w, [rows] * heads)
            return y.view(heads, rows, -1).transpose(0, 1)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)

    def linear_parts(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        """A layer whose shards keep different formats (``ShardedLinearMethod``): one matmul per
        part, outputs side by side, then the layer's bias."""
        return layer.method.join(layer, [self.linear(x, part) for part in layer.parts])

    def grouped_linear(self, x: torch.Tensor, layer, counts: list[int]) -> torch.Tensor:
        """``grouped_matmul``, here one ``linear`` per expert."""
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(self.linear(x[start : start + count], layer, layer.expert_rows(expert)))
                start += count
        return torch.cat(outputs) if outputs else x.new_empty(0, layer.rows_per_expert)

    def takes_format(self, fmt: BlockFormat) -> bool:
        """Whether this kernel set's own GEMM runs layers of block format ``fmt`` on CPU (else
        the method's torch reference dequantizes the weight)."""
        return False

    # Repacking, asked for by each layer's method once its weights are loaded. These kernels
    # keep every format as loaded (None: not repacked).
    def pack_dense(self, weight: torch.Tensor) -> torch.Tensor | None:
        return None

    def pack_blocks(self, fmt: BlockFormat, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
        return None

    def place_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight these kernels read as loaded (not repacked), where they read it best: here
        the tensor itself."""
        return weight

    def rope_state(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
        """Per-step RoPE inputs, shared by every layer: the gathered (cos, sin) rows."""
        return rotary(positions, dtype)

    def rope(self, x: torch.Tensor, state) -> torch.Tensor:
        """x: (T, H, D) -> rotated (may be x itself, rotated in place)."""
        cos, sin = state
        return x * cos + rotate_half(x) * sin

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place); return rms_norm(residual)."""
        residual.add_(x)
        return F.rms_norm(residual, weight.shape, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    # An MoE's routing, greedy or group-limited: (T, k) expert ids, best first, and their
    # weights in x's dtype (the torch reference; the CPU kernels fuse it)
    route_topk = staticmethod(topk_route)
    # Whether route_topk reads a bf16 router as it reads a float32 one (Router.for_kernels
    # stores a bf16-exact router so); torch's converts it to float32 every call
    reads_bf16_router = False

    def apply_token_bitmask_(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Structured output: the tokens a row's grammar does not allow get -inf, in place.
        ``bitmask`` (rows, words) int32: bit j of word w allows token 32 w + j; tokens past
        its words are disallowed."""
        rows, vocab = logits.shape
        bitmask = bitmask.to(logits.device)
        allowed = (bitmask.unsqueeze(-1) & _BIT_VALUES.to(logits.device)) != 0  # (rows, words, 32)
        allowed = allowed.view(rows, -1)[:, :vocab]
        logits[:, : allowed.shape[1]].masked_fill_(~allowed, float("-inf"))
        logits[:, allowed.shape[1] :] = float("-inf")

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling: (rows, V) logits -> (rows,) int64, each row's index of its largest
        value (the first of equal maxima; a row with a NaN gives its first NaN). Over float32:
        bf16 widens exactly, and torch's CPU argmax of a bf16 32k-token row took ~115 us, of
        float32 ~30."""
        return (logits if logits.dtype is torch.float32 else logits.float()).argmax(dim=-1)

    def write_kv(self, cache: PagedKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k/v (T, Hkv, Dh) of this step's tokens into the pools at flat ``slots``."""
        write_kv(cache, k, v, slots)

    def rope_write_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cache: PagedKV, meta, rope) -> bool:
        """RoPE and the KV write in one op, where the kernels fuse them: qkv (T, (Hq + 2 Hkv)
        Dh), its q and k heads rotated in place and k and v written at ``meta.slot_mapping``;
        False (nothing done): the caller runs ``rope`` and ``write_kv``."""
        return False

    def decode_attention(
        self, q, cache: PagedKV, meta: AttentionMetadata, scale: float | None = None, value_dim: int | None = None
    ) -> torch.Tensor:
        """q: (D, Hq, Dh), one query per sequence over its paged context -> (D, Hq, Dh), or
        (D, Hq, value_dim): the first ``value_dim`` dims of each value only (MLA's latent: r of
        its r + p).

        ``scale`` multiplies the scores (default Dh ** -0.5)."""
        num_seqs, num_heads, head_dim = q.shape
        scale = head_dim**-0.5 if scale is None else scale
        keys, values = gather_values(cache, meta.decode_block_tables, q.dtype)  # (D, L, Hkv, Dh), dequantized
        num_kv_heads = keys.shape[2]
        # GQA without copying K/V: the G query heads of a group share one K/V head.
        #   q (D, Hkv, G, Dh) @ K^T (D, Hkv, Dh, L) -> scores (D, Hkv, G, L)
        qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * scale
        if meta.decode_mask is None:  # built by the first layer, shared by the rest of the step
            meta.decode_mask = decode_valid_mask(meta.decode_context_lens, keys.shape[1])
        scores.masked_fill_(~meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        # Slots past a context were never written (the pool is not zero-filled): a weight of 0
        # times a stale NaN would still be NaN, so the gathered copy is zeroed there.
        values = values[..., :value_dim]
        values.masked_fill_(~meta.decode_mask.view(num_seqs, -1, 1, 1), 0)
        out = torch.matmul(probs, values.transpose(1, 2))  # (D, Hkv, G, Dv)
        return out.reshape(num_seqs, num_heads, values.shape[-1])

    def prefill_attention(self, q, k, v, cache: PagedKV, chunk: PrefillChunk) -> torch.Tensor:
        """A prefill chunk's queries (n, Hq, Dh) over its request's context, the chunk's own K/V
        already in the cache -> (n, Hq, Dh): torch's scaled_dot_product_attention."""
        return prefill_attention(q, k, v, cache, chunk)

    def prefill_attention_all(self, q, cache: PagedKV, meta: AttentionMetadata, out: torch.Tensor) -> bool:
        """Every prefill chunk of the step in one call, into ``out``'s rows of each chunk (q, out:
        the step's flat (T, Hq, Dh)); False where these kernels run them one by one."""
        return False

    # A decode step's layers in one call (``CpuKernels``, ``Avx2Kernels``): a model fills the
    # plan once with what each layer holds; these kernels have none (None: run op by op).
    def decode_plan(self):
        return None

    def plan_takes_cache(self, cache: PagedKV, head_dim: int) -> bool:
        """Whether a decode plan's Llama attention reads ``cache`` (heads of ``head_dim``) with
        the kernel decode_attention would run on it."""
        return False

    def plan_takes_latent_cache(self, cache: PagedKV) -> bool:
        """Whether a decode plan's latent attention (one vector a token, K and V alike) reads
        ``cache`` with the kernel decode_attention would run on it (the model's own checks
        aside: ``DeepseekAttention.add_to_plan``)."""
        return True

    def plan_linear(self, layer: Linear) -> tuple[list, torch.Tensor | None] | None:
        """``layer`` as a decode plan takes it: its packed parts (weight, format code, rows)
        and its bias; None where this layer is not packed for these kernels."""
        return None

    def plan_experts(self, layer) -> tuple[torch.Tensor, int, int] | None:
        """A stacked-expert layer as a decode plan takes it: (packed, format code, rows per expert)."""
        return None

    def absorbed_heads(self, w: torch.Tensor) -> torch.Tensor | Linear:
        """Dense per-head matrices (H, K, N) as ``head_linear`` is to run them: here as they are
        (torch's batched matmul)."""
        return w

    def plan_heads(self, w: torch.Tensor | Linear) -> tuple[torch.Tensor, int, int] | None:
        """``head_matmul``'s per-head matrices as a decode plan takes them: (the dense bf16 (H,
        K, N), -1, N) or (a stacked layer's packed blocks, format code, N); None where
        head_linear would not run them in one call."""
        return None


class Avx2Kernels(TorchKernels):
    """A CPU with AVX2 but not AVX-512 BF16 (AMD Zen 2-3, Intel's client cores).

    - The matmuls of block-format layers run ``csrc/avx2_blocks.cpp`` on the GGUF bytes the
      layer holds, every format of ``formats.FORMATS``. (Torch's reference would dequantize
      the whole weight to float32 on every call: 8 bytes read and written a weight where a
      Q4_K_M file holds 0.6.) Every format but Q6_K (``AVX2_PACKED_FORMATS``: Q8_0, Q4_0, Q4_1,
      IQ4_NL, Q4_K, Q5_K, IQ4_XS, Q3_K and Q2_K) is repacked at load, at its size, into blocks
      of 8 rows whose codes put a row in each int32 lane (``repack_rows``), where the layer's
      rows are a multiple of 8; Q6_K stays as loaded (and the kernel packs its blocks of 8 rows
      as it goes in calls of 8 rows or more: a batch of 8 sequences, a prefill). Every weight
      they stream lies in 2 MiB pages (``place_weight``).
    - A decode step's other ops in float32 or bfloat16 run ``csrc/avx2_ops.cpp``: RMSNorm (with
      the residual add), SiLU-and-multiply, RoPE, and decode attention from the paged cache (an
      fp8 one's codes dequantized in registers as rows are read; over an int8 one the AVX-512
      kernel's formula: the query in int8 per group, integer dot products). Each other op
      rounds where torch's op rounds.
    - Dense bf16 layers run ``csrc/avx2_dense.cpp``: below 16 rows (decode) the weight
      streamed once for up to 4 rows at a time, from 16 rows (prefill) tiles of 4 rows of x
      and 3 of W, the weight widened in registers either way. Without AVX-512 BF16 torch's bf16
      GEMM is a slow path (9.4 GB/s on one row, 11.5x one row's time on 23), and its float32
      GEMM on the weight widened a slice at a time, which prefill ran until stop 82, spent a
      third of its time widening and repacking the weight (Zen 3, 128-token prefill of the bf16
      file: 1.45x since).
    - An MoE's top-k routing runs ``csrc/avx2_ops.cpp``'s ``route_topk`` (the AVX-512 router
      kernel's arithmetic on 8 lanes); each expert's rows run ``linear`` on its slice.
    - MLA's absorbed per-head matrices are stacked layers (``plan_heads``, ``absorbed_heads``):
      each head's rows through ``linear``, in their block format or as bf16 rows.
    - Prefill attention runs each query as a decode of its own through the decode attention
      kernel (``prefill_attention``), as ``CpuKernels`` does; greedy sampling's argmax and
      structured output's token mask are one call each.
    - Everything else (other dense matmuls, a quantized cache's writes) is torch's."""

    name = "avx2"
    packed_row_block = 8  # rows pack 8 at a time
    reads_bf16_router = True

    def __init__(self, ext) -> None:
        self.ext = ext

    def linear(self, x, layer, rows=None):
        if layer.parts is not None and rows is None:
            return self.linear_parts(x, layer)
        fmt = layer.method.format
        if fmt is None and self._dense_bf16(x, layer):
            if rows is not None:  # one expert's rows of a stacked layer (no bias)
                return self.ext.linear_bf16(x, layer.weight[rows], None)
            return self.ext.linear_bf16(x, layer.weight, layer.bias)
        packed = layer.packed is not None and isinstance(layer.unpacker, Avx2Kernels)  # in blocks of 8 rows
        if (
            fmt is None
            or (layer.packed is not None and not packed)
            or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.bfloat16)
            or not self.ext.supports_format(fmt.ggml_type)
        ):
            return super().linear(x, layer, rows)
        run = self.ext.linear_blocks_packed if packed else self.ext.linear_blocks
        blocks = layer.packed if packed else layer.blocks
        if rows is not None:  # one expert's rows of a stacked layer (no bias)
            if not packed:
                return run(x, blocks[rows], fmt.ggml_type, None)
            step = self.packed_row_block
            if rows.start % step or rows.stop % step:
                return super().linear(x, layer, rows)
            return run(x, blocks[rows.start // step : rows.stop // step], fmt.ggml_type, None)
        return run(x, blocks, fmt.ggml_type, layer.bias)

    def takes_format(self, fmt):
        return self.ext.supports_format(fmt.ggml_type)

    def pack_blocks(self, fmt, blocks, n, k):
        """CPU rows of an ``AVX2_PACKED_FORMATS`` format, n a multiple of 8, into blocks of 8 rows
        (``csrc/avx2_blocks.cpp``'s ``repack_rows``: the same bytes, (n / 8, 8 row_bytes))."""
        step = self.packed_row_block
        if fmt.name not in AVX2_PACKED_FORMATS or blocks.device.type != "cpu" or blocks.numel() == 0 or n % step:
            return None
        return self.ext.repack_rows(blocks, fmt.ggml_type, True)

    def unpack_blocks(self, fmt, packed, n, k):
        return self.ext.repack_rows(packed, fmt.ggml_type, False)[:n]

    def place_weight(self, weight):
        """A copy in 2 MiB pages (``csrc/weight_arena.h``, where the blocks of 8 rows are packed
        too) of a CPU weight of 64 KiB or more. Streamed through 4 KiB pages, a decode step's
        weights miss the TLB every 64 lines, and these kernels' fetches ahead do not hide it
        (the AVX-512 kernels' packed weights were in 2 MiB pages from the start). The same bytes
        in either pages alternated in one process, 2-core Intel Xeon running the AVX2 kernels,
        2026-12-02, 22 TinyLlama-1.1B layers from memory, 2 threads: one row bf16 1.48x, Q6_K
        1.41x, Q8_0 1.05x; 4 rows 1.32x, 1.09x, 1.15x. Whole files, loaded twice in one process,
        5 alternated rounds of batch-1 decode: bf16 1.29x, Q6_K 1.29x, Q8_0 1.02x, Q4_K_M 1.02x."""
        if weight.device.type != "cpu":
            return weight
        return self.ext.huge_page_copy(weight)  # a weight under 64 KiB (kMinCarve) stays itself

    @staticmethod
    def _dense_bf16(x, layer) -> bool:
        """A dense bf16 layer on bf16 rows, its weight as loaded (not repacked)."""
        return (
            x.dtype is torch.bfloat16
            and x.device.type == "cpu"
            and isinstance(layer.method, UnquantizedLinearMethod)
            and layer.packed is None
            and layer.weight.dtype is torch.bfloat16
            and layer.weight.numel() > 0
        )

    def decode_plan(self):
        """An empty ``DecodePlan`` (``csrc/avx2_plan.cpp``): a bf16 decode step's Llama layers
        with dense MLPs or MoEs, over a bf16, int8 or fp8 cache, in one call through the kernels below,
        on the views and in the order the model's Python forward uses (so with its results, bit
        for bit). Its ``run`` declines a step (None) where this class would send a dense layer
        or decode attention to torch."""
        return self.ext.DecodePlan(MANY_HEADS_PER_KV_HEAD)

    def plan_takes_cache(self, cache, head_dim):
        return cache.v is not cache.k and self._plan_reads(cache, head_dim)

    def plan_takes_latent_cache(self, cache):
        return self._plan_reads(cache, cache.k.shape[-1])

    def _plan_reads(self, cache, head_dim) -> bool:
        """Whether the plan's attention reads this pool (a bf16 one, or codes _reads_codes takes)."""
        return self._reads_codes(cache, head_dim) if cache.quantized else cache.k.dtype is torch.bfloat16

    def plan_linear(self, layer):
        """Each part of ``layer`` as ``linear`` runs it: (weight, -1, rows) for a dense bf16
        one, (GGUF rows or blocks of 8 rows, GGUF type, rows) for a block format; None where
        ``linear`` would hand a part to torch."""
        parts = layer.parts if layer.parts is not None else (layer,)
        planned = []
        for part in parts:
            if part.parts is not None or (layer.parts is not None and part.bias is not None):
                return None
            weight = self._planned_weight(part)
            if weight is None:
                return None
            planned.append((*weight, part.out_features))
        return planned, layer.bias

    def plan_experts(self, layer):
        """A stacked-expert layer as ``grouped_linear`` runs it, one expert's rows at a time through
        ``linear``: (the dense bf16 weight, -1, rows per expert), (blocks of 8 rows or GGUF rows,
        GGUF type, rows per expert); None where ``linear`` would hand an expert's rows to torch."""
        n = layer.rows_per_expert
        if layer.packed is not None and n % self.packed_row_block:  # an expert's rows: not whole blocks
            return None
        weight = self._planned_weight(layer)
        return None if weight is None else (*weight, n)

    def absorbed_heads(self, w):
        """bf16 per-head matrices (H, K, N) as a stacked layer of each head's N rows over K, so
        that ``head_linear`` runs each head through ``linear`` (the dense kernel: the weight
        streamed once, sums in float32, one rounding) and a decode plan can hold them; torch's
        batched bf16 matmul is a slow path without AVX-512 BF16."""
        if w.dtype is not torch.bfloat16 or w.device.type != "cpu" or w.dim() != 3:
            return w
        heads, k, n = w.shape
        layer = ExpertLinear(heads, k, [n], method=UnquantizedLinearMethod())
        layer.weight.data = w.transpose(1, 2).reshape(heads * n, k).contiguous()
        layer.method.process_weights_after_loading(layer, self)
        return layer

    def plan_heads(self, w):
        """MLA's per-head matrices as ``head_linear`` runs a stacked layer (``grouped_linear``:
        each head's rows an expert's), so ``plan_experts``'s form: a block format read at its
        own size, or bf16 rows (``absorbed_heads``); None for dense (H, K, N) ones."""
        return self.plan_experts(w) if isinstance(w, Linear) else None

    def _planned_weight(self, layer) -> tuple[torch.Tensor, int] | None:
        """The weight ``linear`` runs for this (unsharded) layer and its code: the dense bf16
        weight and -1, or its GGUF rows or blocks of 8 rows and GGUF type; None where ``linear``
        hands it to torch."""
        fmt = layer.method.format
        if fmt is None:  # dense: bf16 as loaded
            dense = isinstance(layer.method, UnquantizedLinearMethod) and layer.packed is None
            if not dense or layer.weight.dtype is not torch.bfloat16 or layer.weight.numel() == 0:
                return None
            weight, code = layer.weight, -1
        elif layer.packed is not None and isinstance(layer.unpacker, Avx2Kernels):
            weight, code = layer.packed, fmt.ggml_type
        elif layer.packed is None and self.ext.supports_format(fmt.ggml_type):
            weight, code = layer.blocks, fmt.ggml_type
        else:
            return None
        if weight.device.type != "cpu" or not weight.is_contiguous():
            return None
        return weight, code

    def apply_token_bitmask_(self, logits, bitmask):
        """Structured output's mask in one call (``csrc/avx2_ops.cpp``)."""
        if logits.device.type != "cpu" or not logits.is_contiguous():
            return super().apply_token_bitmask_(logits, bitmask)
        self.ext.apply_token_bitmask_(logits, bitmask.contiguous())

    def argmax(self, logits):
        """Greedy sampling in one call (``csrc/avx2_ops.cpp``'s ``argmax_rows``, which the decode
        plan's greedy runs call too)."""
        best = kernel_argmax(self.ext, logits)
        return best if best is not None else super().argmax(logits)

    def route_topk(self, x, router, top_k, softmax, norm_topk, norm_eps, scaling, n_group=1, topk_group=1, bias=None):
        """``topk_route`` in one call (``csrc/avx2_ops.cpp``), which the decode plan calls too."""
        args = (top_k, softmax, norm_topk, norm_eps, scaling, n_group, topk_group, bias)
        return kernel_route(self.ext, x, router, args) or super().route_topk(x, router, *args)

    def rope_state(self, rotary, positions, dtype):
        return positions, rotary.cos, rotary.sin

    @staticmethod
    def _rope_takes(dtype, head_dim, cos) -> bool:
        """Whether ``rope_`` rotates heads of this dtype and size with these tables (full-width
        float32 ones)."""
        return (
            dtype in (torch.float32, torch.bfloat16)
            and head_dim % 16 == 0
            and cos.dtype is torch.float32
            and cos.shape[-1] == head_dim
        )

    def rope(self, x, state):
        positions, cos, sin = state
        if (
            x.dim() != 3
            or x.stride(-1) != 1
            or x.stride(1) != x.shape[2]
            or not self._rope_takes(x.dtype, x.shape[2], cos)
        ):
            return super().rope(x, (cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)))
        self.ext.rope_(x, positions, cos, sin)
        return x

    def rope_write_kv(self, qkv, num_heads, num_kv_heads, cache, meta, rope):
        # one call for RoPE and both pools' writes (three ran, the writes ~70 us a layer through
        # index_copy_), where rope_ takes the heads and the cache holds qkv's dtype (a quantized
        # cache keeps write_kv's quantize)
        positions, cos, sin = rope
        head_dim = cache.k.shape[-1]
        if (
            cache.quantized
            or cache.v is cache.k
            or not self._rope_takes(qkv.dtype, head_dim, cos)
            or cache.k.dtype is not qkv.dtype
            or qkv.dim() != 2
            or qkv.stride(-1) != 1
            or qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim
            or not (cache.k.is_contiguous() and cache.v.is_contiguous())
        ):
            return False
        self.ext.rope_write_kv_(qkv, num_heads, num_kv_heads, positions, cos, sin, cache.k, cache.v, meta.slot_mapping)
        return True

    def _norm_args_ok(self, x, weight) -> bool:
        return x.dtype in (torch.float32, torch.bfloat16) and weight.dtype is x.dtype and weight.is_contiguous()

    def rms_norm(self, x, weight, eps):
        if not self._norm_args_ok(x, weight):
            return super().rms_norm(x, weight, eps)
        return self.ext.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if not self._norm_args_ok(x, weight) or residual.dtype is not x.dtype or not residual.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        return self.ext.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up):
        if gate_up.dtype not in (torch.float32, torch.bfloat16):
            return super().silu_mul(gate_up)
        return self.ext.silu_mul(gate_up)

    def prefill_attention(self, q, k, v, cache, chunk):
        """Each query of the chunk as a decode of its own over the context up to its position
        (the chunk's K/V are in the pool), through ``decode_attention``'s kernel, as
        ``CpuKernels.prefill_attention`` runs the AVX-512 one: a query's output depends on its
        position and the cached K/V only (one chunk or several, a prefix hit or a recompute
        compute the same), and no (n, ctx) score tensors are made. Torch's math path, which ran
        before, took 28-35% of a 512-token Q4_K_M prefill on these kernels (1.35-1.7 s of 4.8;
        2-core Zen 5 running them, 2026-12-02)."""
        head_dim = q.shape[-1]
        shared = cache.v.data_ptr() == cache.k.data_ptr()
        if q.dtype not in (torch.float32, torch.bfloat16) or shared or cache.v.shape[-1] != head_dim:
            return super().prefill_attention(q, k, v, cache, chunk)
        return self.decode_attention(q, cache, prefill_rows_as_decodes(chunk, cache.k.shape[1]))

    def decode_attention(self, q, cache, meta, scale=None, value_dim=None):
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = cache.k.shape[2]
        # the kernel's jobs: a (sequence, KV head) each, its query heads split in runs of 8+
        # where those are fewer than the threads (MLA's one latent at batch 1: two runs of 8+)
        few_jobs = self.ext.decode_attention_jobs(num_seqs, num_heads, num_kv_heads) < torch.get_num_threads()
        latent = cache.v.data_ptr() == cache.k.data_ptr()  # MLA: K and V one pool
        if (
            q.dtype not in (torch.float32, torch.bfloat16)
            or not (self._reads_codes(cache, head_dim) if cache.quantized else cache.k.dtype is q.dtype)
            or head_dim % 8
            # many heads on one KV head and fewer jobs than threads: torch's batched GEMMs over
            # the gathered copy keep every core busy, the kernel would not. Not for a latent
            # pool, which torch's path gathers twice (as K and as V) and whose steps the decode
            # plan holds (the plan's decline follows this test)
            or (not latent and num_heads // num_kv_heads >= MANY_HEADS_PER_KV_HEAD and few_jobs)
        ):
            return super().decode_attention(q, cache, meta, scale, value_dim)
        scale = head_dim**-0.5 if scale is None else scale
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if cache.quantized:  # codes dequantized in registers as each row is read
            out = self.ext.paged_decode_attention_quant(
                q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables, lens, scale, cache.kind == "fp8"
            )
        else:
            out = self.ext.paged_decode_attention(q, cache.k, cache.v, tables, lens, scale)
        return out if value_dim is None else out[..., :value_dim]

    @staticmethod
    def _reads_codes(cache, head_dim) -> bool:
        """Whether paged_decode_attention_quant reads this int8 / fp8 cache: fp16 scales of one
        group a head, or of groups of a power of two dims (8 or more)."""
        groups = cache.k_scale.shape[-1]
        width = head_dim // groups
        return (
            cache.kind in ("int8", "fp8")
            and cache.k_scale.dtype is torch.float16
            and cache.k.is_contiguous()
            and cache.v.is_contiguous()
            and cache.k.shape == cache.v.shape
            and (groups == 1 or (head_dim % groups == 0 and width >= 8 and width & (width - 1) == 0))
        )


class CpuKernels(TorchKernels):
    """ridge's extension on AVX-512 BF16 + VNNI CPUs: bf16 throughout, quantized weights in
    any dtype (integer dot products), float32 decode attention; anything else falls back to torch."""

    name = "ridge-cpu"
    reads_bf16_router = True

    def __init__(self, ext) -> None:
        self.ext = ext

    def linear(self, x: torch.Tensor, layer: Linear, rows: slice | None = None) -> torch.Tensor:
        # a layer held in parts has no packed weight of its own: the base class splits it, and
        # each part comes back here
        packed, fmt = layer.packed, layer.method.format
        if packed is None or packed.device != x.device:
            return super().linear(x, layer, rows)
        if not _takes(x, fmt):
            return super().linear(x, layer, rows)
        n, bias = layer.out_features, layer.bias
        if rows is not None:
            # one expert's rows of a stacked layer: a contiguous run of the packed row blocks
            if rows.start % PACKED_ROW_BLOCK or rows.stop % PACKED_ROW_BLOCK:
                return super().linear(x, layer, rows)
            packed = packed[rows.start // PACKED_ROW_BLOCK : rows.stop // PACKED_ROW_BLOCK]
            n, bias = rows.stop - rows.start, None
        if fmt is None:
            return self.ext.linear_bf16(x, packed, n, bias)
        return self.ext.linear_quant(x, packed, QUANT_KERNEL_CODES[fmt.name], n, bias)

    def head_linear(self, x, w):
        """Where the decode plan would take ``w`` (``plan_heads``), the same call: one for every
        head, each head's matrix read once."""
        planned = self.plan_heads(w)
        if planned is not None and _takes(x, w.method.format if isinstance(w, Linear) else None):
            weight, code, n = planned
            return self.ext.head_matmul_bf16(x, weight) if code < 0 else self.ext.head_matmul_quant(x, weight, code, n)
        return super().head_linear(x, w)

    def grouped_linear(self, x, layer, counts):
        """All of a layer's experts in one C++ call (the packed stacked tensor sliced per expert)."""
        packed, fmt, n = layer.packed, layer.method.format, layer.rows_per_expert
        if packed is None or packed.device != x.device or n % PACKED_ROW_BLOCK or not _takes(x, fmt):
            return super().grouped_linear(x, layer, counts)
        if fmt is None:
            return self.ext.linear_bf16_grouped(x, packed, n, counts)
        return self.ext.linear_quant_grouped(x, packed, QUANT_KERNEL_CODES[fmt.name], n, counts)

    def pack_dense(self, weight):
        """bf16 CPU weights into linear_bf16's blocks of 16 rows x 2 k."""
        if weight.dtype is not torch.bfloat16 or weight.device.type != "cpu" or weight.numel() == 0:
            return None
        return self.ext.pack_vnni(weight)

    def unpack_dense(self, packed, n, k):
        return self.ext.unpack_vnni(packed, n, k)

    def takes_format(self, fmt):
        return fmt.name in QUANT_KERNEL_CODES

    def pack_blocks(self, fmt, blocks, n, k):
        """GGUF blocks into linear_quant's blocks of 16 rows (any model dtype: x is quantized)."""
        if fmt.name not in QUANT_KERNEL_CODES or blocks.device.type != "cpu":
            return None
        return self.ext.pack_quant(blocks, QUANT_KERNEL_CODES[fmt.name], n, k)

    def unpack_blocks(self, fmt, packed, n, k):
        return self.ext.unpack_quant(packed, QUANT_KERNEL_CODES[fmt.name], n, k)

    def decode_plan(self):
        """An empty ``DecodePlan`` (``csrc/decode_layers.cpp``): a bf16 decode step's layers
        run in one call, through the kernels below, in the order and on the views the model's
        Python forward uses (so with its results, bit for bit)."""
        return self.ext.DecodePlan()

    def plan_takes_cache(self, cache, head_dim):
        # the int8 / fp8 kernel, or the bf16 one (heads up to 256)
        return cache.quantized or (cache.k.dtype is torch.bfloat16 and head_dim <= 256)

    def plan_linear(self, layer):
        parts = layer.parts if layer.parts is not None else (layer,)
        planned = []
        for part in parts:
            packed, fmt = part.packed, part.method.format
            if packed is None or packed.device.type != "cpu" or part.parts is not None:
                return None
            if fmt is not None and fmt.name not in QUANT_KERNEL_CODES:
                return None
            if layer.parts is not None and part.bias is not None:
                return None
            planned.append((packed, -1 if fmt is None else QUANT_KERNEL_CODES[fmt.name], part.out_features))
        return planned, layer.bias

    def plan_experts(self, layer):
        packed, fmt, n = layer.packed, layer.method.format, layer.rows_per_expert
        if packed is None or packed.device.type != "cpu" or n % PACKED_ROW_BLOCK:
            return None
        return packed, -1 if fmt is None else QUANT_KERNEL_CODES[fmt.name], n

    def plan_heads(self, w):
        if isinstance(w, Linear):
            fmt, n = w.method.format, w.rows_per_expert
            if w.packed is None or w.packed.device.type != "cpu" or fmt is None or n % PACKED_ROW_BLOCK:
                return None
            return w.packed, QUANT_KERNEL_CODES[fmt.name], n
        if w.dtype is not torch.bfloat16 or w.device.type != "cpu" or w.shape[-1] % 16:
            return None
        return w, -1, w.shape[-1]

    def rope_state(self, rotary, positions, dtype):
        return positions, rotary.cos, rotary.sin

    def rope(self, x, state):
        positions, cos, sin = state
        if x.dtype is not torch.bfloat16 or x.stride(-1) != 1 or x.stride(1) != x.shape[2]:
            return super().rope(x, (cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)))
        self.ext.rope_bf16_(x, positions, cos, sin)
        return x

    def rms_norm(self, x, weight, eps):
        if x.dtype is not torch.bfloat16:
            return super().rms_norm(x, weight, eps)
        return self.ext.rms_norm_bf16(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.dtype is not torch.bfloat16 or not residual.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        return self.ext.add_rms_norm_bf16(x, residual, weight, eps)

    def silu_mul(self, gate_up):
        if gate_up.dtype is not torch.bfloat16:
            return super().silu_mul(gate_up)
        return self.ext.silu_mul_bf16(gate_up)

    def route_topk(self, x, router, top_k, softmax, norm_topk, norm_eps, scaling, n_group=1, topk_group=1, bias=None):
        args = (top_k, softmax, norm_topk, norm_eps, scaling, n_group, topk_group, bias)
        return kernel_route(self.ext, x, router, args) or super().route_topk(x, router, *args)

    def argmax(self, logits):
        best = kernel_argmax(self.ext, logits)
        return best if best is not None else super().argmax(logits)

    def apply_token_bitmask_(self, logits, bitmask):
        if logits.device.type != "cpu" or not logits.is_contiguous():
            return super().apply_token_bitmask_(logits, bitmask)
        self.ext.apply_token_bitmask_(logits, bitmask.contiguous())

    def prefill_attention(self, q, k, v, cache, chunk):
        """bf16: each query of the chunk runs as a decode of its own over the context up to its
        position (the chunk's K/V are in the pool), through the decode kernel of the cache's
        kind (bf16, or int8/fp8 codes read as decode reads them). A query's output
        then depends on its position and the cached K/V only: a prompt in one chunk or several,
        prefix-cached or recomputed after a preemption, computes what a decode of that token
        computes. The kernel reads K/V from the pool without a gathered copy and without the math
        path's (n, ctx) score tensors: a 512-token prompt of TinyLlama's shape (32 heads, 4 KV
        heads, 2 threads) took 12.5 ms a layer, 54 through torch's math path, 16 through its flash
        kernel (which sums in blocks that depend on the chunk's length, so chunking shows)."""
        head_dim = q.shape[-1]
        k_cache = cache.k
        if q.dtype is not torch.bfloat16 or head_dim % 16:
            return super().prefill_attention(q, k, v, cache, chunk)
        if not cache.quantized and (head_dim > 256 or k_cache.dtype is not torch.bfloat16):
            return super().prefill_attention(q, k, v, cache, chunk)
        return self.decode_attention(q, cache, prefill_rows_as_decodes(chunk, k_cache.shape[1]))

    def decode_attention(self, q, cache, meta, scale=None, value_dim=None):
        head_dim = q.shape[-1]
        k_cache, v_cache = cache.k, cache.v
        if q.dtype not in (torch.bfloat16, torch.float32):
            return super().decode_attention(q, cache, meta, scale, value_dim)
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        scale = head_dim**-0.5 if scale is None else scale
        dv = head_dim if value_dim is None else value_dim
        shared = k_cache.shape[2] == 1 and v_cache.data_ptr() == k_cache.data_ptr()
        many_on_shared = shared and q.shape[1] >= SHARED_KV_MIN_HEADS and dv % 16 == 0
        if cache.quantized:  # codes and scales read from the pool, dequantized in registers
            if head_dim % 16:
                return super().decode_attention(q, cache, meta, scale, value_dim)
            if many_on_shared:  # MLA's latent in int8/fp8: heads in lanes, as below
                return self.ext.paged_decode_attention_shared_quant(
                    q, k_cache, cache.k_scale, tables, lens, scale, dv, cache.kind == "fp8"
                )
            out = self.ext.paged_decode_attention_quant(
                q, k_cache, v_cache, cache.k_scale, cache.v_scale, tables, lens, scale, cache.kind == "fp8"
            )
            return out[..., :dv]
        if many_on_shared and q.dtype is torch.bfloat16:
            # MLA's latent: every head on one cache vector, heads in a vector's lanes, the
            # context split over the threads (csrc/decode_attention_shared.cpp)
            return self.ext.paged_decode_attention_shared(q, k_cache, tables, lens, scale, dv)
        args = (q, k_cache, v_cache, tables, lens, scale)
        if q.dtype is torch.bfloat16 and head_dim % 16 == 0 and head_dim <= 256:
            return self.ext.paged_decode_attention_bf16(*args)[..., :dv]  # AVX-512, 16 lanes of a head at a time
        if q.shape[1] // k_cache.shape[2] >= MANY_HEADS_PER_KV_HEAD:
            # many heads on one KV vector (float32; bf16 below 16 heads): the generic kernel
            # runs one job per (sequence, KV head), a single thread at batch 1, while the torch
            # path's gathered copy feeds batched GEMMs (heads x context) on every core
            return super().decode_attention(q, cache, meta, scale, value_dim)
        return self.ext.paged_decode_attention(*args)[..., :dv]
