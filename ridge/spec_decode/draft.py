"""The draft-model proposer: a smaller model with the same tokenizer proposes k tokens per
sequence per step, autoregressively, batched across sequences.

The draft is a ``Worker`` (``worker/worker.py``) like the target's: it loads the model, picks
kernels and owns a KV pool. The proposer keeps, per target sequence, a *shadow* request (its
own copy of the accepted token ids, its own computed count and block table in the draft's
``KVCacheManager``) and drives the worker's runner with chunks it builds itself. Each
``propose`` runs k forward passes of the draft:

    pass 1:  catch up   token_ids[computed : N]  (a prefill after admission, else the
                        accepted tokens of the last verify run), sampled at N - 1 -> d1
    pass j:  feed d(j-1) at position N + j - 2                               -> dj

Drafted positions past N hold the drafts' K/V. After verification the shadow keeps those
that the target accepted (the drafts equal to the new accepted tokens) and recomputes the
rest. Prefix caching names only accepted tokens, so a block is hashed once all its
positions hold accepted tokens' K/V. A target that is no longer running frees its shadow.

A draft whose context is shorter than the target's proposes only for sequences that fit it
(``max_model_len``; the speculator keeps the rest to plain decoding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ridge.engine.request import Request
from ridge.kv.manager import KVCacheManager
from ridge.sampling import SamplingParams, SamplingState
from ridge.spec_decode.proposer import Proposal, ProposalRequest
from ridge.worker.runner import ChunkInput
from ridge.worker.worker import Worker, WorkerConfig

_PLAIN = SamplingParams()
DRAFT_OPTIONS = ("dtype", "quantization", "kv_cache_dtype", "block_size", "kernels")


@dataclass
class _Shadow:
    request: Request  # the draft's own: accepted token ids, computed count (the KV manager's contract)
    base: int = 0  # N at the last proposal: drafts were fed at base, base + 1, ...
    fed: list[int] = field(default_factory=list)


class DraftProposer:
    host_only = False  # each proposal is a model pass per draft token

    @classmethod
    def load(
        cls,
        spec: str,
        options: dict | None,
        *,
        target_vocab_size: int,
        num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        seed: int,
        kernels: str,
        max_num_seqs: int = 256,
        num_speculative_tokens: int = 0,
    ) -> DraftProposer:
        """Load the draft ``spec`` as a worker with its own KV pool of at least ``num_tokens``
        tokens. ``options``: dtype, quantization, kv_cache_dtype, block_size, kernels (as LLM's).
        ``max_num_seqs`` and ``num_speculative_tokens``: the target's, which size the draft's
        CUDA graphs (a catch-up pass feeds up to 1 + k tokens a sequence, as decode rows)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(DRAFT_OPTIONS))
        if unknown:
            raise ValueError(f"unknown draft option(s) {', '.join(unknown)}; known: {', '.join(DRAFT_OPTIONS)}")
        block_size = int(options.get("block_size", block_size))
        if block_size < 1:
            raise ValueError(f"draft block_size must be >= 1, got {block_size}")
        config = WorkerConfig(
            model=spec,
            dtype=options.get("dtype", str(dtype).removeprefix("torch.")),
            device=str(device),
            seed=seed,
            block_size=block_size,
            quantization=options.get("quantization"),
            kernels=options.get("kernels", kernels),
            kv_cache_dtype=options.get("kv_cache_dtype", "auto"),
            num_kv_blocks=-(-num_tokens // block_size),
            max_num_seqs=max_num_seqs,
            num_speculative_tokens=num_speculative_tokens,
        )
        worker = Worker(config, vocab_size=target_vocab_size)
        return cls(worker, seed)

    def __init__(self, worker: Worker, seed: int = 0) -> None:
        self.worker = worker
        info = worker.describe()
        num_blocks = worker.available_kv_blocks(1)
        worker.init_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, info.block_size)
        self.runner = worker.runner
        self.sampler = self.runner.sampler
        self.info = info
        self.max_model_len = info.max_model_len
        self._shadows: dict[str, _Shadow] = {}
        self.weight_bytes = info.weight_bytes
        self.pass_s: float | None = None  # a one-token pass over the batch (the last propose's mean)
        self.passes: list[tuple[tuple[int, int], ...]] = []  # shapes of the passes since last taken

    # -- shadows --------------------------------------------------------------------------
    def _shadow(self, target: ProposalRequest) -> _Shadow:
        tokens = target.token_ids
        shadow = self._shadows.get(target.req_id)
        if shadow is not None:
            mine = shadow.request.all_token_ids
            if len(tokens) < len(mine) or tokens[len(mine) - 1] != mine[-1]:  # a new sequence under a reused id
                self._free(shadow)
                shadow = None
        if shadow is None:
            req = Request(target.req_id, list(tokens), _PLAIN, 1, 0.0)
            shadow = self._shadows[target.req_id] = _Shadow(req)
        req = shadow.request
        req.all_token_ids.extend(tokens[len(req.all_token_ids) :])
        if shadow.fed:  # keep the drafted positions the target accepted
            kept = 0
            while kept < len(shadow.fed) and shadow.base + kept < len(tokens) - 1:
                if tokens[shadow.base + kept] != shadow.fed[kept]:
                    break
                kept += 1
            req.num_computed_tokens = min(req.num_computed_tokens, shadow.base + kept)
            shadow.fed = []
        return shadow

    def _free(self, shadow: _Shadow) -> None:
        self.kv.free(shadow.request)
        del self._shadows[shadow.request.request_id]

    def forget_except(self, running: set[str]) -> None:
        """Free the shadows of sequences that are not running (preempted, finished, aborted)."""
        for rid in [rid for rid in self._shadows if rid not in running]:
            self._free(self._shadows[rid])

    def take_passes(self) -> list[tuple[tuple[int, int], ...]]:
        """The passes run since the last call, for the telemetry: (query tokens, context) each."""
        passes, self.passes = self.passes, []
        return passes

    # -- proposing ------------------------------------------------------------------------
    def propose(self, requests: list[ProposalRequest], k: int) -> dict[str, Proposal]:
        """Request id -> (up to k drafted tokens, their draft distributions (k, V) or None
        for greedy requests). A sequence whose shadow finds no room in the pool gets none."""
        chunks: list[ChunkInput] = []
        targets: dict[str, ProposalRequest] = {}
        for target in requests:
            shadow = self._shadow(target)
            req = shadow.request
            hits, num_hits = [], 0
            if req.num_computed_tokens == 0 and not self.kv.block_table(req):
                hits, num_hits = self.kv.get_computed_blocks(req)
            start = req.num_computed_tokens + num_hits
            num_new = req.num_tokens - start
            if not self.kv.allocate_slots(req, num_new + k - 1, hits):
                continue
            req.num_computed_tokens = start
            chunks.append(ChunkInput(req.request_id, start, req.all_token_ids[start:], self.kv.block_table(req), True))
            shadow.base = req.num_tokens
            targets[req.request_id] = target
        drafts: dict[str, list[int]] = {rid: [] for rid in targets}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in targets}
        feed_s = []
        for j in range(k):
            if not chunks:
                break
            pass_start = time.perf_counter()
            chunks.sort(key=lambda c: len(c.token_ids) != 1)  # decode rows first
            self.passes.append(tuple((len(c.token_ids), c.end) for c in chunks))
            logits = self.runner.forward_logits(self.runner.prepare(chunks))
            order = [c.req_id for c in chunks]
            tokens, dists = self._sample(logits, [targets[rid] for rid in order])
            fed = []
            for i, rid in enumerate(order):
                drafts[rid].append(tokens[i])
                if dists is not None and dists[i] is not None:
                    probs[rid].append(dists[i])
                shadow = self._shadows[rid]
                req = shadow.request
                req.num_computed_tokens = chunks[i].end
                if j < k - 1:  # feed the draft back for the next one
                    shadow.fed.append(tokens[i])
                    fed.append(ChunkInput(rid, chunks[i].end, [tokens[i]], self.kv.block_table(req), True))
            chunks = fed
            if j:  # passes after the first: one token per sequence, the draft's steady cost
                feed_s.append(time.perf_counter() - pass_start)
        if feed_s:
            self.pass_s = sum(feed_s) / len(feed_s)
        out = {}
        for rid, tokens in drafts.items():
            p = torch.stack(probs[rid]) if probs[rid] else None
            out[rid] = (tokens, p)
        return out

    def _sample(self, logits: torch.Tensor, targets: list[ProposalRequest]):
        """Greedy targets: argmax. Sampling targets: a draw from the draft's distribution under
        the target's temperature / top-k / top-p / min-p (q of the rejection sampler)."""
        tokens = self.sampler.argmax(logits).tolist()
        sampling = [i for i, t in enumerate(targets) if not t.params.greedy]
        if not sampling:
            return tokens, None
        states = [SamplingState(targets[i].params, []) for i in sampling]
        x = logits[torch.tensor(sampling, device=logits.device)].float()
        q = self.sampler.probabilities(x, states)
        # The draft's noise is the proposer's own (a seeded request's stream belongs to the
        # target; the output's distribution does not depend on the draft's draws).
        drawn = self.sampler.draw(q.clone(), None).tolist()
        dists: list[torch.Tensor | None] = [None] * len(targets)
        for row, i in enumerate(sampling):
            tokens[i] = drawn[row]
            dists[i] = q[row]
        return tokens, dists
