"""The model runner: a scheduler plan in, one forward pass, sampled tokens out.

It flattens the step's chunks into one batch (decode rows first: one-token chunks and
VERIFY runs), builds the attention
metadata from the block tables, runs the model, computes logits only at the rows that
sample, samples them, and verifies proposed tokens. Rows of the logits:

    [ R rows that sample one token | V rows of verify runs (1 + k each) | P prompt-logprob rows ]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ridge.engine.scheduler import ChunkKind, SchedulerOutput
from ridge.kv.cache import PagedKV
from ridge.kv.manager import KVCacheManager
from ridge.layers.attention import AttentionMetadata, PrefillChunk
from ridge.sampling import Sampler
from ridge.spec_decode.rejection import plain_greedy, verify, verify_greedy_batch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (R + V + P,) flat rows whose logits are needed (module docstring)
    sample_request_ids: list[str] = field(default_factory=list)  # the R that sample
    # verify runs: (request id, proposed tokens, their draft distributions or None); 1 + k rows each
    verify_runs: list[tuple[str, list[int], torch.Tensor | None]] = field(default_factory=list)
    # prompt logprobs: (request id, first prompt position predicted, rows) per chunk that asked;
    # the logits of position p give the logprob of prompt token p + 1
    prompt_spans: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class PromptLogprob:
    token: int
    logprob: float
    rank: int  # 1 = the most likely token at its position
    top: list[tuple[int, float]]  # the top-k (token, logprob), best first


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]]  # request id -> new tokens (one, or a verify run's 1 .. k + 1)
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]]  # where asked: (lp, top-k) per new token
    # where asked: request id -> (prompt position of the first entry, one entry per position)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    verified: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (proposed, accepted)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,  # the registry's interface (ridge/models/registry.py)
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
        verify_rows: list[int] = []
        verify_runs: list[tuple[str, list[int], torch.Tensor | None]] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[str, int, int]] = []
        for chunk in plan.chunks:
            req = chunk.request
            table = self.kv.block_table(req)
            start, end = chunk.start, chunk.end
            kind = chunk.kind
            if chunk.num_new_tokens == 1:  # a decode (or one prompt token): the common case, kept lean
                tokens.append(chunk.token_ids()[0])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table)
                decode_lens.append(end)
            elif kind is ChunkKind.VERIFY:
                # 1 + k decode rows of one sequence: row j sees the context up to its own
                # position (the step writes every row's K/V before attention), so the decode
                # kernel is causal across the run and each row computes what a plain decode
                # at that position computes.
                tokens.extend(chunk.token_ids())
                for pos in range(start, end):
                    positions.append(pos)
                    slots.append(table[pos // bs] * bs + pos % bs)
                    decode_tables.append(table)
                    decode_lens.append(pos + 1)
            else:  # PREFILL: a run of query rows, causal over the paged context
                row = len(tokens)
                tokens.extend(chunk.token_ids())
                positions.extend(range(start, end))
                slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
                prefills.append(
                    PrefillChunk(row, len(tokens), end, torch.tensor(table, dtype=torch.long, device=self.device))
                )
            if kind is ChunkKind.VERIFY:
                verify_rows.extend(range(len(tokens) - (end - start), len(tokens)))
                verify_runs.append((req.request_id, chunk.draft_token_ids, chunk.draft_probs))
            elif chunk.samples:
                sample_rows.append(len(tokens) - 1)
                sample_ids.append(req.request_id)
            last_scored = min(end, req.num_prompt_tokens - 1)  # position P - 1 predicts an output token
            if req.sampling_params.prompt_logprobs is not None and start < last_scored:
                first_row = len(tokens) - (end - start)
                prompt_spans.append((req.request_id, start + 1, last_scored - start))
                prompt_rows.extend(range(first_row, first_row + last_scored - start))

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
        return ForwardBatch(
            as_tensor(tokens),
            as_tensor(positions),
            meta,
            as_tensor(sample_rows + verify_rows + prompt_rows),
            sample_ids,
            verify_runs,
            prompt_spans,
        )

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        return self.model.compute_logits(hidden[batch.sample_rows])

    def run(self, plan: SchedulerOutput, requests_by_id: dict) -> RunnerOutput:
        batch = self.prepare(plan)
        logits = self.forward_logits(batch)
        num_sampled = len(batch.sample_request_ids)
        num_verify = sum(1 + len(drafts) for _, drafts, _ in batch.verify_runs)
        prompt_logprobs = self._prompt_logprobs(batch, logits[num_sampled + num_verify :], requests_by_id)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        if num_sampled:
            states = [requests_by_id[rid].sampling_state for rid in batch.sample_request_ids]
            out = self.sampler(logits[:num_sampled], states)
            for rid, token, lp, top in zip(batch.sample_request_ids, out.token_ids, out.logprobs, out.top_logprobs):
                sampled[rid] = [token]
                if lp is not None:
                    logprobs[rid] = [(lp, top or [])]
        verified = {}
        results, row = {}, num_sampled
        greedy_rows, greedy_runs = [], []
        for rid, drafts, draft_probs in batch.verify_runs:
            state = requests_by_id[rid].sampling_state
            rows = range(row, row + 1 + len(drafts))
            row += 1 + len(drafts)
            if plain_greedy(state):  # verified together below
                greedy_rows.extend(rows)
                greedy_runs.append((rid, drafts))
            else:
                results[rid] = verify(self.sampler, logits[rows.start : rows.stop], state, drafts, draft_probs)
        if greedy_runs:
            index = torch.tensor(greedy_rows, device=logits.device)
            batch_results = verify_greedy_batch(logits[index], [d for _, d in greedy_runs])
            results.update(zip([rid for rid, _ in greedy_runs], batch_results))
        for rid, drafts, _ in batch.verify_runs:
            result = results[rid]
            sampled[rid] = result.token_ids
            verified[rid] = (len(drafts), result.num_accepted)
            if result.logprobs is not None:
                logprobs[rid] = [(lp, top or []) for lp, top in result.logprobs]
        return RunnerOutput(sampled, logprobs, prompt_logprobs, verified)

    @staticmethod
    def _prompt_logprobs(batch: ForwardBatch, logits: torch.Tensor, requests_by_id: dict) -> dict:
        """Each asked-for prompt token's logprob under the raw distribution, its rank, the top-k."""
        if not batch.prompt_spans:
            return {}
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out, row = {}, 0
        for rid, first, count in batch.prompt_spans:
            req = requests_by_id[rid]
            k = req.sampling_params.prompt_logprobs
            rows = logprobs[row : row + count]
            targets = torch.tensor(req.prompt_token_ids[first : first + count], device=rows.device)
            chosen = rows.gather(1, targets[:, None])[:, 0]
            ranks = (rows > chosen[:, None]).sum(-1) + 1
            top_lp, top_ids = rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long())
            entries = [
                PromptLogprob(t, lp, rank, list(zip(ids, lps)))
                for t, lp, rank, ids, lps in zip(
                    targets.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist()
                )
            ]
            out[rid] = (first, entries)
            row += count
        return out
