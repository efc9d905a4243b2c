"""llama.cpp's GGUF files as ridge models: config, tensors and tokenizer from one file.

Parsed with the ``gguf`` package (llama.cpp's own Python reader; tensors memory-mapped).
The metadata becomes a Hugging Face-style config dict, so the rest of ridge (``ModelConfig``,
the analyzer) reads a GGUF model exactly as it reads a directory. Tensor names map onto
Hugging Face's, and llama-architecture files get their q/k rows un-permuted (llama.cpp's
converter interleaves each head's two RoPE halves; ridge, like transformers, rotates halves):

    llama.cpp rows of one head:  [ x0 y0 x1 y1 ... ]   ->   HF rows:  [ x0 x1 ... | y0 y1 ... ]

Tensor types and what each becomes (``plan_weights``):

    F32, F16, BF16            dense (the model's dtype, or --quantization's format)
    Q8_0, Q4_0, Q4_1, IQ4_NL, as they are: ridge's int8 / int4 / int4_asym / iq4_nl / q4_k /
    Q4_K, Q5_K, Q6_K, IQ4_XS, q5_k / q6_k / iq4_xs / q3_k / q2_k hold GGUF's bytes (the kernels
    Q3_K, Q2_K                regroup them at load, same size)
    Q5_0, Q5_1                int8 (dequantized, requantized per 32: a small added error)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ridge.distributed.parallel import Shard
from ridge.dtypes import GGUF_DENSE_TYPES
from ridge.models.registry import GGUF_ARCHITECTURES, architecture
from ridge.quantization.formats import FORMATS, Q8_0, BlockFormat

NATIVE_TYPES = {f.ggml_name: f for f in FORMATS.values()}
# the 5-bit types llama.cpp falls back to where K is not a multiple of 256
CONVERTED_TYPES = {"Q5_0": Q8_0, "Q5_1": Q8_0}
SUPPORTED_TYPES = (*GGUF_DENSE_TYPES, *NATIVE_TYPES, *CONVERTED_TYPES)
# the formats a layer can take, widest first (a stacked expert layer whose shards differ takes the widest;
# a packed one keeps each shard's: layer_formats)
WIDTH_ORDER = ("int8", "q6_k", "q5_k", "int4_asym", "q4_k", "iq4_nl", "int4", "iq4_xs", "q3_k", "q2_k")

# GGUF tensor name (after "blk.N.") -> Hugging Face module path
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    # qwen2moe's shared expert, and the sigmoid gate on it (llama.cpp stores it 1-D: (hidden,))
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # deepseek2's latent attention (llama.cpp writes kv_b_proj split per head: attn_k_b, attn_v_b)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
# Per family (a file's architecture, or "mixtral": see GGUFModel.family), names that differ:
# deepseek2's shared experts (one MLP of their summed width), Mixtral's router
ARCH_LAYER_TENSORS = {
    "deepseek2": {
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"},
}
# deepseek2's kv_b_proj as llama.cpp writes it since its MLA support: per head, W_uk transposed
# (H, r, nope) and W_uv (H, v, r). Each is also kept as it is, the absorbed decode's per-head
# matrices in the file's own blocks (DeepseekAttention's k_b_proj and v_b_proj: H stacked
# matrices of r and v rows); joined back into Hugging Face's (H (nope + v), r) for prefill
# unless the file also holds attn_kv_b (ik_llama.cpp's files can).
SPLIT_KV_B = {"attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj"}
# An MoE layer's experts, one 3-D tensor (E, rows, K) per projection: split into each
# expert's (rows, K) (views of the mapped file) under Hugging Face's per-expert names, which
# the loader stacks again into ridge's experts.gate_up_proj / experts.down_proj.
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# ... and each expert's Hugging Face name per family: Qwen's and DeepSeek's mlp.experts.{e}.{proj},
# Mixtral's block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down). A Mixtral file written
# before llama.cpp stacked experts (early 2024; many still downloaded) holds each expert as its
# own 2-D tensor, blk.N.ffn_gate.E (ffn_up.E, ffn_down.E): read as the same names.
# An MoE layer's router, in every family's names (ffn_gate_inp's)
ROUTER_SUFFIXES = tuple(
    f".{names['ffn_gate_inp']}.weight"
    for names in (LAYER_TENSORS, *ARCH_LAYER_TENSORS.values())
    if "ffn_gate_inp" in names
)
EXPERT_NAMES = {"mixtral": ("block_sparse_moe.experts", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}
PER_EXPERT_TENSORS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(spec: str) -> bool:
    return spec.lower().endswith(".gguf")


@dataclass
class GGUFTensor:
    hf_name: str  # e.g. model.layers.0.self_attn.q_proj.weight
    type_name: str  # GGUF's: F32, Q4_0, Q6_K, ...
    shape: tuple[int, ...]  # torch order: (N, K)
    data: np.ndarray  # memory-mapped: dense values, or (N, row bytes) uint8 blocks

    def _block_cols(self, cols: Shard) -> slice:
        """The byte columns of K's ``cols`` in the tensor's rows: whole blocks only."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]]
        if cols.start % block or cols.length % block:
            raise ValueError(
                f"{self.hf_name}: a {self.type_name} tensor splits K only on its {block}-value blocks; "
                f"a rank's columns [{cols.start}, {cols.start + cols.length}) are not (lower the tensor parallel size)"
            )
        return slice(cols.start // block * type_size, (cols.start + cols.length) // block * type_size)

    def dense(self, rows: Shard | None = None, cols: Shard | None = None) -> torch.Tensor:
        """Float values (dequantized with llama.cpp's reference code where quantized), of the
        rows and columns asked for (tensor parallelism): only those are read from the map."""
        data = self.data
        if rows is not None:
            data = data[rows.start : rows.start + rows.length]
        shape = (data.shape[0], self.shape[1]) if len(self.shape) == 2 else self.shape
        if self.type_name in GGUF_DENSE_TYPES:
            if cols is not None:
                data, shape = data[:, cols.start : cols.start + cols.length], (data.shape[0], cols.length)
            array = data.view(np.uint16) if self.type_name == "BF16" else data
            tensor = torch.from_numpy(np.array(array))  # a copy: the mapped file is read-only
            if self.type_name == "BF16":
                tensor = tensor.view(torch.bfloat16)
            return tensor.reshape(shape)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if cols is not None:
            data, shape = data[:, self._block_cols(cols)], (data.shape[0], cols.length)
        values = dequantize(np.ascontiguousarray(data), GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape)

    def blocks(self, rows: Shard | None = None, cols: Shard | None = None) -> torch.Tensor:
        """(N, row bytes) uint8 of a native block type, of the rows and (whole blocks of)
        columns asked for."""
        data = self.data
        if rows is not None:
            data = data[rows.start : rows.start + rows.length]
        if cols is not None:
            data = data[:, self._block_cols(cols)]
        return torch.from_numpy(np.array(data)).reshape(data.shape[0], -1)

    @property
    def loads_as_blocks(self) -> bool:
        """Its bytes go into a layer of its target format without dequantizing."""
        return self.type_name in NATIVE_TYPES


class GGUFModel:
    """An opened file: its config dict (Hugging Face keys) and its tensors by HF name."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ValueError(f"GGUF file {str(path)!r} does not exist")
        try:
            self.reader = GGUFReader(self.path)
        except Exception as exc:  # bad magic, truncated, corrupt tables: the reader raises many kinds
            raise ValueError(f"{self.path.name} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.arch = self._str("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path.name}: architecture {self.arch!r} is not supported; ridge runs GGUF files of "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        # llama.cpp writes Mixtral as its llama architecture with experts: the family picks the
        # Hugging Face names and config (MixtralForCausalLM) the file's tensors and metadata map to
        mixtral = self.arch == "llama" and int(self._field("llama.expert_count", 0) or 0) > 0
        self.family = "mixtral" if mixtral else self.arch
        self.tensors = self._read_tensors()
        self.hf_config = self._hf_config()

    # -- metadata -----------------------------------------------------------------------
    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def _str(self, key: str) -> str:
        value = self._field(key)
        if not isinstance(value, str):
            raise ValueError(f"{self.path.name}: metadata {key!r} is missing")
        return value

    def weights_by_format(self) -> dict[str, int]:
        """The weights of the matrices a decode step reads, by the format ridge holds them in:
        a native block type's format name (``q4_k``, ``int8`` for Q8_0, ...), a converted
        type's target (Q5_0 and Q5_1 load as ``int8``), ``bf16`` for dense types (they load in
        the model's dtype, bf16 by default). Every 2-D weight counts but the token embedding,
        whose rows a step only gathers, unless the lm_head is tied to it, and deepseek2's joined
        ``kv_b_proj`` where the file also gives its per-head halves (the absorbed decode reads
        those), and an MoE layer's router (held and priced in float32 whatever the others'
        formats: ``roofline.ops.ROUTER_BYTES_PER_PARAM``). An MoE layer's experts count whole,
        as if every one were read."""
        tied = "lm_head.weight" not in self.tensors
        counts: dict[str, int] = {}
        for name, tensor in self.tensors.items():
            if len(tensor.shape) != 2 or not name.endswith(".weight") or name.endswith(ROUTER_SUFFIXES):
                continue
            if name == "model.embed_tokens.weight" and not tied:
                continue
            if name.endswith("self_attn.kv_b_proj.weight") and name.replace("kv_b_proj", "k_b_proj") in self.tensors:
                continue
            fmt = NATIVE_TYPES.get(tensor.type_name) or CONVERTED_TYPES.get(tensor.type_name)
            key = fmt.name if fmt is not None else "bf16"
            counts[key] = counts.get(key, 0) + tensor.shape[0] * tensor.shape[1]
        return counts

    def _hf_config(self) -> dict:
        a = self.arch
        hidden = self._required(f"{a}.embedding_length")
        heads = self._required(f"{a}.attention.head_count")
        tokens = self._field("tokenizer.ggml.tokens") or []
        embed = self.tensors.get("model.embed_tokens.weight")
        if embed is None:
            raise ValueError(f"{self.path.name}: tensor 'token_embd.weight' is missing")
        moe = {}
        if a in ("qwen3moe", "qwen2moe"):  # llama.cpp's: every layer MoE, softmax top-k
            expert_ff = self._required(f"{a}.expert_feed_forward_length")
            moe = {
                "num_experts": self._required(f"{a}.expert_count"),
                "num_experts_per_tok": self._required(f"{a}.expert_used_count"),
                "moe_intermediate_size": expert_ff,
                "norm_topk_prob": a == "qwen3moe",  # qwen2moe's top-k weights are not renormalized
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        if a == "qwen2moe":  # plus one shared expert for every token, under a sigmoid gate
            moe["shared_expert_intermediate_size"] = self._required(f"{a}.expert_shared_feed_forward_length")
        if self.family == "mixtral":  # every layer MoE, softmax top-k renormalized (llama.cpp's llama MoE)
            moe = {
                "num_local_experts": self._required(f"{a}.expert_count"),
                "num_experts_per_tok": self._required(f"{a}.expert_used_count"),
            }
        name = "MixtralForCausalLM" if self.family == "mixtral" else GGUF_ARCHITECTURES[a]
        if a == "deepseek2":
            return self._deepseek2_config(hidden, heads, embed, tokens)
        config = {
            "architectures": [name],
            "model_type": architecture(name).model_type,
            "hidden_size": hidden,
            # Mixtral's experts are feed_forward_length wide (the config's intermediate_size)
            "intermediate_size": int(self._field(f"{a}.feed_forward_length", 0))
            or self._required(f"{a}.expert_feed_forward_length" if moe else f"{a}.feed_forward_length"),
            **moe,
            "num_hidden_layers": self._required(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self._field(f"{a}.attention.key_length", hidden // heads)),
            **self._shared_config(embed, tokens),
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self.tensors and name == "LlamaForCausalLM",
        }
        self._add_special_tokens(config)
        scaling = self._field(f"{a}.rope.scaling.type")
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(self._field(f"{a}.rope.scaling.factor"))}
        elif scaling not in (None, "none"):
            raise ValueError(f"{self.path.name}: RoPE scaling {scaling!r} is not supported (linear is)")
        freqs = self.tensors.pop("rope_freqs.weight", None)
        if freqs is not None:  # Llama 3.1+: llama.cpp stores the per-frequency divisors
            config["rope_scaling"] = {"rope_type": "freq_factors", "factors": freqs.dense().float().tolist()}
        return config

    def _shared_config(self, embed: GGUFTensor, tokens: list) -> dict:
        """The config keys every architecture's metadata gives the same way."""
        a = self.arch
        return {
            "vocab_size": int(self._field(f"{a}.vocab_size", embed.shape[0] or len(tokens))),
            "max_position_embeddings": int(self._field(f"{a}.context_length", 2048)),
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            # the dtype ridge computes in: float32 files stay float32, anything else runs bf16
            "torch_dtype": "float32" if embed.type_name == "F32" else "bfloat16",
        }

    def _deepseek2_config(self, hidden: int, heads: int, embed: GGUFTensor, tokens: list) -> dict:
        """A DeepSeek-V2/V3 config.json from deepseek2 metadata. Files since llama.cpp's MLA
        support give key/value lengths of the latent (head_count_kv 1) and the per-head ones as
        key_length_mla / value_length_mla; older files give the per-head ones as key/value_length."""
        a = self.arch
        rope = self._required(f"{a}.rope.dimension_count")
        per_head = self._field(f"{a}.attention.key_length_mla") is not None
        key_length = self._required(f"{a}.attention.key_length_mla" if per_head else f"{a}.attention.key_length")
        value_length = self._required(f"{a}.attention.value_length_mla" if per_head else f"{a}.attention.value_length")
        sigmoid = int(self._field(f"{a}.expert_gating_func", 1)) == 2  # llama.cpp: 1 softmax, 2 sigmoid
        v3 = (
            sigmoid
            or "model.layers.{}.mlp.gate.e_score_correction_bias".format(
                self._field(f"{a}.leading_dense_block_count", 0)
            )
            in self.tensors
        )
        groups = int(self._field(f"{a}.expert_group_count", 1))
        experts = int(self._field(f"{a}.expert_count", 0))
        name = "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"
        config = {
            "architectures": [name],
            "model_type": architecture(name).model_type,
            "hidden_size": hidden,
            "intermediate_size": self._required(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._required(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "kv_lora_rank": self._required(f"{a}.attention.kv_lora_rank"),
            "q_lora_rank": int(self._field(f"{a}.attention.q_lora_rank", 0)) or None,
            "qk_nope_head_dim": key_length - rope,
            "qk_rope_head_dim": rope,
            "v_head_dim": value_length,
            **self._shared_config(embed, tokens),
            "attention_bias": False,
        }
        if experts:
            config |= {
                "n_routed_experts": experts,
                "num_experts_per_tok": self._required(f"{a}.expert_used_count"),
                "moe_intermediate_size": self._required(f"{a}.expert_feed_forward_length"),
                "n_shared_experts": int(self._field(f"{a}.expert_shared_count", 0)),
                "first_k_dense_replace": int(self._field(f"{a}.leading_dense_block_count", 0)),
                "moe_layer_freq": 1,
                "routed_scaling_factor": float(self._field(f"{a}.expert_weights_scale", 1.0)),
                "norm_topk_prob": bool(self._field(f"{a}.expert_weights_norm", False)),
                "scoring_func": "sigmoid" if v3 else "softmax",
                # without group metadata llama.cpp picks the top k of all experts; so does ridge
                "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy",
                "n_group": groups,
                "topk_group": int(self._field(f"{a}.expert_group_used_count", groups)),
            }
        self._add_special_tokens(config)
        scaling = self._field(f"{a}.rope.scaling.type")
        if scaling == "yarn":  # llama.cpp's log multiplier is 0.1 * DeepSeek's mscale_all_dim
            mscale = round(float(self._field(f"{a}.rope.scaling.yarn_log_multiplier", 0.1)) / 0.1, 6)  # float32
            config["rope_scaling"] = {
                "rope_type": "yarn",
                "factor": float(self._field(f"{a}.rope.scaling.factor")),
                "original_max_position_embeddings": self._required(f"{a}.rope.scaling.original_context_length"),
                "beta_fast": float(self._field(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(self._field(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
                "mscale": mscale,
                "mscale_all_dim": mscale,
            }
        elif scaling not in (None, "none"):
            raise ValueError(f"{self.path.name}: RoPE scaling {scaling!r} is not supported for deepseek2 (yarn is)")
        return config

    def _add_special_tokens(self, config: dict) -> None:
        for key in ("bos_token_id", "eos_token_id"):
            value = self._field(f"tokenizer.ggml.{key}")
            if value is not None and 0 <= int(value) < config["vocab_size"]:
                config[key] = int(value)

    def _required(self, key: str) -> int:
        value = self._field(key)
        if value is None:
            raise ValueError(f"{self.path.name}: metadata {key!r} is missing")
        return int(value)

    # -- tensors ------------------------------------------------------------------------
    def _read_tensors(self) -> dict[str, GGUFTensor]:
        tensors: dict[str, GGUFTensor] = {}
        split_kv_b: dict[int, dict] = {}
        heads = self._field(f"{self.arch}.attention.head_count")
        kv_heads = self._field(f"{self.arch}.attention.head_count_kv", heads)
        for t in self.reader.tensors:
            type_name = t.tensor_type.name
            parts = t.name.split(".")
            if len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_TENSORS and type_name in SUPPORTED_TYPES:
                tensors.update(self._split_experts(t, int(parts[1]), EXPERT_TENSORS[parts[2]]))
                continue
            if len(parts) == 4 and parts[2] in SPLIT_KV_B and self.arch == "deepseek2":
                split_kv_b.setdefault(int(parts[1]), {})[parts[2]] = t
                shape = self._checked(t, dims=3)  # (H, rows, K): H matrices stacked along the rows
                name = f"model.layers.{parts[1]}.{SPLIT_KV_B[parts[2]]}.weight"
                rows = (shape[0] * shape[1], shape[2])
                data = t.data.reshape(rows[0], -1)
                tensors[name] = GGUFTensor(name, type_name, rows, data)
                continue
            hf_name = _hf_name(t.name, self.family)
            if hf_name is None:
                raise ValueError(f"{self.path.name}: unexpected tensor {t.name!r} for architecture {self.arch!r}")
            shape = self._checked(t)
            data = t.data
            if type_name not in GGUF_DENSE_TYPES:
                data = data.reshape(shape[0], -1)
            elif hf_name.endswith("shared_expert_gate.weight"):  # (hidden,) -> the gate's (1, hidden)
                data, shape = data.reshape(1, -1), (1, *shape)
            if self.arch == "llama" and hf_name.endswith(
                ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
            ):
                n_heads = heads if ".q_proj." in hf_name else kv_heads
                data = _unpermute_rows(data, int(n_heads))
            tensors[hf_name] = GGUFTensor(hf_name, type_name, shape, data)
        for layer, pair in split_kv_b.items():
            joined = self._join_kv_b(layer, pair)
            for name, tensor in joined.items():
                tensors.setdefault(name, tensor)  # a file's own attn_kv_b wins
        return tensors

    def _checked(self, t, dims: int | None = None) -> tuple[int, ...]:
        """A tensor's torch-order shape, once its type is one ridge runs and its bytes (and
        number of dimensions, where given) are what the shape needs."""
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise ValueError(
                f"{self.path.name}: tensor {t.name!r} has type {type_name}, which ridge does not run; "
                f"supported: {', '.join(SUPPORTED_TYPES)}"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if (dims is not None and len(shape) != dims) or t.data.nbytes != _nbytes(type_name, shape):
            raise ValueError(f"{self.path.name}: tensor {t.name!r} is truncated or corrupt")
        return shape

    def _join_kv_b(self, layer: int, pair: dict) -> dict[str, GGUFTensor]:
        """attn_k_b (H, r, nope) and attn_v_b (H, v, r) -> kv_b_proj (H (nope + v), r), dense
        in float32 (a block format of k_b runs along nope, not along kv_b_proj's K = r)."""
        if set(pair) != set(SPLIT_KV_B):
            raise ValueError(f"{self.path.name}: layer {layer} has {sorted(pair)} without its pair")
        values = {
            kind: GGUFTensor(t.name, t.tensor_type.name, self._checked(t, dims=3), t.data).dense().float()
            for kind, t in pair.items()
        }
        k_b, v_b = values["attn_k_b"], values["attn_v_b"]
        if k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
            raise ValueError(
                f"{self.path.name}: layer {layer}'s attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} differ"
            )
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        return {name: GGUFTensor(name, "F32", tuple(kv_b.shape), kv_b.numpy())}

    def _split_experts(self, t, layer: int, proj: str) -> dict[str, GGUFTensor]:
        type_name = t.tensor_type.name
        shape = self._checked(t, dims=3)  # (E, rows, K)
        experts, rows = shape[0], shape[1]
        data = t.data.reshape(experts, rows, -1)
        return {
            name: GGUFTensor(name, type_name, shape[1:], data[e])
            for e in range(experts)
            for name in [_expert_name(self.family, layer, e, proj)]
        }

    def tensor_formats(self) -> dict[str, str]:
        return {name: t.type_name for name, t in self.tensors.items()}


def _expert_name(family: str, layer: int, expert: int, proj: str) -> str:
    """Expert ``expert``'s ``proj`` (gate_proj, up_proj, down_proj) under its family's name."""
    owner, names = EXPERT_NAMES.get(family, ("mlp.experts", {}))
    return f"model.layers.{layer}.{owner}.{expert}.{names.get(proj, proj)}.weight"


def _hf_name(name: str, arch: str = "llama") -> str | None:
    """A GGUF tensor's Hugging Face name in family ``arch`` (GGUFModel.family); None: unknown."""
    stem, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "bias"):
        return None
    if stem == "rope_freqs":
        return name
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{leaf}"
    parts = stem.split(".")
    if len(parts) < 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    if len(parts) == 4:  # blk.N.ffn_gate.E: one expert's matrix (Mixtral files before stacked experts)
        expert = arch == "mixtral" and parts[2] in PER_EXPERT_TENSORS and parts[3].isdigit() and leaf == "weight"
        return _expert_name(arch, int(parts[1]), int(parts[3]), PER_EXPERT_TENSORS[parts[2]]) if expert else None
    if len(parts) != 3:
        return None
    if parts[2] == "exp_probs_b" and leaf == "bias":  # DeepSeek-V3's router bias (noaux_tc)
        return f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias"
    names = {**LAYER_TENSORS, **ARCH_LAYER_TENSORS.get(arch, {})}
    if parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{leaf}"
    return None


def _nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    count = int(np.prod(shape))
    return count // block * size


def _unpermute_rows(data: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation; works on rows of values and rows of blocks alike."""
    rows = data.shape[0]
    rest = data.shape[1:]
    return data.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def target_format(type_name: str) -> BlockFormat | None:
    """The ridge format a tensor of this GGUF type becomes (None: dense)."""
    if type_name in GGUF_DENSE_TYPES:
        return None
    return NATIVE_TYPES.get(type_name) or CONVERTED_TYPES[type_name]


def widest(formats: list[BlockFormat | None]) -> BlockFormat | None:
    """The format a packed layer takes when its shards' formats differ (dense if any is)."""
    if any(f is None for f in formats):
        return None
    wide = min(formats, key=lambda f: WIDTH_ORDER.index(f.name))
    if not wide.quantizable and any(f is not wide for f in formats):
        return Q8_0  # the others cannot be requantized into a format ridge does not produce
    return wide


PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
    # Mixtral's experts: w1 (gate), w3 (up), w2 (down)
    "w1",
    "w3",
    "w2",
    # deepseek2's latent attention
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "k_b_proj",
    "v_b_proj",
)


def _layer_of(name: str, packed_modules: dict[str, tuple[str, int]], stacking: dict | None = None) -> str | None:
    """HF tensor name -> the ridge linear layer it loads into (None: not a linear weight)."""
    if not name.endswith(".weight"):
        return None
    module = name[: -len(".weight")]
    parent, _, child = module.rpartition(".")
    if child not in PROJECTIONS:
        return None
    owner, _, index = parent.rpartition(".")
    if stacking and child in stacking and owner.endswith(".experts") and index.isdigit():
        return f"{owner}.{stacking[child][0]}"  # one expert's projection: its layer's stacked tensor
    return f"{parent}.{packed_modules[child][0]}" if child in packed_modules else module


def layer_formats(
    model: GGUFModel, packed_modules: dict[str, tuple[str, int]], stacking: dict | None = None
) -> dict[str, BlockFormat | tuple[BlockFormat, ...] | None]:
    """ridge linear layer name -> the format its GGUF tensors ask for; dense tensors give None
    (the --quantization policy decides). A packed layer whose shards' formats differ keeps
    each shard's (a tuple in shard order: ``ShardedLinearMethod``); a stacked expert layer, or
    a packed one with a dense shard, takes the widest of its shards'."""
    wanted: dict[str, dict[int, BlockFormat | None]] = {}
    stacked: set[str] = set()
    for name, tensor in model.tensors.items():
        layer = _layer_of(name, packed_modules, stacking)
        if layer is None:
            continue
        shards = wanted.setdefault(layer, {})
        shard = _shard_of(name, packed_modules)
        if shard is None or (stacking and ".experts." in name):  # not one of a packed layer's shards
            stacked.add(layer)
        shards[len(shards) if shard is None else shard] = target_format(tensor.type_name)
    out: dict[str, BlockFormat | tuple[BlockFormat, ...] | None] = {}
    for layer, shards in wanted.items():
        formats = [shards[i] for i in sorted(shards)]
        mixed = len(set(formats)) > 1 and None not in formats
        out[layer] = tuple(formats) if mixed and layer not in stacked else widest(formats)
    return out


def _shard_of(name: str, packed_modules: dict[str, tuple[str, int]]) -> int | None:
    """A packed layer's shard index of HF tensor ``name`` (None: not a packed shard)."""
    child = name[: -len(".weight")].rpartition(".")[2] if name.endswith(".weight") else ""
    return packed_modules[child][1] if child in packed_modules else None


def conversions(
    model: GGUFModel,
    formats: dict[str, BlockFormat | tuple[BlockFormat, ...] | None],
    packed_modules,
    stacking: dict | None = None,
) -> list[str]:
    """What was converted into what, for the start-up log ('Q6_K -> int8 (Q8_0; requantized): 23 tensors')."""
    counts: dict[str, int] = {}
    for name, tensor in model.tensors.items():
        source = tensor.type_name
        layer = _layer_of(name, packed_modules, stacking)
        if layer is None:
            what = f"{source} -> dense ({name.split('.')[-2]}, dequantized)" if source not in GGUF_DENSE_TYPES else None
        elif formats.get(layer) is None:
            what = f"{source} -> dense (dequantized)" if source not in GGUF_DENSE_TYPES else None
        else:
            fmt = formats[layer]
            if isinstance(fmt, tuple):  # a packed layer held per shard
                fmt = fmt[_shard_of(name, packed_modules)]
            if source in NATIVE_TYPES and NATIVE_TYPES[source] is fmt:
                what = None
            else:
                what = f"{source} -> {fmt.name} ({fmt.ggml_name}; requantized)"
        if what:
            counts[what] = counts.get(what, 0) + 1
    return [f"{what}: {count} tensors" for what, count in sorted(counts.items())]
