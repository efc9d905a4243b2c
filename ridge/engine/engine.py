"""The engine: requests in, ``RequestOutput`` objects out, one step at a time.

    step():  plan = scheduler.schedule()                       plain data (engine/step.py)
             out = executor.execute_model(plan)                 the workers run the model
             result = output_processor.process(plan, out)       stops, text, logprobs
             scheduler.update(plan, result.accepted, result.finished)

The engine never holds a model: the executor (``engine/executor.py``) drives the workers
that own it. ``add_request`` validates everything before it changes any state, so bad input
raises ``ValueError`` for that request alone and never disturbs the others. The engine is
not thread-safe: one thread (the ``LLM`` loop, or the server's engine loop) drives it.
``stats()`` is its state as data (what ``/metrics`` renders).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import uuid
import weakref
from typing import Any

from ridge.config import EngineConfig
from ridge.distributed.probe import local_link
from ridge.engine.disaggregation import KVTransferCoordinator
from ridge.engine.executor import make_executor
from ridge.engine.output_processor import OutputProcessor, RequestState, SequenceState
from ridge.engine.outputs import RequestOutput
from ridge.engine.request import Request, RequestStatus
from ridge.engine.scheduler import ChunkKind, Scheduler, SchedulerConfig
from ridge.engine.stats import EngineStats
from ridge.engine.step import RunnerOutput, SchedulerOutput
from ridge.engine.stop import StopLimits
from ridge.engine.structured import StructuredOutputs
from ridge.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer, load_tokenizer
from ridge.kv.manager import KVCacheManager
from ridge.kv_transfer.config import KVTransferParams, RemoteKV
from ridge.roofline.ops import CostConventions
from ridge.roofline.probe import local_hardware
from ridge.sampling import SamplingParams
from ridge.spec_decode.config import SpeculativeConfig
from ridge.spec_decode.policy import SpeculationPolicy
from ridge.spec_decode.proposer import ProposalRequest, make_proposer
from ridge.spec_decode.speculator import Speculator
from ridge.telemetry import TORCH_TO_ROOFLINE_DTYPE, ModelPricing, Telemetry, cuda_hardware
from ridge.worker.worker import WorkerConfig

# tokenizer="bytes": UTF-8 bytes as tokens, no files (random models, token-id-only use).
BYTES_TOKENIZER = "bytes"

# Prompts longer than max_model_len x (the longest token's characters) x this are refused
# before tokenizing. The margin covers normalizers that shorten text (NFKC ligatures, ...);
# only a tokenizer that merges runs of unknown characters into one token could beat it.
PROMPT_CHARS_MARGIN = 4

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # this engine's name among its KV-transfer peers (a restarted instance is a new peer)
        self.engine_id = f"ridge-{uuid.uuid4().hex[:12]}"
        spec = config.speculative_config
        worker_config = WorkerConfig.from_engine_config(
            config, engine_id=self.engine_id, num_speculative_tokens=spec.num_speculative_tokens if spec else 0
        )
        self.executor = make_executor(worker_config)
        # the ranks stop with the engine, even one nobody shuts down
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        try:
            self._build(config)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:
        info = self.model_info = self.executor.info
        self.model_config, self.hf_config = info.config, info.hf_config
        self.dtype, self.device = info.dtype, info.device
        self.max_model_len = info.max_model_len
        if config.tokenizer == BYTES_TOKENIZER or (config.tokenizer is None and info.model_dir is None):
            self.tokenizer = ByteTokenizer()
            if self.model_config.vocab_size < self.tokenizer.vocab_size:
                raise ValueError(
                    f"random model vocab ({self.model_config.vocab_size}) is smaller than the byte tokenizer's "
                    f"({self.tokenizer.vocab_size})"
                )
        else:
            self.tokenizer = load_tokenizer(config.tokenizer or info.model_dir)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        # The longest prompt text worth tokenizing: no longer text fits in max_model_len tokens
        # (the tokenizer's longest token, with a margin). Checked before tokenizing, so a huge
        # prompt is refused at once instead of after seconds of tokenization.
        self.max_prompt_chars = self.max_model_len * self.tokenizer.max_token_chars * PROMPT_CHARS_MARGIN

        self.num_kv_blocks = self.executor.available_kv_blocks(config.max_num_seqs)
        self.executor.init_kv_cache(self.num_kv_blocks, self.eos_token_ids)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.3g GiB, %s)",
            self.num_kv_blocks,
            config.block_size,
            self.num_kv_blocks * config.block_size,
            self.num_kv_blocks * info.kv_bytes_per_block / 2**30,
            str(self.dtype).removeprefix("torch.") if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        )
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                policy=config.scheduler,
                enable_chunked_prefill=config.enable_chunked_prefill,
                num_scheduler_steps=config.num_scheduler_steps,
            ),
            self.kv,
            self.max_model_len,
        )
        self.telemetry = self._make_telemetry()
        self.speculator = self._make_speculator(config.speculative_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)
        self._ids = itertools.count()
        # producer: request id -> its sequences (transfers), and the seeded ones' generator
        # states after their first token, until the request's final output carries them
        self._handovers: dict[str, list[str]] = {}
        self._generator_states: dict[str, bytes] = {}
        # asynchronous scheduling: the launched step whose output the next step() collects
        # (its plan, the workers' handle, when it was scheduled)
        self._inflight: tuple[SchedulerOutput, Any, float] | None = None
        self._collected_at = 0.0  # when the last launched step was collected
        self.kv_transfer: KVTransferCoordinator | None = None
        if config.kv_transfer_config is not None:
            self.kv_transfer = KVTransferCoordinator(
                config.kv_transfer_config,
                self.engine_id,
                self.scheduler,
                self.executor,
                self.kv_bytes_per_block,
                config.tensor_parallel_size,
            )
            logger.info(
                "KV transfer: %s %s on %s:%d",
                config.kv_transfer_config.kv_role,
                self.engine_id,
                config.kv_transfer_config.kv_ip,
                config.kv_transfer_config.kv_port,
            )

    # -- sizing -------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        return self.model_info.kv_bytes_per_block

    def _make_telemetry(self) -> Telemetry:
        if self.device.type == "cuda":
            hardware_fn = functools.partial(cuda_hardware, self.device)
        else:
            hardware_fn = local_hardware
        return Telemetry(
            pricing=ModelPricing.of(self.model_info),
            compute_dtype=TORCH_TO_ROOFLINE_DTYPE[str(self.dtype)],
            hardware_fn=hardware_fn,
            tensor_parallel=self.config.tensor_parallel_size,
            link_fn=local_link if self.device.type == "cpu" else None,
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
                # enough rows to be compute-bound: a GPU's small matmuls measure launch latency
                kernel = self.executor.probe_matmul_flops(2048 if self.device.type == "cuda" else 32)
                peak.append(min(kernel, telemetry.hardware.peak(telemetry.compute_dtype)))
                logger.info("speculation cost model: matmul kernel %.0f GFLOP/s", peak[0] / 1e9)
            cost = telemetry.pricing.cost_from_counts(
                {(rows, max(rows, context)): batch},
                conventions=CostConventions(tensor_parallel=self.config.tensor_parallel_size),
                logit_rows=batch * rows,
            )
            return cost.time_s(peak[0], telemetry.hardware.bandwidth_bytes_per_s)

        proposer = make_proposer(
            spec,
            target_vocab_size=self.model_config.vocab_size,
            # the target's pool, plus room for each sequence's drafts
            num_tokens=self.num_kv_blocks * self.config.block_size
            + self.config.max_num_seqs * (spec.num_speculative_tokens + 1),
            dtype=self.dtype,
            device=self.device,
            block_size=self.config.block_size,
            seed=self.config.seed,
            kernels=self.config.kernels,
            max_num_seqs=self.config.max_num_seqs,
        )
        proposer_cost = 0.0
        if spec.method == "draft_model":
            # a draft pass against a target step: both read their weights once (memory-bound)
            proposer_cost = proposer.weight_bytes / max(1, self.model_info.weight_bytes)
            telemetry.draft = ModelPricing.of(proposer.info)  # the draft's passes count in the steps' cost
            if proposer.max_model_len < self.max_model_len:
                logger.info(
                    "the draft model's context (%d tokens) is shorter than max_model_len (%d): it proposes "
                    "only for sequences that fit it",
                    proposer.max_model_len,
                    self.max_model_len,
                )
        policy = SpeculationPolicy(spec.num_speculative_tokens, step_time, proposer_cost=proposer_cost)
        logger.info(
            "speculative decoding: %s, up to %d tokens per step%s",
            spec.method,
            spec.num_speculative_tokens,
            " (adaptive)" if spec.adaptive else "",
        )
        return Speculator(spec, proposer, policy)

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        stream: bool = True,
        kv_transfer: KVTransferParams | None = None,
    ) -> str:
        """Validate and queue a request (n sequences); returns its id. Raises ValueError on bad input.

        ``kv_transfer`` (disaggregated serving, ``engine/disaggregation.py``): on a producer,
        ``do_remote_decode`` keeps each sample's blocks after the request ends, for a consumer
        to pull (the final output's ``kv_handover`` names the transfers); on a consumer,
        ``do_remote_prefill`` starts each sample from the token the producer sampled and pulls
        the prompt's cache instead of computing it.

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
        if kv_transfer is not None and (kv_transfer.do_remote_decode or kv_transfer.do_remote_prefill):
            if self.kv_transfer is None:
                raise ValueError("kv_transfer_params: this instance has no --kv-transfer-config")
            self.kv_transfer.check_request(kv_transfer, len(prompt_ids), params)
        else:
            kv_transfer = None
        # a constraint that does not compile is refused here (cached: a repeat costs nothing)
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        arrival = time.monotonic() if arrival_time is None else arrival_time

        user = RequestState(
            request_id,
            prompt_text,
            prompt_ids,
            arrival,
            stream,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        requests = []
        for index, seq_id in enumerate(seq_ids):
            seq_params = params.for_sample(index)
            req = Request(seq_id, list(prompt_ids), seq_params, max_tokens, arrival)
            if kv_transfer is not None:
                req.kv_park = kv_transfer.do_remote_decode
                if kv_transfer.do_remote_prefill:
                    # the producer's first token; the samples after the first wait for its
                    # blocks, to find them in the prefix cache and pull only their own tail
                    req.append_output_token(kv_transfer.first_tokens[index])
                    req.remote = RemoteKV(kv_transfer.remote_engine_id, kv_transfer.transfer_ids[index])
                    req.generator_state = kv_transfer.generator_states[index]
                    req.follows = seq_ids[0] if index else None
            requests.append(req)
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            # Logprob tokens take their text from the detokenizer step by step.
            text_at_finish = not stream and not params.stop and params.logprobs is None
            limits = StopLimits(seq_params, max_tokens, len(prompt_ids), self.max_model_len, self.eos_token_ids)
            user.sequences.append(
                SequenceState(
                    request_id,
                    seq_id,
                    limits,
                    detok,
                    [] if params.logprobs is not None else None,
                    text_at_finish=text_at_finish,
                )
            )
        # Nothing above changed the engine; from here on nothing can fail.
        self.output_processor.add(user)
        if grammar is not None:
            for req in requests:
                self.structured.add(req.request_id, grammar)
                self.structured.accept({req.request_id: req.output_token_ids})  # a producer's first token
        if kv_transfer is not None and kv_transfer.do_remote_decode:
            self._handovers[request_id] = seq_ids
        for index, req in enumerate(requests):
            if req.remote is not None:
                logprobs = kv_transfer.first_logprobs[index]
                if self.output_processor.start_with(req.request_id, req.output_token_ids[0], logprobs):
                    self.scheduler.release_remote(req.request_id, req.remote)  # ended on it: no cache needed
                    continue
                if req.follows is not None and req.follows not in self.scheduler.requests:
                    req.follows = None
            self.scheduler.add_request(req)
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
        user = self.output_processor.abort(request_id)
        if user is None:
            return
        for sid in self._handovers.pop(request_id, ()):
            self._generator_states.pop(sid, None)
        for seq in user.sequences:
            self.scheduler.abort(seq.seq_id)
        self.structured.drop(seq.seq_id for seq in user.sequences)

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, KV transfers under way (which need the steps to go on), or a
        launched step to collect."""
        return bool(self.output_processor.requests) or self.scheduler.kv_pending or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that progressed.

        With ``async_scheduling`` (vLLM's flag) a step schedules and launches the next plan,
        then collects the one launched before it: on a GPU the host's scheduling, input
        building and output processing overlap the device's forward pass. Each running
        sequence's next token is assumed to come (the workers feed it to the next step
        from the device); a sequence that stopped costs one step of wasted work. Steps that
        need the host to see every token first (structured output, penalties, min_tokens)
        run synchronously, after collecting; so do speculative decoding's steps while its
        policy drafts (a verify step needs the last tokens on the host to propose from), and
        the plain steps between run pipelined. The configuration refuses the flag with KV
        transfer and tensor parallelism."""
        if self._pipelines():
            return self._step_async()
        if self._inflight is not None:  # the pipeline drains: collected, the tokens are all on the host
            outputs = self._collect(peek=False)
            if self.speculator is not None:
                self._propose()  # a verify step next, not first a synchronous plain one
            return outputs
        return self._step_sync()

    def _pipelines(self) -> bool:
        """Whether this step may run asynchronously (``step``)."""
        if not self.config.async_scheduling or self.kv_transfer is not None:
            return False
        for req in self.scheduler.requests.values():
            p = req.sampling_params
            if p.has_penalties or p.min_tokens or p.structured_outputs is not None:
                return False
        if self.speculator is not None:
            # only while the policy drafts nothing (it measured that drafting does not pay here)
            running = self.scheduler.running
            if any(r.spec_token_ids for r in running):
                return False  # proposals wait for this step: it verifies them
            k = self.speculator.choose_k(len(running), max((r.num_tokens for r in running), default=0))
            # a lookup that found nothing last time (a peek between pipelined steps) would draft
            # nothing now: stay pipelined
            return k == 0 or self.speculator.drafts_nothing()
        return True

    def _step_async(self) -> list[RequestOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            outputs = self._collect() if self._inflight is not None else []
            return outputs + self.output_processor.take_pending()
        launched = self.executor.launch_model(plan)
        self.scheduler.launched(plan)
        outputs = self._collect() if self._inflight is not None else []
        self._inflight = (plan, launched, start)
        return outputs

    def _collect(self, peek: bool = True) -> list[RequestOutput]:
        """The launched step's output: its tokens, stops and outputs, then the scheduler's
        update; with ``peek``, a host-only proposer's look at the collected tokens
        (``Speculator.peek``) while the next step runs."""
        plan, launched, start = self._inflight
        self._inflight = None
        out = self.executor.finish_model(launched)
        result = self.output_processor.process(plan, out)
        finished = {rid: RequestStatus(reason) for rid, reason in result.finished.items()}
        self.scheduler.update(plan, result.accepted, finished, launched=True)
        # the step's wall time is the pipeline's period: from the later of its scheduling and the
        # last collection (two steps overlap: their spans would count the same time twice)
        now, begun = time.perf_counter(), max(start, self._collected_at)
        self._record(plan, out, begun, 0.0, now)
        if self.speculator is not None and _decodes_only(plan):  # what a step that drafts nothing costs
            self.speculator.observe_plain_step(len(plan.chunks), now - begun)
        self._collected_at = now
        if peek and self.speculator is not None and self.speculator.peeks:
            self.speculator.peek(self._proposal_requests(self.scheduler.decoding()))
        return result.outputs

    def _step_sync(self) -> list[RequestOutput]:
        start = time.perf_counter()
        failures = self.kv_transfer.before_schedule() if self.kv_transfer is not None else []
        plan = self.scheduler.schedule()
        mask_s = self.structured.fill_plan(plan)
        if plan.is_empty:
            outputs = self._fail(failures) + self.output_processor.take_pending()
            if self.kv_transfer is not None:
                outputs += self._fail(self.kv_transfer.after_step())
                if self.scheduler.kv_pending and not outputs:
                    self.kv_transfer.idle_wait()
            return outputs
        out = self.executor.execute_model(plan)
        result = self.output_processor.process(plan, out)
        finished = {rid: RequestStatus(reason) for rid, reason in result.finished.items()}
        self.scheduler.update(plan, result.accepted, finished)
        self.structured.accept(result.accepted)
        self.structured.drop(finished)
        if self.kv_transfer is not None:
            failures += self.kv_transfer.after_step()
            result.outputs.extend(self._fail(failures))
            self._generator_states.update(out.generator_states)
            self._attach_handovers(result.outputs)
        if not plan.chunks:
            return result.outputs
        if self.speculator is not None:
            self.speculator.record(out.verified, time.perf_counter() - start, _decodes_only(plan))
            self._propose()
        self._record(plan, out, start, mask_s)
        return result.outputs

    def _record(
        self, plan: SchedulerOutput, out: RunnerOutput, start: float, mask_s: float, end: float | None = None
    ) -> None:
        """The step on the roofline (telemetry): its chunks' shapes and what it took (``end``
        given: a collected step of the pipeline, whose time is the pipeline's period). A
        multi-step plan's passes are steps of their own, each an equal share of its time."""
        shapes: dict[ChunkKind, list] = {kind: [] for kind in ChunkKind}
        for c in plan.chunks:
            shapes[c.kind].append(c.end if c.kind is ChunkKind.DECODE else (c.num_new_tokens, c.end))
        n = plan.num_steps
        wall_s = (time.perf_counter() if end is None else end) - start
        for i in range(n):
            self.telemetry.record(
                shapes[ChunkKind.PREFILL],
                [context + i for context in shapes[ChunkKind.DECODE]],
                wall_s / n,
                shapes[ChunkKind.VERIFY],
                self.speculator.proposer.take_passes() if self.speculator is not None else (),
                out.experts_touched,
                out.comm_s / n,
                mask_s / n,
                None if out.matmul_s is None else out.matmul_s / n,
                None if out.step_parts is None else {part: s / n for part, s in out.step_parts.items()},
                pipelined=end is not None,
            )

    def _attach_handovers(self, outputs: list[RequestOutput]) -> None:
        """Producer: a finished prefill-only request's output names its transfers."""
        for output in outputs:
            seq_ids = self._handovers.pop(output.request_id, None) if output.finished else None
            if seq_ids is not None:
                output.kv_handover = {
                    "transfer_ids": seq_ids,
                    "generator_states": [self._generator_states.pop(sid, None) for sid in seq_ids],
                }

    def _fail(self, failures: list[tuple[str, str]]) -> list[RequestOutput]:
        """End the user requests of failed sequences; their final outputs carry the error."""
        outputs = []
        for seq_id, message in failures:
            failed = self.output_processor.fail(seq_id, message)
            if failed is None:
                continue
            output, seq_ids = failed
            for sid in seq_ids:
                self.scheduler.abort(sid)
            self.structured.drop(seq_ids)
            outputs.append(output)
        return outputs

    # -- disaggregated serving ------------------------------------------------------------
    def prepare(self, params: SamplingParams) -> None:
        """Compile what ``params`` constrain (thread-safe; cached for ``add_request``, which
        then compiles nothing on the engine's thread); ValueError when it does not compile."""
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)

    def kv_info(self) -> dict | None:
        """This instance's KV-transfer identity (role, endpoint, layout), or None without one."""
        return self.kv_transfer.info() if self.kv_transfer is not None else None

    def set_wakeup(self, callback) -> None:
        """``callback()`` (from another thread) when something that needs a step arrived while
        nothing was running: a KV transfer's pull, arrival or failure."""
        if self.kv_transfer is not None:
            self.kv_transfer.connector.set_wakeup(callback)

    def kv_connect(self, peer: dict) -> None:
        """Pair with a peer instance (its ``kv_info()``); ValueError when it cannot."""
        if self.kv_transfer is None:
            raise ValueError("this instance has no --kv-transfer-config")
        self.kv_transfer.connect(peer)

    def _propose(self) -> None:
        """Ask the speculator for the next step's proposals and hand them to the scheduler."""
        decoding = self.scheduler.decoding()
        room = {
            r.request_id: min(r.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens) for r in decoding
        }
        running = {r.request_id for r in self.scheduler.running}
        proposals = self.speculator.propose(self._proposal_requests(decoding), room, running)
        for rid, (tokens, probs) in list(proposals.items()):
            keep = self.structured.vet(rid, tokens)  # a constrained sequence's grammar vets its drafts
            if keep < len(tokens):
                proposals[rid] = (tokens[:keep], probs[:keep] if probs is not None else None)
        if proposals:
            self.scheduler.set_proposals(proposals)

    @staticmethod
    def _proposal_requests(decoding) -> list[ProposalRequest]:
        return [ProposalRequest(r.request_id, r.all_token_ids, r.sampling_params) for r in decoding]

    # -- state as data ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The engine's state now, as plain data (what ``/metrics`` renders)."""
        return EngineStats.collect(self)

    def score(self, ids: list[int]):
        """(T - 1, V) float32 log-probabilities of each next token of ``ids`` under the model
        (``ridge bench quality``); the engine must be idle."""
        if self.has_unfinished_requests():
            raise ValueError("the engine must be idle")
        return self.executor.score(ids)

    def resolve_roofline(self) -> None:
        """Probe (or read from cache) the hardware the steps are priced against, now."""
        _ = self.telemetry.ceiling

    def shutdown(self) -> None:
        """Stop the executor's ranks (idempotent)."""
        self._finalizer()


def _decodes_only(plan: SchedulerOutput) -> bool:
    """A step of decodes and verifies alone (no prompt chunk): its time prices a decode step."""
    return all(c.kind is not ChunkKind.PREFILL for c in plan.chunks)
