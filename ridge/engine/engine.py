"""The engine: requests in, ``RequestOutput`` objects out, one step at a time.

    step():  plan = scheduler.schedule()  ->  out = runner.run(plan)  ->  outputs of (plan, out)

The outputs are the ``OutputProcessor``'s work (text, stop strings, logprob texts).
``add_request`` validates everything before it changes any state, so bad input raises
``ValueError`` for that request alone and never disturbs the others. The engine is not
thread-safe: one thread (the ``LLM`` loop, or the server's engine loop) drives it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time

import torch

from ridge.config import EngineConfig, ModelConfig, resolve_device, resolve_dtype
from ridge.engine.output_processor import OutputProcessor, RequestState, SequenceState
from ridge.engine.outputs import RequestOutput
from ridge.engine.request import Request, RequestStatus
from ridge.engine.runner import ModelRunner
from ridge.engine.scheduler import ChunkKind, Scheduler, SchedulerConfig
from ridge.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer, load_tokenizer
from ridge.kv import cache as kv_cache
from ridge.kv.manager import KVCacheManager
from ridge.layers.cpu_kernels import select_kernels
from ridge.models.loader import load_model, read_hf_config
from ridge.quantization.config import QuantizationConfig
from ridge.roofline.ops import step_cost_from_counts
from ridge.roofline.probe import local_hardware, probe_linear_flops
from ridge.roofline.shapes import ModelShape
from ridge.sampling import Sampler, SamplingParams, SamplingState
from ridge.spec_decode.config import SpeculativeConfig
from ridge.spec_decode.draft import DraftProposer
from ridge.spec_decode.ngram import NgramProposer
from ridge.spec_decode.policy import SpeculationPolicy
from ridge.spec_decode.speculator import Speculator
from ridge.telemetry import TORCH_TO_ROOFLINE_DTYPE, Telemetry, cuda_hardware

# tokenizer="bytes": UTF-8 bytes as tokens, no files (random models, token-id-only use).
BYTES_TOKENIZER = "bytes"

# Without --kv-cache-memory the pool takes this share of free memory, but never more than
# max_num_seqs full-length sequences need.
DEFAULT_KV_MEMORY_FRACTION = {"cpu": 0.25, "cuda": 0.80}

# Prompts longer than max_model_len x (the longest token's characters) x this are refused
# before tokenizing. The margin covers normalizers that shorten text (NFKC ligatures, ...);
# only a tokenizer that merges runs of unknown characters into one token could beat it.
PROMPT_CHARS_MARGIN = 4

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        hf_config, model_dir = read_hf_config(config.model)
        model_config = ModelConfig.from_hf_config(hf_config, config.max_model_len)
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        quant = QuantizationConfig.from_name(config.quantization)
        loaded = load_model(
            hf_config, model_config, model_dir, self.dtype, self.device, config.max_model_len, config.seed, quant
        )
        self.model = loaded.model
        self.model.set_kernels(select_kernels(config.kernels, self.device, self.dtype))
        for line in quant.summary():
            logger.info("weights: %s", line)
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
        # The longest prompt text worth tokenizing: no longer text fits in max_model_len tokens
        # (the tokenizer's longest token, with a margin). Checked before tokenizing, so a huge
        # prompt is refused at once instead of after seconds of tokenization.
        self.max_prompt_chars = self.max_model_len * self.tokenizer.max_token_chars * PROMPT_CHARS_MARGIN

        self.kv_spec = self.model.kv_cache_spec()
        self.num_kv_blocks = self._num_kv_blocks()
        self.kv_caches = kv_cache.allocate(
            self.kv_spec, self.num_kv_blocks, config.block_size, self.dtype, self.device, config.kv_cache_dtype
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.3g GiB, %s)",
            self.num_kv_blocks,
            config.block_size,
            self.num_kv_blocks * config.block_size,
            self.num_kv_blocks * self.kv_bytes_per_block / 2**30,
            str(self.dtype).removeprefix("torch.") if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
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
        self.speculator = self._make_speculator(config.speculative_config)
        self.output_processor = OutputProcessor(self.tokenizer, stop=self._stop_on_string)
        self._ids = itertools.count()

    # -- sizing -------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        """What every layer keeps for one block of tokens, as the model declares it (K and V, or
        MLA's latent; an int8/fp8 cache: codes and scales)."""
        return self.config.block_size * self.kv_spec.bytes_per_token(self.config.kv_cache_dtype, self.dtype)

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
        # Weights priced by what the loaded layers hold (a quantized layer's blocks and scales,
        # a repacked layer's padding), not by the dtype: bytes per matrix parameter.
        weight_bytes = self.model.linear_weight_bytes() / max(1, self.model.linear_weight_params())
        if self.device.type == "cuda":
            hardware_fn = functools.partial(cuda_hardware, self.device)
        else:
            hardware_fn = local_hardware
        return Telemetry(
            model=ModelShape.from_model_config(self.model_config, self.config.model),
            weight_bytes=weight_bytes,
            # per cached element: codes plus each token-head's scale
            kv_bytes=self.kv_spec.bytes_per_element(self.config.kv_cache_dtype, self.dtype),
            act_bytes=elem,
            compute_dtype=TORCH_TO_ROOFLINE_DTYPE[str(self.dtype)],
            hardware_fn=hardware_fn,
        )

    def _make_speculator(self, spec: SpeculativeConfig | None) -> Speculator | None:
        if spec is None:
            return None
        telemetry = self.telemetry
        peak: list[float] = []

        def step_time(batch: int, rows: int, context: int) -> float:
            """The roofline floor of ``batch`` sequences running ``rows`` query rows each: the
            analyzer's bytes over the measured bandwidth, its FLOPs over what this engine's own
            matmul kernel reaches (measured once; the machine's best GEMM can be far faster)."""
            if not peak:
                layer = max(self.model.linear_layers(), key=lambda m: m.in_features * m.out_features)
                # enough rows to be compute-bound: a GPU's small matmuls measure launch latency
                rows = 2048 if self.device.type == "cuda" else 32
                kernel = probe_linear_flops(self.model.kernels.matmul, layer, self.dtype, self.device, rows=rows)
                peak.append(min(kernel, telemetry.hardware.peak(telemetry.compute_dtype)))
                logger.info("speculation cost model: matmul kernel %.0f GFLOP/s", peak[0] / 1e9)
            cost = step_cost_from_counts(
                telemetry.model,
                {(rows, max(rows, context)): batch},
                telemetry.weight_bytes,
                telemetry.kv_bytes,
                telemetry.act_bytes,
                logit_rows=batch * rows,
            )
            return max(cost.flops / peak[0], cost.bytes / telemetry.hardware.bandwidth_bytes_per_s)

        if spec.method == "ngram":
            proposer, proposer_cost = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max), 0.0
        else:
            cfg = self.model_config
            proposer = DraftProposer.load(
                spec.model,
                spec.draft_options,
                target_vocab_size=cfg.vocab_size,
                max_model_len=self.max_model_len,
                # the target's pool, plus room for each sequence's drafts
                num_tokens=self.num_kv_blocks * self.config.block_size
                + self.config.max_num_seqs * (spec.num_speculative_tokens + 1),
                dtype=self.dtype,
                device=self.device,
                block_size=self.config.block_size,
                seed=self.config.seed,
                kernels=self.config.kernels,
            )
            # a draft pass against a target step: both read their weights once (memory-bound)
            proposer_cost = proposer.weight_bytes / max(1, self.model.linear_weight_bytes())
            telemetry.draft = proposer.pricing  # the draft's passes count in the steps' cost
        policy = SpeculationPolicy(spec.num_speculative_tokens, step_time, proposer_cost=proposer_cost)
        logger.info(
            "speculative decoding: %s, up to %d tokens per step%s",
            spec.method,
            spec.num_speculative_tokens,
            " (adaptive)" if spec.adaptive else "",
        )
        return Speculator(spec, proposer, self.max_model_len, policy)

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

        Atomic: every check (ids, prompt, lengths, params) runs before any state changes, so
        a refused request leaves the engine exactly as it was. ``stream=False``: ``step``
        returns this request's output only once it finishes (``LLM.generate`` does this; a
        server streams).
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # n > 1: sequence ids "<id>#<index>", which another request's id may already hold.
        seq_ids = [f"{request_id}#{i}" for i in range(params.n)] if params.n > 1 else [request_id]
        taken = [sid for sid in seq_ids if self.output_processor.has_sequence(sid)]
        if taken:
            raise ValueError(f"request id {request_id!r} clashes with the running sequence {taken[0]!r}")
        prompt_text, prompt_ids = self._tokenize(prompt)
        max_tokens = self._resolve_max_tokens(prompt_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time

        user = RequestState(
            request_id,
            prompt_text,
            prompt_ids,
            arrival,
            stream,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        for index, seq_id in enumerate(seq_ids):
            seq_params = params.for_sample(index)
            req = Request(
                request_id=seq_id,
                prompt_token_ids=list(prompt_ids),
                sampling_params=seq_params,
                max_tokens=max_tokens,
                arrival_time=arrival,
                eos_token_ids=self.eos_token_ids,
            )
            req.sampling_state = SamplingState(
                seq_params, req.prompt_token_ids, req.output_token_ids, self.eos_token_ids
            )
            detok = IncrementalDetokenizer(
                self.tokenizer,
                req.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            # Logprob tokens take their text from the detokenizer step by step.
            text_at_finish = not stream and not params.stop and params.logprobs is None
            user.sequences.append(
                SequenceState(
                    request_id, req, detok, [] if params.logprobs is not None else None, text_at_finish=text_at_finish
                )
            )
        # Nothing above changed the engine; from here on nothing can fail.
        self.output_processor.add(user)
        for seq in user.sequences:
            self.scheduler.add_request(seq.request)
        return request_id

    def check_prompt_chars(self, num_chars: int) -> None:
        """ValueError when a prompt of ``num_chars`` characters cannot fit the context."""
        if num_chars > self.max_prompt_chars:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt has "
                f"{num_chars} characters: more than {self.max_model_len} tokens of this tokenizer can hold "
                f"(at most {self.tokenizer.max_token_chars} characters per token). Please shorten the prompt."
            )

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self.check_prompt_chars(len(prompt))
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt token ids are empty")
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})"
                )
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
        user = self.output_processor.remove(request_id)
        if user is None:
            return
        for seq in user.sequences:
            self.scheduler.abort(seq.request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that progressed."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        out = self.runner.run(plan, self.scheduler.requests)
        progressed = self.scheduler.update(plan, out.sampled)
        outputs = self.output_processor.process(progressed, out.logprobs, out.prompt_logprobs)
        if self.speculator is not None:
            self.speculator.record(out.verified, time.perf_counter() - start)
            self.speculator.propose(self.scheduler.running, self.scheduler.requests)
        shapes: dict[ChunkKind, list] = {kind: [] for kind in ChunkKind}
        for c in plan.chunks:
            shapes[c.kind].append(c.end if c.kind is ChunkKind.DECODE else (c.num_new_tokens, c.end))
        self.telemetry.record(
            shapes[ChunkKind.PREFILL],
            shapes[ChunkKind.DECODE],
            time.perf_counter() - start,
            shapes[ChunkKind.VERIFY],
            self.speculator.proposer.take_passes() if self.speculator is not None else (),
            self.model.experts_touched(),
        )
        return outputs

    def _stop_on_string(self, req: Request, stop: str) -> None:
        req.stop_reason = stop
        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)


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
