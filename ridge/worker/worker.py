"""A worker owns a model: it loads it (its shard, under tensor parallelism), picks its kernels,
sizes and allocates its KV pool and runs the steps it is handed, through its ``ModelRunner``.

    worker = Worker(WorkerConfig(...))       # loads the model
    worker.describe() -> ModelInfo           # what the engine needs to know, as data
    worker.available_kv_blocks(max_num_seqs) # what its memory holds
    worker.init_kv_cache(num_blocks)         # allocates the pool, builds the runner
    worker.execute_model(plan) -> RunnerOutput | None

The engine never holds the model: it talks to an executor (``engine/executor.py``) that
drives one worker in-process or one per rank. The draft model of speculative decoding is a
worker too (``spec_decode/draft.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import ModelConfig, resolve_device, resolve_dtype
from ridge.distributed.parallel import TensorParallel
from ridge.dtypes import canonical_dtype
from ridge.engine.step import RunnerOutput, SchedulerOutput
from ridge.kv import cache as kv_cache
from ridge.kv.cache import KVCacheSpec
from ridge.kv_transfer.connector import KVConnector, KVLayout, PeerInfo, block_bytes, make_connector
from ridge.layers.attention import AttentionMetadata, PrefillChunk
from ridge.layers.cpu_kernels import select_kernels
from ridge.models.loader import load_model, read_hf_config
from ridge.models.registry import model_class
from ridge.quantization.config import QuantizationConfig
from ridge.roofline.probe import probe_linear_flops
from ridge.sampling import Sampler
from ridge.worker import cuda_graphs
from ridge.worker.runner import LaunchedStep, ModelRunner

# Without --kv-cache-memory the pool takes this share of free memory, but never more than
# max_num_seqs full-length sequences need.
DEFAULT_KV_MEMORY_FRACTION = {"cpu": 0.25, "cuda": 0.80}

logger = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    """What a worker needs to build its model and pool (plain data: it travels to ranks)."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    quantization: str | None = None
    kernels: str = "auto"
    enforce_eager: bool = False  # no decode plan on CPU, no CUDA graphs
    max_num_seqs: int = 256  # sizes the CUDA graphs' ladder
    num_speculative_tokens: int = 0  # a verify step runs up to max_num_seqs * (1 + k) decode rows
    kv_cache_dtype: str = "auto"
    kv_cache_memory: float | None = None  # GiB
    num_kv_blocks: int | None = None
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    kv_transfer_config: object = None  # a KVTransferConfig: the pool's blocks move to or from peers
    engine_id: str = ""  # the engine's name among its KV peers (the same on every rank)

    @classmethod
    def from_engine_config(cls, config, **overrides) -> WorkerConfig:
        values = {name: getattr(config, name) for name in cls.__dataclass_fields__ if hasattr(config, name)}
        values.update(overrides)
        return cls(**values)


@dataclass
class ModelInfo:
    """A worker's model, as data: what the engine sizes, validates and prices with."""

    config: ModelConfig
    hf_config: dict  # the checkpoint's config.json (a GGUF file's, translated)
    source: str  # the model spec
    model_dir: Path | None  # where its tokenizer lives (None: a random model)
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    kv_spec: KVCacheSpec  # this rank's share of a token's cache
    kv_cache_dtype: str
    block_size: int
    weight_bytes: int  # the linear layers' weights as held (this rank's shard)
    weight_params: int
    router_bytes_per_param: float | None  # an MoE's routers as held (None: no router)

    @property
    def kv_bytes_per_block(self) -> int:
        """What every layer keeps for one block of tokens, as the model declares it (K and V,
        or MLA's latent; an int8/fp8 cache: codes and scales)."""
        return self.block_size * self.kv_spec.bytes_per_token(self.kv_cache_dtype, self.dtype)

    @property
    def kv_bytes_per_element(self) -> float:
        return self.kv_spec.bytes_per_element(self.kv_cache_dtype, self.dtype)


class Worker:
    """``vocab_size``: the vocabulary the model must have (a draft shares its target's
    tokenizer), checked before any weight is read."""

    def __init__(self, config: WorkerConfig, vocab_size: int | None = None, tp: TensorParallel | None = None) -> None:
        self.config = config
        self.tp = tp = tp or TensorParallel()
        if config.num_threads and not tp.enabled:  # a rank's threads are set where it starts
            torch.set_num_threads(config.num_threads)
        # a rank's device is its group's (cuda:<local rank> on GPUs), not the configured name's
        self.device = tp.device if tp.enabled else resolve_device(config.device)
        hf_config, source = read_hf_config(config.model)
        model_config = ModelConfig.from_hf_config(hf_config, config.max_model_len)
        if vocab_size is not None and model_config.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model_config.vocab_size} tokens) differs from the target's "
                f"({vocab_size}): a draft must share the target's tokenizer"
            )
        if config.dtype != "auto":
            canonical_dtype(config.dtype)
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        kv_cache.check_kv_cache_dtype(config.kv_cache_dtype)
        quant = QuantizationConfig.from_name(config.quantization)
        loaded = load_model(
            hf_config, model_config, source, self.dtype, self.device, config.max_model_len, config.seed, quant, tp
        )
        self.model = loaded.model
        self.model.set_kernels(select_kernels(config.kernels, self.device, self.dtype))
        self.model.eager = config.enforce_eager
        for line in quant.summary():
            logger.info("weights: %s", line)
        self.info = ModelInfo(
            config=loaded.config,
            hf_config=loaded.hf_config,
            source=config.model,
            model_dir=loaded.model_dir,
            max_model_len=loaded.max_model_len,
            dtype=self.dtype,
            device=self.device,
            kv_spec=self.model.kv_cache_spec(),
            kv_cache_dtype=config.kv_cache_dtype,
            block_size=config.block_size,
            weight_bytes=self.model.linear_weight_bytes(),
            weight_params=self.model.linear_weight_params(),
            router_bytes_per_param=self.model.router_bytes_per_param(),
        )
        self.kv_caches: list = []
        self.runner: ModelRunner | None = None
        self.kv_connector: KVConnector | None = None

    def describe(self) -> ModelInfo:
        return self.info

    # -- the KV pool ----------------------------------------------------------------------
    def available_kv_blocks(self, max_num_seqs: int) -> int:
        """Blocks this worker's pool would hold: ``num_kv_blocks``, else ``kv_cache_memory`` (GiB
        per rank), else a share of free memory (split between the ranks of one machine) capped
        at what ``max_num_seqs`` full sequences need."""
        cfg, per_block = self.config, self.info.kv_bytes_per_block
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory:
            budget = cfg.kv_cache_memory * 2**30
        else:
            seq_blocks = -(-self.info.max_model_len // cfg.block_size)
            needed = max_num_seqs * seq_blocks * per_block
            share = DEFAULT_KV_MEMORY_FRACTION[self.device.type] / self._ranks_sharing_memory()
            budget = min(needed, share * free_memory(self.device))
        blocks = int(budget // per_block)
        if blocks < 1:
            raise ValueError(f"KV cache memory too small: one block needs {per_block} bytes; raise kv_cache_memory")
        return blocks

    def _ranks_sharing_memory(self) -> int:
        """Ranks whose pools come out of this rank's memory: on CPU every rank of this machine
        (all of them when ridge started them; torchrun says how many run here); a GPU is its own."""
        if self.device.type != "cpu" or not self.tp.enabled:
            return 1
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.tp.size))

    def init_kv_cache(self, num_blocks: int, eos_token_ids: frozenset[int] = frozenset()) -> None:
        """Allocate ``num_blocks`` blocks and the runner (``eos_token_ids``: what ``min_tokens`` masks)."""
        cfg = self.config
        self.kv_caches = kv_cache.allocate(
            self.info.kv_spec, num_blocks, cfg.block_size, self.dtype, self.device, cfg.kv_cache_dtype
        )
        sampler = Sampler(cfg.seed, argmax=self.model.kernels.argmax) if self.tp.rank == 0 else None
        self.runner = ModelRunner(self.model, self.kv_caches, cfg.block_size, self.device, sampler, eos_token_ids)
        self.graph_report = None
        if self.device.type == "cuda" and not cfg.enforce_eager:
            self._capture_graphs()
        if cfg.kv_transfer_config is not None:
            self.kv_connector = make_connector(
                cfg.kv_transfer_config, cfg.engine_id, self.kv_layout(), self.kv_caches, self.tp.rank, self.device
            )

    def _capture_graphs(self) -> None:
        """The decode step's CUDA graphs (``worker/cuda_graphs.py``), or a line saying why not."""
        reason = cuda_graphs.unsupported_reason(self.model, self.model.kernels)
        if reason is not None:
            logger.info("CUDA graphs: off (%s); decode steps run eagerly", reason)
            return
        graphs = cuda_graphs.DecodeGraphs(
            self.model,
            self.kv_caches,
            self.config.block_size,
            self.info.max_model_len,
            cuda_graphs.capture_sizes(self.config.max_num_seqs, self.config.num_speculative_tokens),
            self.device,
        )
        try:
            self.graph_report = graphs.capture()
        except RuntimeError as exc:  # a kernel that cannot be captured: eager steps, loudly
            logger.warning("CUDA graphs: capture failed (%s); decode steps run eagerly", exc)
            return
        self.runner.graphs = graphs

    # -- KV transfer between instances ----------------------------------------------------
    def kv_layout(self) -> KVLayout:
        """What a peer's pool must share with this one for blocks to move between them."""
        spec = self.info.kv_spec
        return KVLayout(
            model=self.model_fingerprint(),
            num_layers=spec.num_layers,
            num_heads=spec.num_heads,
            head_dim=spec.head_dim,
            keys_only=spec.keys_only,
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=self.config.kv_cache_dtype,
            block_size=self.config.block_size,
            tensor_parallel_size=self.tp.size,
            device_type=self.device.type,
            bytes_per_block=block_bytes(self.kv_caches),
        )

    def model_fingerprint(self) -> str:
        """A digest of the checkpoint's config and the first values of its embedding (the same
        file, or random weights of the same preset and seed, give the same digest)."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(json.dumps(self.info.hf_config, sort_keys=True, default=str).encode())
        for name, param in sorted(self.model.named_parameters()):
            if "embed" in name:
                digest.update(param.detach().reshape(-1)[:256].float().cpu().numpy().tobytes())
                break
        return digest.hexdigest()

    def close(self) -> None:
        """Stop moving KV blocks (the peers see this instance go); idempotent."""
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None

    def kv_connect(self, peer: PeerInfo) -> str | None:
        """Pair this rank with ``peer``'s; returns why it cannot (None: paired)."""
        try:
            self.kv_connector.connect(peer)
        except ValueError as exc:
            return str(exc)
        return None

    # -- steps ----------------------------------------------------------------------------
    def execute_model(self, plan: SchedulerOutput) -> RunnerOutput | None:
        return self.finish_model(self.launch_model(plan))

    def launch_model(self, plan: SchedulerOutput) -> LaunchedStep:
        """The plan's KV moves, then its step enqueued (``ModelRunner.launch``)."""
        connector = self.kv_connector
        if connector is not None:  # blocks move before the forward pass writes any of them
            connector.drop(plan.finished_req_ids)
            connector.start_sends(plan.kv_sends)
            connector.start_recvs(plan.kv_recvs)
            connector.finish_recvs(plan.kv_loaded)
        return self.runner.launch(plan)

    def finish_model(self, step: LaunchedStep) -> RunnerOutput | None:
        """A launched step's output, with the step's communication and matmul times."""
        out = self.runner.finish(step)
        comm_s = self.tp.take_comm()
        # a CUDA kernel returns at launch: only the CPU's matmuls are timed where they run
        matmul_s = self.model.kernels.take_matmul_s()
        parts = self.model.kernels.take_step_parts()
        if out is not None:
            out.comm_s = comm_s
            out.matmul_s = matmul_s if self.device.type == "cpu" else None
            out.step_parts = parts if self.device.type == "cpu" and parts else None
        return out

    @torch.inference_mode()
    def score(self, ids: list[int]) -> torch.Tensor | None:
        """(T - 1, V) float32 log-probabilities of each next token of ``ids``, from one prefill
        into the first blocks of the pool (which must be idle: nothing else may hold them).
        Every rank runs it; rank 0 gets the result, the others None."""
        n, block_size = len(ids), self.config.block_size
        num_blocks = -(-n // block_size)
        if num_blocks > self.kv_caches[0].k.shape[0]:
            raise ValueError(f"the text needs {num_blocks} KV blocks; the pool has {self.kv_caches[0].k.shape[0]}")
        table = torch.arange(num_blocks, device=self.device)
        positions = torch.arange(n, device=self.device)
        meta = AttentionMetadata(slot_mapping=positions.clone(), prefills=[PrefillChunk(0, n, n, table)])
        hidden = self.model(torch.tensor(ids, device=self.device), positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[:-1])  # gathered on rank 0 (tensor parallelism)
        return None if logits is None else torch.log_softmax(logits.float(), dim=-1).cpu()

    def probe_matmul_flops(self, rows: int) -> float:
        """FLOP/s this worker's matmul kernel reaches on its largest linear layer."""
        layer = max(self.model.linear_layers(), key=lambda m: m.in_features * m.out_features)
        return probe_linear_flops(self.model.kernels.matmul, layer, self.dtype, self.device, rows=rows)


def check_tensor_parallel(config: WorkerConfig) -> None:
    """ValueError when the model cannot be split over ``tensor_parallel_size`` ranks (heads,
    KV heads, intermediate sizes, quantized blocks): its layers are built on the meta device
    as rank 0 would build them, which reads no weight and allocates nothing."""
    hf_config, _ = read_hf_config(config.model)
    model_config = ModelConfig.from_hf_config(hf_config, config.max_model_len)
    quant = QuantizationConfig.from_name(config.quantization)
    tp = TensorParallel(0, config.tensor_parallel_size)
    try:
        with torch.device("meta"):
            model_class(model_config.architecture)(model_config, 1, quant, tp)
    except ValueError as exc:
        raise ValueError(f"{config.model} cannot be split over {tp.size} ranks: {exc}") from None


def free_memory(device: torch.device) -> float:
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


def run_worker_loop(worker: Worker, control) -> None:
    """Ranks > 0 of a tensor-parallel engine: run what rank 0 broadcasts on ``control`` until
    it says stop. ``("step", plan)`` runs a step (rank 0 gathers the logits and samples);
    ``("call", name, args)`` runs ``worker.name(*args)`` and sends the result to rank 0."""
    tp = worker.tp
    while True:
        command = tp.broadcast_object(None, group=control)
        kind = command[0]
        if kind == "step":
            worker.execute_model(command[1])
        elif kind == "call":
            _, name, args = command
            tp.gather_objects(getattr(worker, name)(*args), group=control)
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown command {kind!r} from rank 0")
