"""The engine: requests in, ``RequestOutput`` objects out, one step at a time.

    step():  plan = scheduler.schedule()  ->  out = runner.run(plan)  ->  postprocess(plan, out)

``add_request`` validates everything before a request is queued, so bad input raises
``ValueError`` for that request alone and never disturbs the others. The engine is not
thread-safe: one thread (the ``LLM`` loop, or the server's engine loop) drives it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
from dataclasses import dataclass, field

import torch

from ridge.config import EngineConfig, ModelConfig, resolve_device, resolve_dtype
from ridge.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ridge.engine.request import Request, RequestStatus
from ridge.engine.runner import ModelRunner, allocate_kv_caches
from ridge.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ridge.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer, load_tokenizer
from ridge.kv.manager import KVCacheManager
from ridge.layers.cpu_kernels import select_kernels
from ridge.models.loader import load_model, read_hf_config
from ridge.roofline.probe import local_hardware
from ridge.roofline.shapes import ModelShape
from ridge.sampling import Sampler, SamplingParams, SamplingState
from ridge.telemetry import TORCH_TO_ROOFLINE_DTYPE, Telemetry, cuda_hardware


# tokenizer="bytes": UTF-8 bytes as tokens, no files (random models, token-id-only use).
BYTES_TOKENIZER = "bytes"

# Without --kv-cache-memory the pool takes this share of free memory, but never more than
# max_num_seqs full-length sequences need.
DEFAULT_KV_MEMORY_FRACTION = {"cpu": 0.25, "cuda": 0.80}


@dataclass
class _Sequence:
    """One of a user request's n completions: the scheduler's request plus its text state."""

    user_id: str
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0
    # Text only at the end: nobody reads it earlier (not streamed) and no stop string needs
    # it. Saves a detokenizer call per sequence per step.
    text_at_finish: bool = False


@dataclass
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    stream: bool = True  # an output every step (for streaming), or only the final one
    sequences: list[_Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        hf_config, model_dir = read_hf_config(config.model)
        model_config = ModelConfig.from_hf_config(hf_config, config.max_model_len)
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        loaded = load_model(hf_config, model_config, model_dir, self.dtype, self.device, config.max_model_len, config.seed)
        self.model = loaded.model
        self.model.set_kernels(select_kernels(config.kernels, self.device, self.dtype))
        self.model_config = loaded.config
        self.hf_config = loaded.hf_config
        self.max_model_len = loaded.max_model_len
        if config.tokenizer == BYTES_TOKENIZER or (config.tokenizer is None and loaded.model_dir is None):
            self.tokenizer = ByteTokenizer()
            if self.model_config.vocab_size < self.tokenizer.vocab_size:
                raise ValueError(
                    f"random model vocab ({self.model_config.vocab_size}) is smaller than the byte tokenizer's "
                    f"({self.tokenizer.vocab_size})"
                )
        else:
            self.tokenizer = load_tokenizer(config.tokenizer or loaded.model_dir)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)

        cfg = self.model_config
        self.num_kv_blocks = self._num_kv_blocks()
        self.kv_caches = allocate_kv_caches(
            cfg.num_layers, self.num_kv_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device
        )
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                policy=config.scheduler,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.kv,
            self.max_model_len,
        )
        self.runner = ModelRunner(self.model, self.kv_caches, self.kv, Sampler(config.seed), self.device)
        self.telemetry = self._make_telemetry()
        self._requests: dict[str, _UserRequest] = {}
        self._sequence_of: dict[str, _Sequence] = {}  # scheduler request id -> sequence
        self._ids = itertools.count()

    # -- sizing -------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = self.dtype.itemsize
        return 2 * cfg.num_layers * self.config.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory:
            budget = self.config.kv_cache_memory * 2**30
        else:
            seq_blocks = -(-self.max_model_len // self.config.block_size)
            needed = self.config.max_num_seqs * seq_blocks * self.kv_bytes_per_block
            budget = min(needed, DEFAULT_KV_MEMORY_FRACTION[self.device.type] * _free_memory(self.device))
        blocks = int(budget // self.kv_bytes_per_block)
        if blocks < 1:
            raise ValueError(
                f"KV cache memory too small: one block needs {self.kv_bytes_per_block} bytes; raise kv_cache_memory"
            )
        return blocks

    def _make_telemetry(self) -> Telemetry:
        elem = self.dtype.itemsize
        if self.device.type == "cuda":
            hardware_fn = functools.partial(cuda_hardware, self.device)
        else:
            hardware_fn = local_hardware
        return Telemetry(
            model=ModelShape.from_hf_config(self.hf_config),
            weight_bytes=elem,
            kv_bytes=elem,
            act_bytes=elem,
            compute_dtype=TORCH_TO_ROOFLINE_DTYPE[str(self.dtype)],
            hardware_fn=hardware_fn,
        )

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        stream: bool = True,
    ) -> str:
        """Validate and queue a request (n sequences); returns its id. Raises ValueError on bad input.

        ``stream=False``: ``step`` returns this request's output only once it finishes
        (``LLM.generate`` does this; a server streams).
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        max_tokens = self._resolve_max_tokens(prompt_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        user = _UserRequest(request_id, prompt_text, prompt_ids, arrival, stream)
        for index in range(params.n):
            seq_params = params
            if params.n > 1 and params.seed is not None:  # each sample its own stream, reproducibly
                seq_params = dataclasses.replace(params, seed=params.seed + index)
            req = Request(
                request_id=f"{request_id}#{index}" if params.n > 1 else request_id,
                prompt_token_ids=list(prompt_ids),
                sampling_params=seq_params,
                max_tokens=max_tokens,
                arrival_time=arrival,
                eos_token_ids=self.eos_token_ids,
            )
            req.sampling_state = SamplingState(seq_params, req.prompt_token_ids, req.output_token_ids, self.eos_token_ids)
            detok = IncrementalDetokenizer(
                self.tokenizer,
                req.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            user.sequences.append(
                _Sequence(request_id, req, detok, [] if params.logprobs is not None else None,
                          text_at_finish=not stream and not params.stop)
            )
        self._requests[request_id] = user
        for seq in user.sequences:
            self._sequence_of[seq.request.request_id] = seq
            self.scheduler.add_request(seq.request)
        return request_id

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt token ids are empty")
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")
            return None, ids
        raise ValueError("a prompt must be a string or a list of token ids")

    def _resolve_max_tokens(self, prompt_ids: list[int], params: SamplingParams) -> int:
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, but the context limit is {self.max_model_len} "
                "(and at least one token must be generated)"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        need_blocks = -(-(len(prompt_ids) + max_tokens) // self.config.block_size)
        if need_blocks > self.num_kv_blocks:
            raise ValueError(
                f"request needs {need_blocks} KV blocks (prompt {len(prompt_ids)} + max_tokens {max_tokens}), "
                f"but the pool holds {self.num_kv_blocks}; raise kv_cache_memory or lower max_tokens"
            )
        return max_tokens

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its sequences); its blocks are free before the next step."""
        user = self._requests.pop(request_id, None)
        if user is None:
            return
        for seq in user.sequences:
            self.scheduler.abort(seq.request.request_id)
            self._sequence_of.pop(seq.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that progressed."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        out = self.runner.run(plan, self.scheduler.requests)
        outputs = self._postprocess(plan, out)
        # A decode computes one generated token; anything else (a prompt chunk, even of one
        # token, or a recompute after preemption) is prefill.
        decodes = [c.end for c in plan.chunks if c.num_new_tokens == 1 and c.start >= c.request.num_prompt_tokens]
        prefills = [(c.num_new_tokens, c.end) for c in plan.chunks
                    if c.num_new_tokens > 1 or c.start < c.request.num_prompt_tokens]
        self.telemetry.record(prefills, decodes, time.perf_counter() - start)
        return outputs

    def _postprocess(self, plan: SchedulerOutput, out) -> list[RequestOutput]:
        progressed = self.scheduler.update(plan, out.sampled)
        touched: dict[str, _UserRequest] = {}
        for req in progressed:
            seq = self._sequence_of[req.request_id]
            token = req.output_token_ids[-1]
            if seq.logprobs is not None and req.request_id in out.logprobs:
                seq.logprobs.append(self._logprob_entry(token, *out.logprobs[req.request_id]))
                seq.cumulative_logprob += out.logprobs[req.request_id][0]
            # Here a finished-stopped request stopped on eos or a stop token id: its text is not
            # shown (stop strings are found just below, by the detokenizer).
            stopped_on_token = req.status is RequestStatus.FINISHED_STOPPED
            show_token = not stopped_on_token or req.sampling_params.include_stop_str_in_output
            if seq.text_at_finish:
                if req.is_finished:
                    ids = req.output_token_ids if show_token else req.output_token_ids[:-1]
                    seq.detokenizer.add_tokens(ids)
            elif show_token:
                stop = seq.detokenizer.add_tokens([token])
                if stop is not None and not req.is_finished:
                    req.stop_reason = stop
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            # A user request finishes only in a step where one of its sequences finishes.
            if seq.user_id not in touched and (req.is_finished or self._requests[seq.user_id].stream):
                touched[seq.user_id] = self._requests[seq.user_id]
        outputs = []
        for user in touched.values():
            finished = user.finished
            if user.stream or finished:
                outputs.append(self._make_output(user))
            if finished:
                del self._requests[user.request_id]
                for seq in user.sequences:
                    self._sequence_of.pop(seq.request.request_id, None)
        return outputs

    def _logprob_entry(self, token: int, lp: float, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        entry = {tid: Logprob(tlp, rank, self.tokenizer.decode([tid], skip_special_tokens=False))
                 for rank, (tid, tlp) in enumerate(top, start=1)}
        if token not in entry:
            entry[token] = Logprob(lp, None, self.tokenizer.decode([token], skip_special_tokens=False))
        return entry

    def _make_output(self, user: _UserRequest) -> RequestOutput:
        completions = []
        for index, seq in enumerate(user.sequences):
            req = seq.request
            finished = req.is_finished
            delta_ids = req.output_token_ids[seq.num_sent_tokens :]
            seq.num_sent_tokens = req.num_output_tokens
            completions.append(
                CompletionOutput(
                    index=index,
                    text=seq.detokenizer.text,
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=seq.logprobs,
                    finish_reason=req.status.value if finished else None,
                    stop_reason=req.stop_reason,
                    delta_text=seq.detokenizer.take_delta(finished=finished),
                    delta_token_ids=delta_ids,
                )
            )
        reqs = [s.request for s in user.sequences]

        def earliest(name: str) -> float | None:
            times = [getattr(r, name) for r in reqs if getattr(r, name) is not None]
            return min(times) if times else None

        def latest(name: str) -> float | None:
            times = [getattr(r, name) for r in reqs if getattr(r, name) is not None]
            return max(times) if times else None

        metrics = RequestMetrics(
            arrival_time=user.arrival_time,
            first_scheduled_time=earliest("first_scheduled_time"),
            first_token_time=earliest("first_token_time"),
            last_token_time=latest("last_token_time"),
            finish_time=latest("finish_time") if user.finished else None,
        )
        first = reqs[0]
        return RequestOutput(
            request_id=user.request_id,
            prompt=user.prompt,
            prompt_token_ids=user.prompt_token_ids,
            outputs=completions,
            finished=user.finished,
            metrics=metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0),
        )


def _free_memory(device: torch.device) -> float:
    """Bytes free for the KV pool on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
