"""``CudaKernels``: the GPU's ops, the fused Triton kernels of ``layers/triton_kernels.py``
where they apply and the torch reference (``TorchKernels``) elsewhere.

What it changes against the reference, op for op:
  * decode attention reads the pool through the block tables (no gathered copy), for the
    model dtype and int8/fp8 caches; DeepSeek's latent attention (``value_dim``) and shapes the
    kernel does not take stay on the reference;
  * in a CUDA graph's forward (``graph_mode``, set by ``worker/cuda_graphs.py`` while it
    captures): the KV write is one launch per pool that skips negative slots (the padding
    rows), and RMSNorm, the residual add with its norm, RoPE and SiLU-gating are one launch
    each; over a cache of the model's dtype, RoPE and both pools' writes are one launch
    together (``rope_write_kv``); a one-row step's dense matmuls take the Triton GEMV where
    ``tune_gemv`` timed it faster than cuBLAS. Outside graphs these stay torch's: a Triton
    launch costs ~80 us of host time on the H200 against ~5-10 for a torch op, which an eager
    (prefill) step pays per layer.

Every op here is a fixed sequence of launches with no host synchronization, so a decode step
over these kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import warnings

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from ridge.kv.cache import PagedKV
from ridge.layers import triton_kernels as tk
from ridge.layers.attention import AttentionMetadata, index_copy_rows, write_kv
from ridge.layers.kernels import TorchKernels


class RopeState:
    """A step's RoPE inputs: the float32 tables and the positions, read in the kernel; the
    gathered rows the reference needs are made only if an op falls back to it."""

    def __init__(self, rotary, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary, self.positions, self.dtype = rotary, positions, dtype
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gathered is None:
            self._gathered = self.rotary(self.positions, self.dtype)
        return self._gathered


GEMV_MARGIN = 0.02  # a Triton GEMV replaces cuBLAS's where it takes at most 98% of its time


def _dense_weight(layer) -> torch.Tensor | None:
    """The layer's weight where it is one dense matrix (no format, not repacked, not in parts)."""
    if layer.packed is not None or layer.method.format is not None or layer.parts is not None:
        return None
    weight = getattr(layer, "weight", None)
    if weight is None or weight.dim() != 2 or weight.numel() == 0 or not weight.is_floating_point():
        return None
    return weight


def _gemv_key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return (weight.shape[0], weight.shape[1], weight.dtype, bias is not None)


class CudaKernels(TorchKernels):
    name = "cuda"
    # A GPU runs prefill attention per chunk at ~0.26 ms of host time a layer (the H200, one
    # scaled_dot_product_attention with its mask); as decode rows, a draft's catch-up chunk or
    # a short prompt joins the step's one decode-attention launch, and a CUDA graph.
    short_chunk_rows = 16

    # True while a CUDA graph's forward runs (captured, or its padded buffers run eagerly)
    graph_mode = False

    def __init__(self, device: torch.device) -> None:
        self.failed: set[str] = set()
        # weight shape (N, K, dtype, bias) -> the Triton GEMV config a graph's one-row step
        # multiplies by (``tune_gemv``'s choice; absent: cuBLAS)
        self.gemv_configs: dict[tuple, tuple[int, int, int]] = {}
        # decode attention splits a row's context until about two programs per multiprocessor
        # run (a handful where there is no GPU: the interpreter's tests)
        if device.type == "cuda":
            self.programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.programs = 8

    # Kernels that have passed in Triton's interpreter but not yet run on a GPU (the block-format
    # matmul, the batched prefill attention, RoPE since its rotation became the jit helper it
    # shares with rope_write_kv_): one that fails to compile on this GPU warns once and leaves
    # its op to the reference from then on.
    def _guarded(self, name: str, fn, *args):
        if name in self.failed:
            return None
        try:
            return fn(*args)
        except (CompilationError, OutOfResources) as exc:
            self.failed.add(name)
            warnings.warn(f"ridge: the Triton kernel {name} failed on this GPU ({exc}); using torch ops", stacklevel=3)
            return None

    def write_kv(self, cache: PagedKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        write_kv(cache, k, v, slots, tk.write_rows if self.graph_mode else index_copy_rows)

    def rope_write_kv(self, qkv, num_heads, num_kv_heads, cache: PagedKV, meta: AttentionMetadata, rope: RopeState):
        # a graph's pure decode step over a cache of the model's dtype: one launch for RoPE and
        # both pools' writes, where three ran (the quantized caches keep write_kv's quantize)
        pure_decode = not meta.prefills and meta.num_decode_tokens == qkv.shape[0]
        if not self.graph_mode or not pure_decode or cache.quantized or cache.v is cache.k:
            return False
        rotary = rope.rotary
        args = (qkv, num_heads, num_kv_heads, rope.positions, rotary.cos, rotary.sin, cache.k, cache.v)
        return bool(self._guarded("rope_write_kv", tk.rope_write_kv_, *args, meta.slot_mapping))

    def decode_attention(
        self, q, cache: PagedKV, meta: AttentionMetadata, scale: float | None = None, value_dim: int | None = None
    ) -> torch.Tensor:
        if value_dim is not None or cache.v is cache.k or not tk.pool_attention_supported(q, cache.k):
            return super().decode_attention(q, cache, meta, scale, value_dim)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return tk.paged_decode_attention(
            q,
            cache.k,
            cache.v,
            cache.k_scale,
            cache.v_scale,
            cache.kind,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            self.programs,
        )

    # Block formats: Q8_0 and Q4_0 weights repacked at load (the same bytes, each row's scales
    # behind its codes) and multiplied by a Triton kernel that dequantizes tiles in registers;
    # the other formats stay on the reference (dequantized whole, every call).
    def pack_blocks(self, fmt, blocks, n, k):
        return tk.pack_blocks(fmt.name, blocks, n, k)

    def unpack_blocks(self, fmt, packed, n, k):
        return tk.unpack_blocks(fmt.name, packed, n, k)

    def linear(self, x, layer, rows=None):
        packed, fmt = layer.packed, layer.method.format
        if self.graph_mode and self.gemv_configs and rows is None and x.dim() == 2 and x.shape[0] == 1:
            weight = _dense_weight(layer)
            config = None if weight is None else self.gemv_configs.get(_gemv_key(weight, layer.bias))
            out = None if config is None else tk.dense_gemv(x, weight, layer.bias, config)
            if out is not None:
                return out
        if packed is not None and fmt is not None and packed.device == x.device and x.is_floating_point():
            n, bias = layer.out_features, layer.bias
            if rows is not None:  # one expert's rows of a stacked layer: its 16-row blocks
                if rows.start % tk.PACKED_ROWS or rows.stop % tk.PACKED_ROWS:
                    return super().linear(x, layer, rows)
                packed = packed[rows.start // tk.PACKED_ROWS : rows.stop // tk.PACKED_ROWS]
                n, bias = rows.stop - rows.start, None
            out = self._guarded("block_matmul", tk.block_matmul, x, packed, fmt.name, n, bias)
            if out is not None:
                return out
        return super().linear(x, layer, rows)

    # Prefill chunks run in one launch when a step has several of at most this many tokens: then
    # a scaled_dot_product_attention per chunk costs more host time than its work; one long
    # chunk is flash attention's (torch's kernel), where this simple kernel would be slower.
    batched_prefill_max_tokens = 256

    def prefill_attention_all(self, q, cache, meta, out):
        """The step's prefill chunks in one launch (``paged_prefill_attention``), not one
        ``scaled_dot_product_attention`` with its mask per chunk and layer."""
        chunks = meta.prefills
        if len(chunks) < 2 or max(c.num_tokens for c in chunks) > self.batched_prefill_max_tokens:
            return False
        if cache.v is cache.k or not tk.pool_attention_supported(q, cache.k) or not out.is_contiguous():
            return False
        if meta.prefill_index is None:  # built once per step, shared by every layer
            tiles, index = tk.prefill_index(
                [c.start for c in chunks], [c.num_tokens for c in chunks], [c.context_len for c in chunks], q.device
            )
            tables = torch.nn.utils.rnn.pad_sequence([c.block_table for c in chunks], batch_first=True)
            meta.prefill_index = (tiles, index, tables)
        tiles, index, tables = meta.prefill_index
        args = (q, out, cache.k, cache.v, cache.k_scale, cache.v_scale, cache.kind, tables, tiles, index)
        return self._guarded("paged_prefill_attention", tk.paged_prefill_attention, *args) is not None

    @torch.inference_mode()
    def tune_gemv(self, layers, rounds: int = 5) -> dict[tuple, dict]:
        """For each weight shape among ``layers``' dense weights: time torch's matmul (cuBLAS)
        and Triton's GEMV in each of ``tk.GEMV_CONFIGS`` on one row of x, each as a CUDA graph
        of one call per layer of that shape (together larger than the L2, as a step's are; a
        graph, as a step's launches are), alternated ``rounds`` times, and keep the fastest
        (cuBLAS unless a GEMV beats it by ``GEMV_MARGIN``): a graph's one-row steps then
        multiply by it (``gemv_configs``). Returns, per shape
        ``(N, K, dtype, bias)``, each candidate's best time in us (None: cuBLAS)."""
        groups: dict[tuple, list] = {}
        for layer in layers:
            weight = _dense_weight(layer)
            if weight is not None and weight.is_cuda:
                groups.setdefault(_gemv_key(weight, layer.bias), []).append((weight, layer.bias))
        report = {}
        for key, group in groups.items():
            x = torch.randn(1, key[1], dtype=key[2], device=group[0][0].device)

            def calls(config, group=group, x=x):
                for w, b in group:
                    if config is None:
                        torch.nn.functional.linear(x, w, b)
                    else:
                        tk.dense_gemv(x, w, b, config)

            graphs = []
            for config in (None, *tk.GEMV_CONFIGS):
                try:
                    calls(config)  # compiled outside the graph
                    torch.cuda.synchronize()
                except (CompilationError, OutOfResources):
                    continue
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    calls(config)
                graphs.append((config, graph))
            best = {config: float("inf") for config, _ in graphs}
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(rounds):
                for config, graph in graphs:
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    best[config] = min(best[config], start.elapsed_time(end) * 1e3 / len(group))
            del graphs
            choice = min(best, key=best.get)
            if best[choice] > (1.0 - GEMV_MARGIN) * best[None]:
                choice = None  # a tie (gate_up's 11264 rows, H200: 13.4 us either way) stays cuBLAS's
            if choice is None:
                self.gemv_configs.pop(key, None)
            else:
                self.gemv_configs[key] = choice
            report[key] = best
        return report

    def rope_state(self, rotary, positions, dtype):
        return RopeState(rotary, positions, dtype)

    def rope(self, x, state: RopeState):
        rotary = state.rotary
        if self.graph_mode and self._guarded("rope", tk.rope_, x, state.positions, rotary.cos, rotary.sin):
            return x
        return super().rope(x, state.gathered())

    def rms_norm(self, x, weight, eps):
        out = tk.rms_norm(x, weight, eps) if self.graph_mode else None
        return super().rms_norm(x, weight, eps) if out is None else out

    def add_rms_norm(self, x, residual, weight, eps):
        out = tk.add_rms_norm(x, residual, weight, eps) if self.graph_mode else None
        return super().add_rms_norm(x, residual, weight, eps) if out is None else out

    def silu_mul(self, gate_up):
        out = tk.silu_mul(gate_up) if self.graph_mode else None
        return super().silu_mul(gate_up) if out is None else out
