"""The model runner: a scheduler plan in, one forward pass, sampled tokens out.

It flattens the step's chunks into one batch (decodes first), builds the attention
metadata from the block tables, runs the model, computes logits only at the rows that
sample, and samples them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ridge.engine.scheduler import SchedulerOutput
from ridge.kv.cache import PagedKV
from ridge.kv.manager import KVCacheManager
from ridge.layers.attention import AttentionMetadata, PrefillChunk
from ridge.models.llama import LlamaForCausalLM
from ridge.sampling import Sampler


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (R,) flat rows whose logits are needed
    sample_request_ids: list[str] = field(default_factory=list)


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]  # where asked: (sampled lp, top-k)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[PagedKV],
        kv: KVCacheManager,
        sampler: Sampler,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv = kv
        self.sampler = sampler
        self.device = device
        self.block_size = kv.block_size

    def prepare(self, plan: SchedulerOutput) -> ForwardBatch:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        for chunk in plan.chunks:
            req = chunk.request
            table = self.kv.block_table(req)
            start, end = chunk.start, chunk.end
            if end - start == 1:  # a decode (or a one-token chunk): the common case, kept lean
                tokens.append(req.all_token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                row = len(tokens)
                tokens.extend(req.all_token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
                prefills.append(
                    PrefillChunk(row, len(tokens), end, torch.tensor(table, dtype=torch.long, device=self.device))
                )
            if chunk.samples:
                sample_rows.append(len(tokens) - 1)
                sample_ids.append(req.request_id)

        def as_tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        meta = AttentionMetadata(slot_mapping=as_tensor(slots), num_decode_tokens=len(decode_tables), prefills=prefills)
        if decode_tables:
            width = max(map(len, decode_tables))
            padded = np.zeros((len(decode_tables), width), dtype=np.int64)
            for i, table in enumerate(decode_tables):
                padded[i, : len(table)] = table
            meta.decode_block_tables = torch.from_numpy(padded).to(self.device)
            meta.decode_context_lens = as_tensor(decode_lens)
        return ForwardBatch(as_tensor(tokens), as_tensor(positions), meta, as_tensor(sample_rows), sample_ids)

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        return self.model.compute_logits(hidden[batch.sample_rows])

    def run(self, plan: SchedulerOutput, requests_by_id: dict) -> RunnerOutput:
        batch = self.prepare(plan)
        if not batch.sample_request_ids:  # only partial prefill chunks: nothing to sample
            self.forward_logits(batch)
            return RunnerOutput({}, {})
        logits = self.forward_logits(batch)
        states = [requests_by_id[rid].sampling_state for rid in batch.sample_request_ids]
        out = self.sampler(logits, states)
        sampled = dict(zip(batch.sample_request_ids, out.token_ids))
        logprobs = {
            rid: (lp, top or [])
            for rid, lp, top in zip(batch.sample_request_ids, out.logprobs, out.top_logprobs)
            if lp is not None
        }
        return RunnerOutput(sampled, logprobs)
