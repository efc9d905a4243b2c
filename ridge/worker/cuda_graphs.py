"""CUDA graphs for decode steps: the forward pass captured once per batch size, replayed.

A decode step on the GPU is a few hundred small kernels; launched one by one from Python they
cost ~15 ms whatever the model (README, "CUDA"). Captured in a graph they launch as one. A
graph replays fixed shapes from fixed addresses, so:

  * the inputs live in persistent buffers (``DecodeGraphs``): token ids, positions, slots,
    context lengths and block tables, sized for the largest captured batch and the longest
    sequence (``max_model_len``);
  * a step of ``n`` decode rows (one-token decodes and speculative verify runs alike) runs the
    graph of the smallest captured size ``>= n``, vLLM's default ladder (1, 2, 4, 8, 16, ...,
    up to twice ``max_num_seqs``, or ``max_num_seqs * (1 + k)`` when k tokens are speculated,
    at most 512); the padding rows have context length 0 and slot -1, so they read nothing and
    write nothing (``CudaKernels``' KV write skips them);
  * the kernels must be capturable: ``CudaKernels`` (no host synchronization, a fixed launch
    sequence), no tensor parallelism, no MoE layer (its routing counts rows on the host).

Prefill and mixed steps, larger batches and ``--enforce-eager`` run eagerly. Only the hidden
states come from the graph: the logits of the rows that sample are computed after it.

``capture=False`` runs the same padded forward from the same buffers without a graph: how the
CPU test suite checks the padding (``tests/worker/test_cuda_graphs.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ridge.kv.cache import PagedKV
from ridge.layers.attention import AttentionMetadata
from ridge.layers.linear import Linear

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, num_speculative_tokens: int = 0) -> list[int]:
    """vLLM's default ladder: 1, 2, 4, every 8 below 256, then every 16, up to the first size
    that holds twice ``max_num_seqs`` rows or, speculating k tokens, the ``max_num_seqs * (1 +
    k)`` rows of a step of verify runs (a draft's catch-up passes as many), at most 512."""
    cap = min(max(2, 1 + num_speculative_tokens) * max_num_seqs, MAX_CAPTURE_SIZE)
    ladder = (1, 2, 4, *range(8, 256, 8), *range(256, MAX_CAPTURE_SIZE + 1, 16))
    return [s for s in ladder if s < cap] + [next(s for s in ladder if s >= cap)]


def unsupported_reason(model, kernels) -> str | None:
    """Why this model's decode step cannot be captured (None: it can)."""
    from ridge.layers.cuda_kernels import CudaKernels
    from ridge.models.moe import SparseMoE

    if not isinstance(kernels, CudaKernels):
        return "the kernels are not ridge's CUDA kernels (--kernels torch, or no Triton)"
    if getattr(model, "tp", None) is not None and model.tp.enabled:
        return "tensor parallelism"
    if any(isinstance(m, SparseMoE) for m in model.modules()):
        return "a MoE layer (its routing counts rows on the host)"
    return None


@dataclass
class CaptureReport:
    sizes: list[int]
    seconds: float
    bytes: int  # device memory the graphs' pool took


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches: list[PagedKV],
        block_size: int,
        max_model_len: int,
        sizes: list[int],
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.capture_graphs = capture
        rows = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((rows, self.max_blocks), dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.replays = 0  # steps run through a graph (or, capture=False, its padded buffers)
        self.padding_rows = 0  # rows of those steps that were padding

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
        )
        kernels = self.model.kernels
        kernels.graph_mode = True  # the fused kernels, and the KV write that skips padding rows
        try:
            return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        finally:
            kernels.graph_mode = False

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture every size, largest first (the smaller ones reuse its memory pool). Each is
        run once before its capture, with every row padding (nothing read, nothing written), so
        the kernels are compiled for its shapes outside the graph."""
        if not self.capture_graphs:
            self.graphs = {size: (None, None) for size in self.sizes}
            return CaptureReport(list(self.sizes), 0.0, 0)
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        self.tune_gemv()
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        report = CaptureReport(
            list(self.sizes), time.perf_counter() - start, free_before - torch.cuda.mem_get_info()[0]
        )
        logger.info(
            "CUDA graphs: %d decode batch sizes (%d..%d) captured in %.1f s, %.0f MiB",
            len(report.sizes),
            report.sizes[0],
            report.sizes[-1],
            report.seconds,
            report.bytes / 2**20,
        )
        return report

    def tune_gemv(self) -> None:
        """Before a one-row graph is captured: the kernels choose, per weight shape of the
        layers (not the lm_head, which runs after the graph), between cuBLAS and Triton's GEMV
        by timing both (``CudaKernels.tune_gemv``); the choice is logged."""
        tune = getattr(self.model.kernels, "tune_gemv", None)  # CudaKernels only
        if tune is None or 1 not in self.sizes:
            return
        body = getattr(self.model, "model", self.model)
        kernels = self.model.kernels
        report = tune([m for m in body.modules() if isinstance(m, Linear)])
        lines = []
        for key, times in report.items():
            chosen = kernels.gemv_configs.get(key)  # the kernels' choice, margin and all
            name = "cuBLAS" if chosen is None else f"Triton {chosen}"
            lines.append(f"{key[0]}x{key[1]} {name} {times[chosen]:.1f} us (cuBLAS {times[None]:.1f})")
        if lines:
            logger.info("CUDA graphs: one-row matmuls: %s", "; ".join(lines))

    def takes(self, meta: AttentionMetadata, rows: int) -> bool:
        """Whether a step of ``rows`` flat tokens with this metadata replays a graph: decode
        rows only, at most the largest size, block tables no wider than the buffers'."""
        return (
            not meta.prefills
            and meta.num_decode_tokens == rows
            and 0 < rows <= self.sizes[-1]
            and meta.decode_block_tables.shape[1] <= self.max_blocks
        )

    def size_for(self, rows: int) -> int:
        return next(size for size in self.sizes if size >= rows)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states (rows, hidden), from the graph of the next size up; valid
        until the next run."""
        rows = input_ids.shape[0]
        size = self.size_for(rows)
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slots[:rows].copy_(meta.slot_mapping)
        self.slots[rows:size].fill_(-1)
        self.context_lens[:rows].copy_(meta.decode_context_lens)
        self.context_lens[rows:size].zero_()
        tables = meta.decode_block_tables
        self.block_tables[:rows, : tables.shape[1]].copy_(tables)
        graph, hidden = self.graphs[size]
        self.replays += 1
        self.padding_rows += size - rows
        if graph is None:  # capture=False: the same padded forward, eagerly
            return self._forward(size)[:rows]
        graph.replay()
        return hidden[:rows]
