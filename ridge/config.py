"""Engine options as dataclasses that validate themselves.

``ModelConfig`` is what ridge needs of a Hugging Face ``config.json``; ``EngineConfig`` holds
the user's engine options (the CLI flags, the ``LLM(...)`` keywords). Both raise ``ValueError``
with a message that names the offending value, so bad input fails before any weight is read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ridge.dtypes import RUN_DTYPE_ALIASES, RUN_DTYPES, canonical_dtype
from ridge.models.deepseek_config import MLAConfig
from ridge.models.moe_config import MoEConfig
from ridge.models.registry import MODEL_TYPES, SUPPORTED_ARCHITECTURES, Architecture, architecture

SCHEDULER_POLICIES = ("continuous", "static")
# auto: ridge's CPU kernel for bf16 decode where the CPU has AVX-512 BF16, else F.linear.
KERNEL_CHOICES = ("auto", "torch", "ridge", "avx2")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model (dense or mixture-of-experts), read from a Hugging
    Face config dict."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 (and Llama with attention_bias) put a bias on q/k/v
    o_bias: bool  # Llama's attention_bias also biases o_proj; Qwen2's does not
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    dtype: str  # the checkpoint's dtype (the default for --dtype)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # the feed-forward of sparse layers (Mixtral, Qwen-MoE, DeepSeek)
    ffn_name: str = "mlp"  # the checkpoint's name of a layer's feed-forward (Mixtral: block_sparse_moe)
    mla: MLAConfig | None = None  # DeepSeek's latent attention (head_dim is then nope + rope)
    sliding_window: int | None = None  # kept only by the analyzer's lenient reading (the engine refuses one)
    notes: tuple[str, ...] = ()  # what a lenient reading assumed or left out

    def __post_init__(self) -> None:
        dense_layers = self.num_layers - (len(self.moe.sparse_layers) if self.moe else 0)
        if dense_layers and self.intermediate_size < 1:
            raise ValueError(f"model config: intermediate_size must be >= 1, got {self.intermediate_size}")
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The dims RoPE rotates per head (MLA: only the decoupled rope part)."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], max_model_len: int | None = None, *, lenient: bool = False
    ) -> ModelConfig:
        """Parse a Hugging Face config dict; clear errors for what ridge does not run.

        This is the one reader of ``config.json``: the roofline analyzer's ``ModelShape`` is
        derived from its result. ``lenient`` is the analyzer's reading: any Llama-style
        decoder is read (an unknown family as Llama, with a note), and what the engine
        refuses to run (a narrow sliding window, another family's routing fields) is kept or
        noted instead.
        """
        if isinstance(hf.get("text_config"), dict):  # a multimodal wrapper: its language model
            inner = dict(hf["text_config"])
            for key in ("architectures", "tie_word_embeddings"):
                inner.setdefault(key, hf.get(key))
            hf = inner
        notes: list[str] = []
        arch = _architecture(hf, lenient, notes)
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            vocab = int(hf["vocab_size"])
        except (KeyError, TypeError):
            missing = next(
                k
                for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
                if hf.get(k) is None
            )
            raise ValueError(f"model config is missing required key {missing!r}") from None
        head_dim = hf.get("head_dim") or hidden // heads
        family = architecture(arch)
        mla = _read_family(arch, "latent attention", family.read_mla, hf)
        if mla is not None:
            head_dim = mla.qk_head_dim  # HF writes head_dim = qk_rope_head_dim (the rotary width)
            if hf.get("num_nextn_predict_layers"):
                notes.append(
                    f"{hf['num_nextn_predict_layers']} multi-token-prediction layer(s) not counted "
                    "(not used by ordinary decoding)"
                )
        max_pos = int(hf.get("max_position_embeddings") or 2048)
        if max_model_len is not None and max_model_len > max_pos:
            # Positions past the trained range give wrong outputs: refuse, don't clamp silently.
            raise ValueError(
                f"max_model_len {max_model_len} is longer than the model's context "
                f"(max_position_embeddings {max_pos}); pass max_model_len <= {max_pos}"
            )
        window = _sliding_window(family, hf, layers, max_pos, notes)
        limit = max_model_len or max_pos
        if window is not None and window < limit and not lenient:
            raise ValueError(
                f"sliding-window attention (window {window} < context limit {limit}) is not supported; "
                f"pass max_model_len <= {window} to serve it as full attention"
            )
        rope_scaling = hf.get("rope_scaling") or None
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters")  # transformers 5 folds theta and scaling into one dict
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
        attention_bias = family.attention_bias and bool(hf.get("attention_bias", False))
        quant = hf.get("quantization_config")
        if isinstance(quant, dict):
            notes.append(
                f"checkpoint is quantized ({quant.get('quant_method', '?')}); pass --weight-bits "
                "to match it (the analysis uses the bits you give)"
            )
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(hf.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            # MLA has no KV heads of its own: every head reads the one latent
            num_kv_heads=heads if mla else int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=vocab,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or attention_bias,
            o_bias=not family.qkv_bias and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            dtype=canonical_dtype(dtype) if dtype in {*RUN_DTYPES, *RUN_DTYPE_ALIASES} else "float32",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=_read_family(arch, "experts", family.read_moe, hf, layers, lenient, notes),
            ffn_name=family.ffn_name,
            mla=mla,
            sliding_window=window,
            notes=tuple(notes),
        )


def _architecture(hf: dict[str, Any], lenient: bool, notes: list[str]) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    model_type = str(hf.get("model_type") or "")
    if lenient and model_type not in MODEL_TYPES:
        notes.append(
            f"model_type {model_type or '(none)'!r} is not one ridge knows; read as a "
            "Llama-style decoder (gated MLP, RMSNorm, no biases)"
        )
    if lenient and arch not in SUPPORTED_ARCHITECTURES:
        return MODEL_TYPES.get(model_type, "LlamaForCausalLM")
    architecture(arch)  # an unsupported one: the error that names the supported ones
    return arch


def _read_family(arch: str, what: str, reader: Callable[..., Any] | None, hf: dict[str, Any], *args: Any) -> Any:
    """The family's reader of ``what`` (registry row), None where the family has none."""
    if reader is None:
        return None
    try:
        return reader(arch, hf, *args)
    except KeyError as exc:
        raise ValueError(f"model config is missing {exc.args[0]!r} (needed by {arch}'s {what})") from None


def _sliding_window(family: Architecture, hf: dict, layers: int, max_pos: int, notes: list[str]) -> int | None:
    """The attention window, or None for full attention (a window as long as the context
    changes nothing; Qwen's configs carry one that use_sliding_window leaves off)."""
    window = hf.get("sliding_window")
    if not window or not hf.get("use_sliding_window", family.sliding_window_by_default) or int(window) >= max_pos:
        return None
    if hf.get("max_window_layers") not in (None, layers):
        notes.append("per-layer sliding windows are read as applying to every layer")
    notes.append(f"sliding-window attention: each query sees the last {window} tokens")
    return int(window)


@dataclass
class EngineConfig:
    """Every engine option, as ``LLM(...)`` keywords and ``ridge`` CLI flags.

    model: a Hugging Face model directory, or ``random:<preset>`` (random weights, built in memory).
    kv_cache_memory: GiB for the KV pool; None takes a share of free memory. num_kv_blocks overrides it.
    """

    model: str = "random:tiny"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    kv_cache_memory: float | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    scheduler: str = "continuous"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_threads: int | None = None
    kernels: str = "auto"
    # vLLM's --enforce-eager: every step op by op from Python (no decode plan on CPU, no CUDA graphs)
    enforce_eager: bool = False
    quantization: str | None = None  # int8 | int4 | int4_asym (or q8_0 | q4_0 | q4_1): weights quantized at load
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 | fp8 (e4m3), scales per token and KV head
    # vLLM's --speculative-config: a JSON string or dict (ridge.spec_decode.config.SpeculativeConfig)
    speculative_config: Any = None
    # vLLM's --tensor-parallel-size: N ranks, each holding 1/N of every weight matrix
    tensor_parallel_size: int = 1
    # vLLM's --kv-transfer-config: a JSON string or dict (ridge.kv_transfer.config.KVTransferConfig):
    # this instance runs prompts only (kv_producer) or decodes handed-over requests (kv_consumer)
    kv_transfer_config: Any = None
    # vLLM's --async-scheduling: the next step is scheduled and launched before the last one's
    # tokens are back (LLMEngine.step); one process, no KV transfer; with speculative decoding,
    # the plain steps between verify steps.
    # None (the default): on where it applies on CUDA, off on the CPU (resolved at construction)
    async_scheduling: bool | None = None
    # vLLM's --num-scheduler-steps (multi-step scheduling): a step of plain decodes (no
    # penalties, min_tokens or grammar) runs up to this many forward passes in one
    # plan, the host's scheduling and output processing once for all of them; tokens stream in
    # runs of that many, and a request that stops inside a run wastes the passes after it
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a model directory or 'random:<preset>'")
        if self.dtype != "auto":
            self.dtype = canonical_dtype(self.dtype)
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        _require_positive_int(
            self, "block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "num_scheduler_steps"
        )
        if self.num_kv_blocks is not None:
            _require_positive_int(self, "num_kv_blocks")
        if self.max_model_len is not None:
            _require_positive_int(self, "max_model_len")
        if self.num_threads is not None:
            _require_positive_int(self, "num_threads")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.scheduler not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULER_POLICIES)}, got {self.scheduler!r}")
        from ridge.kv.cache import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        from ridge.spec_decode.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        from ridge.kv_transfer.config import KVTransferConfig

        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        other = (
            "KV transfer" if self.kv_transfer_config is not None
            else "tensor parallelism" if self.tensor_parallel_size > 1
            else None
        )  # fmt: skip
        if self.num_scheduler_steps > 1:
            # each pass needs the last one's tokens on this rank, and a plan of one request's
            # passes is its own: no proposals to verify, no other ranks or instances to feed
            multi = "speculative decoding" if self.speculative_config is not None else other
            if multi is None and self.async_scheduling:
                multi = "async_scheduling"
            if multi is not None:
                raise ValueError(f"num_scheduler_steps > 1 does not combine with {multi}")
            self.async_scheduling = False
        if self.async_scheduling is None:
            # measured on an H100 (README "CUDA"): 1.16-1.61x at batch 1-32, the same outputs; the
            # CPU's step is its kernels' time (the host has nothing to overlap), so it stays off there
            on_cuda = self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())
            self.async_scheduling = on_cuda and other is None
        elif self.async_scheduling and other is not None:
            raise ValueError(f"async_scheduling does not combine with {other} (each step needs the last one's tokens)")
        if self.tensor_parallel_size > 1 and resolve_device(self.device).type == "cuda":
            gpus = torch.cuda.device_count()
            if self.tensor_parallel_size > gpus:
                raise ValueError(
                    f"tensor_parallel_size {self.tensor_parallel_size} needs a GPU per rank, and this machine has "
                    f"{gpus} (--device cpu runs the ranks on the CPU, over gloo)"
                )
        if self.quantization in ("", "none"):
            self.quantization = None
        if self.quantization is not None:
            from ridge.quantization.formats import get_format

            if not isinstance(self.quantization, str):
                raise ValueError(f"quantization must be a format name, got {self.quantization!r}")
            self.quantization = get_format(self.quantization).name

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from keywords, with a clear error for an unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model=model, **kwargs)


def _require_positive_int(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def default_cache_dir() -> Path:
    """Where ridge caches what it measures or builds: ``$RIDGE_CACHE_DIR`` or ``~/.cache/ridge``."""
    env = os.environ.get("RIDGE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ridge"


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA when present, else CPU. A CUDA device always carries its index ('cuda' is
    the current one), so it compares equal to the ``.device`` of the tensors made on it."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return indexed_device(device)


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: 'cuda' names the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(requested: str, model_default: str, device: torch.device) -> torch.dtype:
    """'auto' takes the checkpoint's dtype; fall back to float32 where the device cannot run it."""
    name = model_default if requested == "auto" else requested
    dtype = RUN_DTYPES[canonical_dtype(name)]
    if dtype is torch.float32:
        return dtype
    try:
        a = torch.ones(4, 4, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError):
        return torch.float32
    return dtype
