"""Write a loaded ridge model back out: a Hugging Face directory, or a GGUF file for llama.cpp.

The benchmarks compare engines on one random-initialized model; these functions hand the
exact same weights to transformers (``save_hf_checkpoint``) and to llama.cpp (``write_gguf``).

- ``hf_state_dict``: ridge's parameters under Hugging Face names, the packed projections
  (``qkv_proj``, ``gate_up_proj``, see ``models/llama.py``'s packing map) split back into
  their checkpoint matrices; a tied ``lm_head`` is left out (the checkpoint ties it again).
- ``save_hf_checkpoint``: ``config.json`` + ``model.safetensors``, loadable with
  ``AutoModelForCausalLM.from_pretrained(directory)`` and with ridge's own loader.
- ``write_gguf``: llama-architecture GGUF (matrices in the export's dtype, bf16 by default,
  1-D norms in f32 as llama.cpp's converter writes them), q/k rows permuted the way
  ``convert_hf_to_gguf.py`` permutes Llama q/k for llama.cpp's RoPE layout, and a
  placeholder vocabulary (``<unk> <s> </s>``, the 256 byte tokens, then ``<tok_N>``) that
  lets llama.cpp load the file; callers feed token ids, so the text of the vocab is moot.

The ``gguf`` package is imported inside ``write_gguf`` only: it is an optional dependency.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import ModelConfig
from ridge.dtypes import GGUF_FILE_TYPES
from ridge.layers.linear import ExpertLinear
from ridge.models.registry import ARCHITECTURES

# Checkpoint architecture -> the llama.cpp architecture write_gguf writes it as (the
# registry's name of the family), for the families it writes
_WRITES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
GGUF_ARCHITECTURES = {name: ARCHITECTURES[name].gguf for name in _WRITES}

# Hugging Face name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.").
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# qwen3moe: q/k norms, the router, and each projection's experts stacked as one 3-D tensor
# (E, rows, K) (the HF names of the stacks are write_gguf's own: experts.{e}.* stacked)
_GGUF_QWEN3MOE_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
}
# Mixtral, as llama.cpp's converter writes it: the llama architecture (q/k rows permuted) with
# the router and each projection's experts stacked (w1 gate, w3 up, w2 down), every layer sparse
_GGUF_MIXTRAL_LAYER_NAMES = {
    **{k: v for k, v in _GGUF_LAYER_NAMES.items() if not k.startswith("mlp.")},
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.experts.w1.weight": "ffn_gate_exps.weight",
    "block_sparse_moe.experts.w3.weight": "ffn_up_exps.weight",
    "block_sparse_moe.experts.w2.weight": "ffn_down_exps.weight",
}
# the routers, written in f32 as llama.cpp's converter leaves them
_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
# qwen2moe: no q/k norms but q/k/v biases, and the shared expert with its sigmoid gate (1-D)
_GGUF_QWEN2MOE_LAYER_NAMES = {
    **{
        k: v
        for k, v in _GGUF_QWEN3MOE_LAYER_NAMES.items()
        if k not in ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    },
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
# deepseek2 (DeepSeek V2 / V3, latent attention): a layer's tensors, dense MLP or MoE; kv_b_proj
# is written split per head as llama.cpp's converter writes it (attn_k_b, attn_v_b)
_GGUF_DEEPSEEK2_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": None,  # -> attn_k_b.weight, attn_v_b.weight
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _as_model(engine_or_model) -> torch.nn.Module:
    """An ``LLM``, ``LLMEngine`` (one in-process worker), ``Worker``, ``LoadedModel`` or the
    model itself -> the model."""
    obj = getattr(engine_or_model, "engine", engine_or_model)  # LLM -> LLMEngine
    obj = getattr(getattr(obj, "executor", None), "worker", obj)  # LLMEngine -> its worker
    model = obj if isinstance(obj, torch.nn.Module) else getattr(obj, "model", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "packed_modules"):
        raise TypeError(f"cannot find a ridge model in {type(engine_or_model).__name__}")
    return model


def hf_state_dict(engine_or_model) -> dict[str, torch.Tensor]:
    """ridge parameters under Hugging Face checkpoint names (views, no copies).

    Packed parameters are split into their shards (``qkv_proj.weight`` -> q/k/v_proj.weight,
    biases likewise); ``lm_head.weight`` is omitted when the embeddings are tied, and so are a
    model's ``file_copies`` (a GGUF file's copies of another layer's rows).
    """
    model = _as_model(engine_or_model)
    unpacked: dict[str, list[tuple[int, str]]] = {}
    for checkpoint_name, (packed_name, shard) in model.packed_modules.items():
        unpacked.setdefault(packed_name, []).append((shard, checkpoint_name))
    # stacked experts: experts.gate_up_proj -> experts.{e}.gate_proj / up_proj, ...
    unstacked: dict[str, list[tuple[int, int, str]]] = {}
    for checkpoint_name, (stacked_name, index, per_expert) in model.expert_stacking.items():
        unstacked.setdefault(stacked_name, []).append((index, per_expert, checkpoint_name))
    modules = dict(model.named_modules())
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():  # a tied lm_head is a duplicate: not listed
        module_name, _, leaf = name.rpartition(".")
        prefix, _, short = module_name.rpartition(".")
        if leaf == "weight" and hasattr(modules[module_name], "dense_weight"):
            param = modules[module_name].dense_weight()  # kernels may hold it repacked
        module = modules[module_name]
        if short in model.file_copies:
            continue
        if isinstance(module, ExpertLinear) and short in unstacked:
            for expert in range(module.num_experts):
                for index, per_expert, checkpoint_name in unstacked[short]:
                    rows = module.shard_rows(expert * per_expert + index)
                    state[f"{prefix}.{expert}.{checkpoint_name}.{leaf}"] = param.detach()[rows]
        elif short in unpacked:
            module = modules[module_name]
            for shard, checkpoint_name in sorted(unpacked[short]):
                state[f"{prefix}.{checkpoint_name}.{leaf}"] = param.detach()[module.shard_rows(shard)]
        else:
            state[name] = param.detach()
    return state


def save_hf_checkpoint(engine_or_model, hf_config: dict, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for the model's current weights.

    ``hf_config`` is written as given, with ``torch_dtype``/``dtype`` set to the weights'
    dtype (so ``dtype="auto"`` loads them as stored). Returns the directory.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share storage (the split shards do): copy each one.
    tensors = {name: t.to("cpu").contiguous().clone() for name, t in hf_state_dict(engine_or_model).items()}
    dtype = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    config = {**hf_config, "torch_dtype": dtype, "dtype": dtype}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def permute_for_llama_cpp(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder q/k rows from Hugging Face's rotate-half layout to llama.cpp's interleaved one.

    Within each head, HF rotates the pairs (i, i + D/2); llama.cpp the pairs (2i, 2i + 1). Same
    arithmetic as ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` (for k, ``n_head`` is the
    number of KV heads).
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(directory_or_state: str | Path | Mapping[str, torch.Tensor], hf_config: dict, path: str | Path) -> Path:
    """Write a llama-architecture GGUF for llama.cpp from a Hugging Face directory or state dict.

    ``directory_or_state``: a directory with ``*.safetensors`` (e.g. from ``save_hf_checkpoint``)
    or a mapping of Hugging Face names to tensors (``hf_state_dict``). Matrices keep their dtype
    (bf16, f16 or f32), 1-D tensors are written in f32. Raises ValueError for a model that
    llama.cpp's llama architecture does not express (biases, q/k norms, other RoPE scalings),
    ImportError when the ``gguf`` package is missing. Returns the path.
    """
    import gguf  # optional: pip install gguf

    cfg = ModelConfig.from_hf_config(hf_config)
    arch = GGUF_ARCHITECTURES.get(cfg.architecture)
    plain_llama = arch == "llama" and not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
    mixtral = plain_llama and cfg.architecture == "MixtralForCausalLM"
    # llama.cpp's qwen3moe: every layer MoE, top-k renormalized, no shared expert; its
    # qwen2moe: every layer MoE, top-k as the softmax gives it, one sigmoid-gated shared expert
    moe = cfg.moe
    all_sparse = moe is not None and len(moe.sparse_layers) == cfg.num_layers
    qwen3moe = arch == "qwen3moe" and all_sparse and moe.norm_topk_prob and not moe.shared_intermediate_size
    qwen2moe = arch == "qwen2moe" and all_sparse and not moe.norm_topk_prob and moe.shared_expert_gate
    deepseek2 = arch == "deepseek2" and cfg.mla is not None
    if not (plain_llama or qwen3moe or qwen2moe or deepseek2):
        raise ValueError(
            "write_gguf writes plain Llama, Mistral and Mixtral models (no biases, no q/k norm), Qwen3-MoE "
            "models with every layer sparse and norm_topk_prob, Qwen2-MoE models with every layer sparse, "
            f"and DeepSeek V2/V3, not this {cfg.architecture}"
        )
    if deepseek2:
        return _write_deepseek2(directory_or_state, hf_config, cfg, Path(path), gguf)
    qwen3moe = qwen3moe or qwen2moe  # what they share below: stacked experts, halves rotated
    state = dict(_read_state(directory_or_state))
    if qwen3moe:
        state = _stack_experts(state, cfg)
    if mixtral:
        state = _stack_experts(state, cfg, "block_sparse_moe", ("w1", "w3", "w2"))
    path = Path(path)
    writer = _open_writer(path, arch, hf_config, cfg, state, gguf)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size and not qwen3moe:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if qwen3moe:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_expert_count(moe.num_experts)
        writer.add_expert_used_count(moe.top_k)
        writer.add_expert_feed_forward_length(moe.intermediate_size)
    if qwen2moe:
        writer.add_expert_shared_feed_forward_length(moe.shared_intermediate_size)
    if mixtral:  # its experts are feed_forward_length wide
        writer.add_expert_count(moe.num_experts)
        writer.add_expert_used_count(moe.top_k)
    rope_factors = _add_rope_scaling(writer, gguf, cfg)
    entries = list(_gguf_tensors(state, cfg))
    if rope_factors is not None:
        entries.append(_Entry("rope_freqs.weight", tuple(rope_factors.shape), torch.float32, lambda: rope_factors))
    _write_entries(writer, entries, gguf)
    return path


def _open_writer(path: Path, arch: str, hf_config: dict, cfg: ModelConfig, state: dict, gguf):
    """A GGUFWriter with what every architecture's metadata shares and the placeholder vocab."""
    matrix_dtype = state["model.embed_tokens.weight"].dtype
    if matrix_dtype not in GGUF_FILE_TYPES:
        raise ValueError(f"write_gguf: cannot store {matrix_dtype} tensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(str(hf_config.get("_name_or_path") or "ridge-export"))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, GGUF_FILE_TYPES[matrix_dtype]))
    _add_placeholder_vocab(writer, gguf, cfg)
    return writer


def _write_entries(writer, entries: list[_Entry], gguf) -> None:
    """Tensor infos first, then each tensor made (an expert stack: copied) and written in turn,
    so at most one stacked tensor exists beside the model at a time."""
    for entry in entries:
        shape, np_dtype, nbytes, raw_dtype = _tensor_info(entry, gguf)
        writer.add_tensor_info(entry.name, shape, np_dtype, nbytes, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for entry in entries:
        writer.write_tensor_data(_as_array(entry.make(), entry.dtype))
    writer.close()


def _read_state(source) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(source, Mapping):
        yield from source.items()
        return
    from safetensors import safe_open

    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{source} has no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


@dataclass
class _Entry:
    """A tensor to write: its GGUF name, shape and dtype now, its values when ``make()`` is called."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


class _ExpertStack:
    """The (E, rows, K) stack of one projection's experts, built only when written."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.shape = (len(parts), *parts[0].shape)
        self.dtype = parts[0].dtype

    def materialize(self) -> torch.Tensor:
        return torch.stack(self.parts)


def _stack_experts(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    ffn: str = "mlp",
    projs: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj"),
) -> dict:
    """{ffn}.experts.{e}.{proj}.weight of every sparse layer -> one (E, rows, K)
    {ffn}.experts.{proj}.weight (Mixtral's ffn is block_sparse_moe, its projs w1, w3, w2)."""
    out: dict = {n: t for n, t in state.items() if f".{ffn}.experts." not in n}
    for layer in cfg.moe.sparse_layers:
        for proj in projs:
            names = [f"model.layers.{layer}.{ffn}.experts.{e}.{proj}.weight" for e in range(cfg.moe.num_experts)]
            missing = [n for n in names if n not in state]
            if missing:
                raise ValueError(f"write_gguf: missing {missing[:2]}")
            out[f"model.layers.{layer}.{ffn}.experts.{proj}.weight"] = _ExpertStack([state[n] for n in names])
    return out


def _gguf_tensors(state: dict, cfg: ModelConfig) -> Iterator[_Entry]:
    """What to write, in llama.cpp's names and layout; raises ValueError on unknown or missing names."""
    arch = GGUF_ARCHITECTURES[cfg.architecture]
    qwen3moe = arch in ("qwen3moe", "qwen2moe")
    layer_names = {"qwen3moe": _GGUF_QWEN3MOE_LAYER_NAMES, "qwen2moe": _GGUF_QWEN2MOE_LAYER_NAMES}.get(
        arch, _GGUF_MIXTRAL_LAYER_NAMES if cfg.architecture == "MixtralForCausalLM" else _GGUF_LAYER_NAMES
    )
    expected = {f"model.layers.{i}.{k}" for i in range(cfg.num_layers) for k in layer_names}
    expected |= {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        expected.add("lm_head.weight")
    names = {n for n in state if "rotary_emb" not in n and not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    if names != expected:
        extra, missing = sorted(names - expected), sorted(expected - names)
        raise ValueError(f"write_gguf: unexpected tensors {extra[:4]}, missing {missing[:4]}")
    for name in sorted(names, key=lambda n: _tensor_order(n, layer_names)):
        tensor = state[name]
        make, shape, dtype = _as_written(tensor)
        if name in _GGUF_GLOBAL_NAMES:
            yield _Entry(_GGUF_GLOBAL_NAMES[name], shape, dtype, make)
            continue
        layer, rest = name[len("model.layers.") :].split(".", 1)
        # llama's RoPE pairs interleaved dims; qwen3moe rotates halves, as ridge and HF do
        if rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight") and not qwen3moe:
            heads = cfg.num_heads if rest == "self_attn.q_proj.weight" else cfg.num_kv_heads
            make = lambda t=tensor, h=heads: permute_for_llama_cpp(t, h)  # noqa: E731
        if rest in _ROUTERS:  # the router in f32, as llama.cpp's converter leaves it
            make, dtype = (lambda t=tensor: t.float()), torch.float32
        if rest == "mlp.shared_expert_gate.weight":  # llama.cpp's (hidden,): 1-D, f32
            make, dtype, shape = (lambda t=tensor: t.float().reshape(-1)), torch.float32, (tensor.shape[-1],)
        yield _Entry(f"blk.{layer}.{layer_names[rest]}", shape, dtype, make)


def _write_deepseek2(source, hf_config: dict, cfg: ModelConfig, path: Path, gguf) -> Path:
    """deepseek2 as llama.cpp's converter writes it since its MLA support: head_count_kv 1 and
    key/value lengths of the latent (r + rope, r), the per-head ones as key/value_length_mla,
    kv_b_proj split into W_uk transposed (H, r, nope) and W_uv (H, v, r), RoPE dims as they are
    (DeepSeek rotates interleaved pairs, llama.cpp's NORM RoPE)."""
    mla, moe = cfg.mla, cfg.moe
    state = dict(_read_state(source))
    if moe is not None:
        state = _stack_experts(state, cfg)
    writer = _open_writer(path, "deepseek2", hf_config, cfg, state, gguf)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(mla.qk_rope_head_dim)
    writer.add_key_length(mla.kv_lora_rank + mla.qk_rope_head_dim)
    writer.add_value_length(mla.kv_lora_rank)
    writer.add_key_length_mla(mla.qk_head_dim)
    writer.add_value_length_mla(mla.v_head_dim)
    writer.add_kv_lora_rank(mla.kv_lora_rank)
    if mla.q_lora_rank:
        writer.add_q_lora_rank(mla.q_lora_rank)
    if moe is not None:
        writer.add_leading_dense_block_count(min(moe.sparse_layers))
        writer.add_expert_count(moe.num_experts)
        writer.add_expert_used_count(moe.top_k)
        writer.add_expert_feed_forward_length(moe.intermediate_size)
        writer.add_expert_shared_count(moe.shared_intermediate_size // moe.intermediate_size)
        writer.add_expert_weights_scale(moe.routed_scaling_factor)
        writer.add_expert_weights_norm(moe.norm_topk_prob)
        sigmoid = moe.scoring == "sigmoid"
        writer.add_expert_gating_func(
            gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
        )
        if moe.topk_method != "greedy":
            writer.add_expert_group_count(moe.n_group)
            writer.add_expert_group_used_count(moe.topk_group)
    scaling = cfg.rope_scaling or {}
    kind = str(scaling.get("rope_type", scaling.get("type", "default"))).lower()
    if kind == "yarn":
        if scaling.get("mscale") is not None and scaling.get("mscale") != scaling.get("mscale_all_dim"):
            raise ValueError("write_gguf: deepseek2 holds one YaRN mscale (mscale_all_dim); this model's differ")
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(scaling.get("mscale_all_dim") or 0.0))
        writer.add_rope_scaling_yarn_beta_fast(float(scaling.get("beta_fast") or 32))
        writer.add_rope_scaling_yarn_beta_slow(float(scaling.get("beta_slow") or 1))
    elif kind != "default":
        raise ValueError(f"write_gguf: RoPE scaling {kind!r} is not supported for deepseek2 (yarn is)")
    _write_entries(writer, list(_deepseek2_tensors(state, cfg)), gguf)
    return path


def _deepseek2_tensors(state: dict, cfg: ModelConfig) -> Iterator[_Entry]:
    names = _GGUF_DEEPSEEK2_LAYER_NAMES
    mla = cfg.mla
    unknown = [
        n
        for n in state
        if n not in _GGUF_GLOBAL_NAMES and not (n.startswith("model.layers.") and n.split(".", 3)[3] in names)
    ]
    if unknown:
        raise ValueError(f"write_gguf: unexpected tensors {sorted(unknown)[:4]}")
    for name in sorted(state, key=lambda n: _tensor_order(n, names)):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        tensor = state[name]
        make, shape, dtype = _as_written(tensor)
        if name in _GGUF_GLOBAL_NAMES:
            yield _Entry(_GGUF_GLOBAL_NAMES[name], shape, dtype, make)
            continue
        layer, rest = name[len("model.layers.") :].split(".", 1)
        if rest == "self_attn.kv_b_proj.weight":
            per_head = tensor.reshape(cfg.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
            k_b = per_head[:, : mla.qk_nope_head_dim].transpose(1, 2).contiguous()  # (H, r, nope)
            v_b = per_head[:, mla.qk_nope_head_dim :].contiguous()  # (H, v, r)
            yield _Entry(f"blk.{layer}.attn_k_b.weight", tuple(k_b.shape), dtype, lambda t=k_b: t)
            yield _Entry(f"blk.{layer}.attn_v_b.weight", tuple(v_b.shape), dtype, lambda t=v_b: t)
            continue
        if rest in ("mlp.gate.weight", "mlp.gate.e_score_correction_bias"):  # the router in f32
            make, dtype = (lambda t=tensor: t.float()), torch.float32
        yield _Entry(f"blk.{layer}.{names[rest]}", shape, dtype, make)


def _as_written(tensor) -> tuple[Callable[[], torch.Tensor], tuple[int, ...], torch.dtype]:
    """How a state tensor is made when written (an expert stack: copied then), its shape and dtype."""
    make = tensor.materialize if isinstance(tensor, _ExpertStack) else (lambda t=tensor: t)
    return make, tuple(tensor.shape), tensor.dtype


def _tensor_order(name: str, layer_names: dict[str, str] = _GGUF_LAYER_NAMES) -> tuple:
    # embeddings first, then layers in numeric order, then the final norm and head (as llama.cpp's converter)
    if name.startswith("model.layers."):
        layer, rest = name[len("model.layers.") :].split(".", 1)
        return (1, int(layer), list(layer_names).index(rest))
    return (0 if name == "model.embed_tokens.weight" else 2, 0, name)


def _tensor_info(entry: _Entry, gguf) -> tuple[tuple[int, ...], object, int, object]:
    """(shape as handed over, numpy dtype, bytes, raw GGML type) of what ``_as_array`` gives."""
    import numpy as np

    count = math.prod(entry.shape)
    if len(entry.shape) == 1 or entry.dtype is torch.float32:
        return entry.shape, np.dtype(np.float32), 4 * count, None
    if entry.dtype is torch.float16:
        return entry.shape, np.dtype(np.float16), 2 * count, None
    # bf16: numpy has no bf16, so the raw bytes go with their GGML type
    return (*entry.shape[:-1], 2 * entry.shape[-1]), np.dtype(np.uint8), 2 * count, gguf.GGMLQuantizationType.BF16


def _as_array(tensor: torch.Tensor, dtype: torch.dtype):
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dim() == 1 or dtype is torch.float32:
        return tensor.float().numpy()
    if dtype is torch.float16:
        return tensor.numpy()
    return tensor.view(torch.uint8).numpy()


def _add_rope_scaling(writer, gguf, cfg: ModelConfig) -> torch.Tensor | None:
    """Write the RoPE scaling keys; llama3 scaling becomes a ``rope_freqs`` tensor (returned)."""
    scaling = cfg.rope_scaling
    if not scaling:
        return None
    kind = str(scaling.get("rope_type", scaling.get("type", "default"))).lower()
    if kind == "default":
        return None
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        return None
    if kind == "llama3":
        return _llama3_rope_factors(cfg.rope_theta, cfg.head_dim, scaling)
    raise ValueError(f"write_gguf: RoPE scaling {kind!r} is not supported")


def _llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> torch.Tensor:
    """Per-frequency divisors of llama3 RoPE scaling, as ``convert_hf_to_gguf.py`` computes them."""
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _add_placeholder_vocab(writer, gguf, cfg: ModelConfig) -> None:
    """A SentencePiece-style vocab of ``vocab_size`` unique tokens: specials, bytes, placeholders."""
    types = gguf.TokenType
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    kinds: list[int] = [types.UNKNOWN, types.CONTROL, types.CONTROL]
    if cfg.vocab_size >= len(tokens) + 256:  # byte tokens let llama.cpp find its newline token
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        kinds += [types.BYTE] * 256
    tokens += [f"<tok_{i}>" for i in range(len(tokens), cfg.vocab_size)]
    kinds += [types.NORMAL] * (cfg.vocab_size - len(kinds))
    tokens, kinds = tokens[: cfg.vocab_size], kinds[: cfg.vocab_size]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([int(k) for k in kinds])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(
        cfg.bos_token_id if cfg.bos_token_id is not None and cfg.bos_token_id < cfg.vocab_size else 1
    )
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids and cfg.eos_token_ids[0] < cfg.vocab_size else 2
    writer.add_eos_token_id(eos)
