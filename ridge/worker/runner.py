"""The model runner: a plan (``engine/step.py``) in, one forward pass (a multi-step plan's
several, ``_run_steps``), sampled tokens out.

It keeps its own state per request (``RunnerRequest``: token ids, block table, sampling
state), updated from each plan's deltas, flattens the step's chunks into one batch (decode
rows first: one-token chunks and VERIFY runs), builds the attention metadata from the block
tables, runs the model, computes logits only at the rows that sample, samples them, and
verifies proposed tokens. Rows of the logits:

    [ R rows that sample one token | V rows of verify runs (1 + k each) | P prompt-logprob rows ]

Only the driver samples (``sampler`` set): under tensor parallelism the other ranks run the
same forward pass (their shard) and return None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ridge.engine.step import ChunkKind, PromptLogprob, RunnerOutput, SchedulerOutput
from ridge.kv.cache import PagedKV
from ridge.layers.attention import AttentionMetadata, PrefillChunk
from ridge.sampling import PendingSample, Sampler, SamplerOutput, SamplingParams, SamplingState
from ridge.spec_decode.rejection import verify, verify_greedy_batch

__all__ = [
    "ChunkInput",
    "ForwardBatch",
    "LaunchedStep",
    "ModelRunner",
    "PromptLogprob",
    "RunnerOutput",
    "RunnerRequest",
]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (R + V + P,) flat rows whose logits are needed (module docstring)
    sample_request_ids: list[str] = field(default_factory=list)  # the R that sample
    # verify runs: (request id, proposed tokens); 1 + k rows each
    verify_runs: list[tuple[str, list[int]]] = field(default_factory=list)
    # prompt logprobs: (request id, first prompt position predicted, rows) per chunk that asked;
    # the logits of position p give the logprob of prompt token p + 1
    prompt_spans: list[tuple[str, int, int]] = field(default_factory=list)
    # sample_rows is every row in order (a batch of plain decodes): the hidden states are the
    # logits' rows as they are, no gather (a torch op that, after a step's weights have swept the
    # caches, took ~45 us of host time on the 2-core EPYC)
    every_row: bool = False


@dataclass
class ChunkInput:
    """One chunk as the forward pass sees it: ``token_ids`` at positions ``start ..`` of a
    sequence with ``block_table``. ``verify``: its rows are a speculated run (all decode
    rows, all sampled); ``samples``: its last row is sampled; ``prompt_logprobs``: (first
    position predicted, rows) when its prompt tokens' logprobs are wanted."""

    req_id: str
    start: int
    token_ids: list[int]
    block_table: list[int]
    samples: bool
    verify: bool = False
    prompt_logprobs: tuple[int, int] | None = None
    # asynchronous scheduling: the one token is the previous launched step's sample at this
    # index of its tokens (on the device; ``token_ids`` holds a placeholder)
    deferred: int | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are enqueued (``ModelRunner.launch``): ``finish``
    waits for its tokens. ``output``: a step that finished at launch (it had work that reads
    its results on the host: verify runs, constrained rows, prompt logprobs), or a rank that
    does not sample (None)."""

    batch: ForwardBatch | None = None
    pending: PendingSample | None = None
    output: RunnerOutput | None = None


@dataclass
class RunnerRequest:
    """What the runner keeps of one request between steps (from the plans' deltas only)."""

    token_ids: list[int]  # prompt + accepted output
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    export_generator: bool = False  # report the generator's state after each sample


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,  # the registry's interface (ridge/models/registry.py)
        kv_caches: list[PagedKV],
        block_size: int,
        device: torch.device,
        sampler: Sampler | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler  # None: not the driver (tensor-parallel ranks > 0)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, RunnerRequest] = {}
        self.graphs = None  # a DecodeGraphs (worker/cuda_graphs.py) once captured: decode steps replay it
        # the last launched step's sampled tokens (device) and each request's index in them: what
        # the next step's deferred tokens are (asynchronous scheduling)
        # (a list where the step read its tokens on the host: made a tensor only if a step reads it)
        self._last_sampled: tuple[torch.Tensor | list[int], dict[str, int]] | None = None

    # -- per-request state ----------------------------------------------------------------
    def update_states(self, plan: SchedulerOutput) -> None:
        for rid in plan.finished_req_ids:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            tokens = list(new.token_ids)
            prompt = tokens[: new.num_prompt_tokens]
            outputs = tokens[new.num_prompt_tokens :]
            state = SamplingState(new.sampling_params, prompt, outputs, self.eos_token_ids)
            if new.generator_state is not None:  # a producer sampled this request's first token
                state.generator = torch.Generator(device=self.device)
                state.generator.set_state(torch.frombuffer(bytearray(new.generator_state), dtype=torch.uint8))
            self.requests[new.req_id] = RunnerRequest(
                tokens, new.num_prompt_tokens, list(new.block_ids), new.sampling_params, state, new.export_generator
            )
        for delta in plan.cached_requests:
            req = self.requests[delta.req_id]
            if delta.new_token_ids:
                req.token_ids.extend(delta.new_token_ids)
                req.sampling.output_token_ids.extend(delta.new_token_ids)
            if delta.first_block < len(req.block_ids):
                del req.block_ids[delta.first_block :]
            req.block_ids.extend(delta.new_block_ids)

    def chunk_inputs(self, plan: SchedulerOutput) -> list[ChunkInput]:
        """The plan's chunks with their tokens and block tables, from the runner's state."""
        out = []
        for chunk in plan.chunks:
            req = self.requests[chunk.req_id]
            deferred = None
            if chunk.kind is ChunkKind.VERIFY:
                tokens = [req.token_ids[chunk.start], *chunk.draft_token_ids]
            elif chunk.end > len(req.token_ids):  # a token the last launched step is sampling
                last = self._last_sampled
                if chunk.start != len(req.token_ids) or last is None or chunk.req_id not in last[1]:
                    raise RuntimeError(f"{chunk.req_id}: tokens {chunk.start}..{chunk.end} are not known here")
                tokens, deferred = [0], last[1][chunk.req_id]
            else:
                tokens = req.token_ids[chunk.start : chunk.end]
            spans = None
            last_scored = min(chunk.end, req.num_prompt_tokens - 1)  # position P - 1 predicts an output token
            if req.params.prompt_logprobs is not None and chunk.start < last_scored:
                spans = (chunk.start + 1, last_scored - chunk.start)
            verifying = chunk.kind is ChunkKind.VERIFY
            out.append(
                ChunkInput(chunk.req_id, chunk.start, tokens, req.block_ids, chunk.samples, verifying, spans, deferred)
            )
        return out

    # -- the forward pass -----------------------------------------------------------------
    def prepare(self, chunks: list[ChunkInput]) -> ForwardBatch:
        """The step's flat batch: decode rows first (one-token chunks, verify runs, and prompt
        chunks of at most ``kernels.short_chunk_rows`` tokens where the kernels run those as
        decode rows), then prefill chunks. Logit rows follow the chunks' order."""
        bs = self.block_size
        short = getattr(self.model.kernels, "short_chunk_rows", 0)

        def as_decode_rows(chunk: ChunkInput) -> bool:
            n = len(chunk.token_ids)
            return n == 1 or chunk.verify or (n <= short and chunk.prompt_logprobs is None)

        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        first_row: dict[int, int] = {}  # id(chunk) -> its first flat row
        deferred_rows: list[int] = []  # rows whose token the last launched step samples
        deferred_from: list[int] = []  # ... at this index of its tokens
        for chunk in [c for c in chunks if as_decode_rows(c)] + [c for c in chunks if not as_decode_rows(c)]:
            table = chunk.block_table
            start, end = chunk.start, chunk.end
            first_row[id(chunk)] = len(tokens)
            if len(chunk.token_ids) == 1:  # a decode (or one prompt token): the common case, kept lean
                if chunk.deferred is not None:
                    deferred_rows.append(len(tokens))
                    deferred_from.append(chunk.deferred)
                tokens.append(chunk.token_ids[0])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table)
                decode_lens.append(end)
            elif as_decode_rows(chunk):
                # A verify run (1 + k rows of one sequence), or a short prompt chunk: row j sees
                # the context up to its own position (the step writes every row's K/V before
                # attention), so the decode kernel is causal across the run and each row
                # computes what a plain decode at that position computes.
                tokens.extend(chunk.token_ids)
                for pos in range(start, end):
                    positions.append(pos)
                    slots.append(table[pos // bs] * bs + pos % bs)
                    decode_tables.append(table)
                    decode_lens.append(pos + 1)
            else:  # PREFILL: a run of query rows, causal over the paged context
                row = len(tokens)
                tokens.extend(chunk.token_ids)
                positions.extend(range(start, end))
                slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
                prefills.append(
                    PrefillChunk(row, len(tokens), end, torch.tensor(table, dtype=torch.long, device=self.device))
                )
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        verify_rows: list[int] = []
        verify_runs: list[tuple[str, list[int]]] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[str, int, int]] = []
        for chunk in chunks:
            first, count = first_row[id(chunk)], len(chunk.token_ids)
            if chunk.verify:
                verify_rows.extend(range(first, first + count))
                verify_runs.append((chunk.req_id, chunk.token_ids[1:]))
            elif chunk.samples:
                sample_rows.append(first + count - 1)
                sample_ids.append(chunk.req_id)
            if chunk.prompt_logprobs is not None:
                predicted, rows = chunk.prompt_logprobs
                prompt_spans.append((chunk.req_id, predicted, rows))
                prompt_rows.extend(range(first, first + rows))

        # The step's integer inputs travel in one host-to-device copy: on a GPU each copy from
        # pageable memory is a synchronous transfer of its own (~20 us of host time).
        logit_rows = sample_rows + verify_rows + prompt_rows
        every_row = len(logit_rows) == len(tokens) and logit_rows == list(range(len(tokens)))
        parts = [tokens, positions, slots, logit_rows, decode_lens]
        parts += [deferred_rows, deferred_from]
        sizes = [len(p) for p in parts]
        width = max(map(len, decode_tables)) if decode_tables else 0
        flat = np.zeros(sum(sizes) + len(decode_tables) * width, dtype=np.int64)
        offset = 0
        for part in parts:
            flat[offset : offset + len(part)] = part
            offset += len(part)
        padded = flat[offset:].reshape(len(decode_tables), width)
        for i, table in enumerate(decode_tables):
            padded[i, : len(table)] = table
        host = torch.from_numpy(flat)
        if self.device.type == "cuda":  # from pinned memory: the host does not wait for the GPU's queue
            on_device = host.pin_memory().to(self.device, non_blocking=True)
        else:
            on_device = host
        ids, pos, slot_mapping, rows, lens, into, source = torch.split(on_device[:offset], sizes)
        if deferred_rows:  # the previous step's samples, without a trip through the host
            last = self._last_sampled[0]
            if isinstance(last, list):
                last = torch.tensor(last, device=self.device)
            ids.index_copy_(0, into, last.index_select(0, source))
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=len(decode_tables), prefills=prefills)
        if decode_tables:
            meta.decode_block_tables = on_device[offset:].view(len(decode_tables), width)
            meta.decode_context_lens = lens
        return ForwardBatch(ids, pos, meta, rows, sample_ids, verify_runs, prompt_spans, every_row)

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        graphs, rows = self.graphs, batch.input_ids.shape[0]
        if graphs is not None and graphs.takes(batch.meta, rows):  # a decode step: a CUDA graph's replay
            hidden = graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.every_row:
            hidden = hidden[batch.sample_rows]
        return self.model.compute_logits(hidden)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput | None:
        """Apply the plan's deltas, run its chunks; the driver samples and returns the output."""
        return self.finish(self.launch(plan))

    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """``execute`` up to its wait: the deltas applied, the forward pass and the sampling of
        plain rows enqueued (on a GPU the host goes on while they run); a step with verify
        runs, constrained rows, prompt logprobs or a generator to export reads its results
        here and is finished."""
        self.update_states(plan)
        if not plan.chunks:
            return LaunchedStep(output=RunnerOutput({}) if self.sampler is not None else None)
        if plan.num_steps > 1:
            self._last_sampled = None
            return LaunchedStep(output=self._run_steps(plan))
        batch = self.prepare(self.chunk_inputs(plan))
        logits = self.forward_logits(batch)
        self._last_sampled = None
        if self.sampler is None:
            return LaunchedStep()
        ids = batch.sample_request_ids
        exporting = any(self.requests[rid].export_generator for rid in ids)
        if batch.verify_runs or batch.prompt_spans or plan.grammar_rows or exporting:
            out = self.sample(batch, logits, plan.draft_probs, plan.grammar_bitmask, plan.grammar_rows)
            step, tokens = LaunchedStep(batch, output=out), [out.sampled[rid][-1] for rid in ids]
        else:
            pending = self.sampler.launch(logits[: len(ids)], [self.requests[rid].sampling for rid in ids])
            step, tokens = LaunchedStep(batch, pending), pending.tokens
        self._last_sampled = (tokens, {rid: i for i, rid in enumerate(ids)})  # what a next step may read
        return step

    def _run_steps(self, plan: SchedulerOutput) -> RunnerOutput:
        """A multi-step plan (``SchedulerOutput.num_steps``; one-token decodes only, every row
        sampling plainly): that many forward passes, each on the tokens the pass before it
        sampled, one position further, into the slots of the blocks the scheduler allotted
        for all of them; every row's tokens in order. Each pass computes what a plan of its
        own would: the same kernels on the same rows, the same sampler calls in the same order."""
        batch = self.prepare(self.chunk_inputs(plan))
        ids = batch.sample_request_ids
        states = [self.requests[rid].sampling for rid in ids]
        meta, bs = batch.meta, self.block_size
        asked = [i for i, s in enumerate(states) if s.params.logprobs is not None]  # rows that want logprobs
        if self.graphs is None and not asked and all(s.params.greedy for s in states):  # one call, where it can
            with torch.inference_mode():
                tokens = self.model.decode_greedy(
                    batch.input_ids, batch.positions, self.kv_caches, meta, plan.num_steps
                )
            if tokens is not None:
                return RunnerOutput(dict(zip(ids, tokens.tolist())))
        passes, results = [], []
        for step in range(plan.num_steps):
            if step:  # the next position: its token, its slot in the row's block table, one more to attend
                batch.input_ids.copy_(passes[-1])
                batch.positions.add_(1)
                blocks = meta.decode_block_tables.gather(1, batch.positions.unsqueeze(1) // bs).squeeze(1)
                meta.slot_mapping.copy_(blocks * bs + batch.positions % bs)
                meta.decode_context_lens.add_(1)
            logits = self.forward_logits(batch)
            pending = self.sampler.launch(logits[: len(ids)], states)
            passes.append(pending.tokens)
            if asked:
                results.append(pending.result())
        tokens = torch.stack(passes, dim=1).tolist()
        logprobs = {ids[i]: [(r.logprobs[i], r.top_logprobs[i] or []) for r in results] for i in asked}
        return RunnerOutput(dict(zip(ids, tokens)), logprobs)

    def finish(self, step: LaunchedStep) -> RunnerOutput | None:
        """Wait for a launched step's tokens; the driver's output (None on the other ranks)."""
        out = step.output
        if step.pending is not None:
            out = RunnerOutput(*self._sampled(step.batch.sample_request_ids, step.pending.result()))
        if out is not None:
            out.experts_touched = self.model.experts_touched()
        return out

    def _sampled(self, request_ids: list[str], out: SamplerOutput) -> tuple[dict, dict]:
        """Each sampling row's token, and its logprobs where asked."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        for rid, token, lp, top in zip(request_ids, out.token_ids, out.logprobs, out.top_logprobs):
            sampled[rid] = [token]
            if lp is not None:
                logprobs[rid] = [(lp, top or [])]
        return sampled, logprobs

    def sample(
        self,
        batch: ForwardBatch,
        logits: torch.Tensor,
        draft_probs: dict,
        grammar_bitmask: torch.Tensor | None = None,
        grammar_rows: dict[str, int] | None = None,
    ) -> RunnerOutput:
        num_sampled = len(batch.sample_request_ids)
        num_verify = sum(1 + len(drafts) for _, drafts in batch.verify_runs)
        if grammar_rows:  # structured output: only what each constrained row's grammar allows
            logits = self._masked(batch, logits, grammar_bitmask, grammar_rows)
        prompt_logprobs = self._prompt_logprobs(batch, logits[num_sampled + num_verify :], self.requests)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        generator_states: dict[str, bytes] = {}
        if num_sampled:
            states = [self.requests[rid].sampling for rid in batch.sample_request_ids]
            sampled, logprobs = self._sampled(batch.sample_request_ids, self.sampler(logits[:num_sampled], states))
            for rid in batch.sample_request_ids:
                req = self.requests[rid]
                if req.export_generator and req.sampling.generator is not None:
                    generator_states[rid] = req.sampling.generator.get_state().numpy().tobytes()
        verified = {}
        results, row = {}, num_sampled
        greedy_rows, greedy_runs = [], []
        for rid, drafts in batch.verify_runs:
            state = self.requests[rid].sampling
            rows = range(row, row + 1 + len(drafts))
            row += 1 + len(drafts)
            if state.plain_greedy():  # verified together below
                greedy_rows.extend(rows)
                greedy_runs.append((rid, drafts))
            else:
                probs = draft_probs.get(rid)
                results[rid] = verify(self.sampler, logits[rows.start : rows.stop], state, drafts, probs)
        if greedy_runs:
            index = torch.tensor(greedy_rows, device=logits.device)
            batch_results = verify_greedy_batch(logits[index], [d for _, d in greedy_runs], self.sampler.argmax)
            results.update(zip([rid for rid, _ in greedy_runs], batch_results))
        for rid, drafts in batch.verify_runs:
            result = results[rid]
            sampled[rid] = result.token_ids
            verified[rid] = (len(drafts), result.num_accepted)
            if result.logprobs is not None:
                logprobs[rid] = [(lp, top or []) for lp, top in result.logprobs]
        return RunnerOutput(sampled, logprobs, prompt_logprobs, verified, generator_states=generator_states)

    def _masked(
        self, batch: ForwardBatch, logits: torch.Tensor, bitmask: torch.Tensor, grammar_rows: dict[str, int]
    ) -> torch.Tensor:
        """A copy of ``logits`` (inference tensors) with each constrained row's bitmask applied:
        a sampled row takes its sequence's row of the bitmask; a verify run of 1 + k rows the
        k + 1 rows from it (the grammar's state before each proposed token)."""
        pairs = [(i, grammar_rows[rid]) for i, rid in enumerate(batch.sample_request_ids) if rid in grammar_rows]
        row = len(batch.sample_request_ids)
        for rid, drafts in batch.verify_runs:
            if rid in grammar_rows:
                pairs += [(row + j, grammar_rows[rid] + j) for j in range(1 + len(drafts))]
            row += 1 + len(drafts)
        if not pairs:
            return logits
        index = torch.tensor([i for i, _ in pairs], device=logits.device)
        rows = logits[index]
        self.model.kernels.apply_token_bitmask_(rows, bitmask[[m for _, m in pairs]])
        return logits.index_copy(0, index, rows)

    @staticmethod
    def _prompt_logprobs(batch: ForwardBatch, logits: torch.Tensor, requests: dict[str, RunnerRequest]) -> dict:
        """Each asked-for prompt token's logprob under the raw distribution, its rank, the top-k."""
        if not batch.prompt_spans:
            return {}
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out, row = {}, 0
        for rid, first, count in batch.prompt_spans:
            req = requests[rid]
            k = req.params.prompt_logprobs
            rows = logprobs[row : row + count]
            targets = torch.tensor(req.token_ids[first : first + count], device=rows.device)
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
