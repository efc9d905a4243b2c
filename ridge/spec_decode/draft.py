"""The draft-model proposer: a smaller model with the same tokenizer proposes k tokens per
sequence per step, autoregressively, batched across sequences.

It keeps its own paged KV cache and, per target sequence, a *shadow* request that shares
the target's ``all_token_ids`` (accepted tokens only) and has its own computed count and
block table. Each ``propose`` runs k forward passes of the draft:

    pass 1:  catch up   all_token_ids[computed : N]  (a prefill after admission, else the
                        accepted tokens of the last verify run), sampled at N - 1 -> d1
    pass j:  feed d(j-1) at position N + j - 2                               -> dj

Drafted positions past N hold the drafts' K/V. After verification the shadow keeps those
that the target accepted (the drafts equal to the new accepted tokens) and recomputes the
rest. Prefix caching names only accepted tokens, so a block is hashed once all its
positions hold accepted tokens' K/V. A target that is preempted or gone frees its shadow's
blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ridge.engine.request import Request, RequestStatus
from ridge.engine.runner import ModelRunner
from ridge.engine.scheduler import ScheduledChunk, SchedulerOutput
from ridge.kv.manager import KVCacheManager
from ridge.sampling import Sampler, SamplingParams

_PLAIN = SamplingParams()
DTYPES_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _FeedChunk(ScheduledChunk):
    """One drafted token fed back at ``start``: it is not (yet) among the accepted tokens."""

    fed_token: int = 0

    def token_ids(self) -> list[int]:
        return [self.fed_token]

    @property
    def samples(self) -> bool:
        return True


@dataclass
class _Shadow:
    request: Request  # shares the target's all_token_ids
    base: int = 0  # N at the last proposal: drafts were fed at base, base + 1, ...
    fed: list[int] = field(default_factory=list)


class DraftProposer:
    @classmethod
    def load(
        cls,
        spec: str,
        options: dict | None,
        *,
        target_vocab_size: int,
        max_model_len: int,
        num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        seed: int,
        kernels: str,
    ) -> DraftProposer:
        """Load the draft ``spec`` with its own KV pool of at least ``num_tokens`` tokens.
        ``options``: dtype, quantization, kv_cache_dtype, block_size, kernels (as LLM's)."""
        from ridge.config import ModelConfig, canonical_dtype
        from ridge.kv import cache as kv_cache
        from ridge.layers.cpu_kernels import select_kernels
        from ridge.models.loader import load_model, read_hf_config
        from ridge.quantization.config import QuantizationConfig

        options = dict(options or {})
        allowed = {"dtype", "quantization", "kv_cache_dtype", "block_size", "kernels"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ValueError(f"unknown draft option(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}")
        hf_config, source = read_hf_config(spec)
        config = ModelConfig.from_hf_config(hf_config, None)
        if config.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({config.vocab_size} tokens) differs from the target's "
                f"({target_vocab_size}): a draft must share the target's tokenizer"
            )
        if config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"the draft model's context ({config.max_position_embeddings} tokens) is shorter than the "
                f"target's max_model_len ({max_model_len}); lower --max-model-len to at most "
                f"{config.max_position_embeddings}"
            )
        if "dtype" in options:
            dtype = DTYPES_BY_NAME[canonical_dtype(options["dtype"])]
        block_size = int(options.get("block_size", block_size))
        if block_size < 1:
            raise ValueError(f"draft block_size must be >= 1, got {block_size}")
        kind = options.get("kv_cache_dtype", "auto")
        kv_cache.check_kv_cache_dtype(kind)
        quant = QuantizationConfig.from_name(options.get("quantization"))
        loaded = load_model(hf_config, config, source, dtype, device, max_model_len, seed, quant)
        loaded.model.set_kernels(select_kernels(options.get("kernels", kernels), device, dtype))
        num_blocks = -(-num_tokens // block_size)
        kv_spec = loaded.model.kv_cache_spec()
        caches = kv_cache.allocate(kv_spec, num_blocks, block_size, dtype, device, kind)
        proposer = cls(loaded.model, caches, KVCacheManager(num_blocks, block_size), device, seed)
        from ridge.roofline.shapes import ModelShape
        from ridge.telemetry import ModelPricing

        params = max(1, loaded.model.linear_weight_params())
        proposer.pricing = ModelPricing(
            ModelShape.from_model_config(config, spec),
            proposer.weight_bytes / params,
            kv_spec.bytes_per_element(kind, dtype),
            dtype.itemsize,
        )
        return proposer

    def __init__(self, model, kv_caches, kv: KVCacheManager, device: torch.device, seed: int = 0) -> None:
        self.kv = kv
        self.runner = ModelRunner(model, kv_caches, kv, Sampler(seed), device)
        self.sampler = self.runner.sampler
        self._shadows: dict[str, _Shadow] = {}
        self.weight_bytes = model.linear_weight_bytes()
        self.pass_s: float | None = None  # a one-token pass over the batch (the last propose's mean)
        self.pricing = None  # ModelPricing for the telemetry (set by load)
        self.passes: list[tuple[tuple[int, int], ...]] = []  # shapes of the passes since last taken

    # -- shadows --------------------------------------------------------------------------
    def _shadow(self, target: Request) -> _Shadow | None:
        shadow = self._shadows.get(target.request_id)
        if shadow is None:
            req = Request(target.request_id, target.prompt_token_ids, _PLAIN, target.max_tokens, target.arrival_time)
            req.all_token_ids = target.all_token_ids  # the same list: accepted tokens, append-only
            shadow = self._shadows[target.request_id] = _Shadow(req)
        req = shadow.request
        if req.all_token_ids is not target.all_token_ids:  # a new request under a reused id
            self._free(shadow)
            del self._shadows[target.request_id]
            return self._shadow(target)
        if shadow.fed:  # keep the drafted positions the target accepted
            tokens, kept = req.all_token_ids, 0
            while kept < len(shadow.fed) and shadow.base + kept < len(tokens) - 1:
                if tokens[shadow.base + kept] != shadow.fed[kept]:
                    break
                kept += 1
            req.num_computed_tokens = min(req.num_computed_tokens, shadow.base + kept)
            shadow.fed = []
        return shadow

    def _free(self, shadow: _Shadow) -> None:
        self.kv.free(shadow.request)
        shadow.request.num_computed_tokens = 0
        shadow.fed = []

    def forget_except(self, live: dict) -> None:
        """Free the shadows of sequences that are not running (preempted, finished, aborted)."""
        for rid, shadow in list(self._shadows.items()):
            target = live.get(rid)
            if target is None or target.status is not RequestStatus.RUNNING:
                self._free(shadow)
                if target is None:
                    del self._shadows[rid]

    def take_passes(self) -> list[tuple[tuple[int, int], ...]]:
        """The passes run since the last call, for the telemetry: (query tokens, context) each."""
        passes, self.passes = self.passes, []
        return passes

    # -- proposing ------------------------------------------------------------------------
    def propose(self, requests: list[Request], k: int) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Request id -> (up to k drafted tokens, their draft distributions (k, V) or None
        for greedy requests). A sequence whose shadow finds no room in the pool gets none."""
        chunks: list[ScheduledChunk] = []
        targets: dict[str, Request] = {}
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
            chunks.append(ScheduledChunk(req, start, num_new))
            shadow.base = req.num_tokens
            targets[req.request_id] = target
        drafts: dict[str, list[int]] = {rid: [] for rid in targets}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in targets}
        feed_s = []
        for j in range(k):
            if not chunks:
                break
            pass_start = time.perf_counter()
            plan = SchedulerOutput(chunks=sorted(chunks, key=lambda c: not c.decode_rows))
            self.passes.append(tuple((c.num_new_tokens, c.end) for c in plan.chunks))
            logits = self.runner.forward_logits(self.runner.prepare(plan))
            order = [c.request.request_id for c in plan.chunks]
            tokens, dists = self._sample(logits, [targets[rid] for rid in order])
            chunks = []
            for i, rid in enumerate(order):
                drafts[rid].append(tokens[i])
                if dists is not None and dists[i] is not None:
                    probs[rid].append(dists[i])
                shadow = self._shadows[rid]
                req = shadow.request
                req.num_computed_tokens = plan.chunks[i].end
                if j < k - 1:  # feed the draft back for the next one
                    shadow.fed.append(tokens[i])
                    chunks.append(_FeedChunk(req, req.num_computed_tokens, 1, fed_token=tokens[i]))
            if j:  # passes after the first: one token per sequence, the draft's steady cost
                feed_s.append(time.perf_counter() - pass_start)
        if feed_s:
            self.pass_s = sum(feed_s) / len(feed_s)
        out = {}
        for rid, tokens in drafts.items():
            p = torch.stack(probs[rid]) if probs[rid] else None
            out[rid] = (tokens, p)
        return out

    def _sample(self, logits: torch.Tensor, targets: list[Request]):
        """Greedy targets: argmax. Sampling targets: a draw from the draft's distribution under
        the target's temperature / top-k / top-p / min-p (q of the rejection sampler)."""
        tokens = logits.argmax(dim=-1).tolist()
        sampling = [i for i, t in enumerate(targets) if not t.sampling_params.greedy]
        if not sampling:
            return tokens, None
        states = [targets[i].sampling_state for i in sampling]
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
