"""DeepSeek V2 / V3 as llama.cpp's deepseek2 GGUF: ridge writes it as llama.cpp's converter does
(latent attention as MQA of the latent, kv_b_proj split per head into attn_k_b / attn_v_b,
leading dense layers, stacked experts, shared experts, V3's router bias, YaRN), reads it back
(kv_b_proj joined again) and computes what the Hugging Face directory computes, whose greedy
tokens transformers agrees with. Files from before llama.cpp's MLA support (one attn_kv_b,
per-head key/value lengths) read the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from ridge import LLM, SamplingParams
from ridge.layers.cpu_kernels import cpu_has_avx2
from ridge.models.export import write_gguf
from ridge.models.gguf_file import GGUFModel

from .gguf_files import llama_cpp_greedy, rewrite
from .hf_tiny import COMMON, VARIANTS, build, save_spread

gguf = pytest.importorskip("gguf")

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 250, 3, 3, 3, 17]]
OPTIONS = dict(tokenizer="bytes", dtype="float32", num_kv_blocks=64)


def _run(llm) -> tuple[list[list[int]], torch.Tensor]:
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs], torch.tensor([o.outputs[0].cumulative_logprob for o in outs])


@pytest.mark.parametrize("variant", ["deepseek-v2-lite", "deepseek-v3-yarn"])
def test_deepseek_round_trips_through_its_deepseek2_gguf(tmp_path, variant):
    hf = build(variant, tmp_path / "hf", seed=4)
    cfg = hf.config
    path = write_gguf(tmp_path / "hf", cfg.to_dict(), tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer")}
    assert fields["general.architecture"] == "deepseek2"
    assert fields["deepseek2.attention.head_count_kv"] == 1  # MQA of the latent, as llama.cpp runs MLA
    assert fields["deepseek2.attention.key_length"] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert fields["deepseek2.attention.key_length_mla"] == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert fields["deepseek2.leading_dense_block_count"] == 1
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    heads = cfg.num_attention_heads
    assert shapes["blk.0.attn_k_b.weight"] == (heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim)
    assert shapes["blk.0.attn_v_b.weight"] == (heads, cfg.v_head_dim, cfg.kv_lora_rank)
    assert "blk.0.ffn_gate.weight" in shapes and "blk.0.ffn_gate_exps.weight" not in shapes  # the dense layer
    assert shapes["blk.1.ffn_gate_exps.weight"] == (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    assert ("blk.1.exp_probs_b.bias" in shapes) == (variant == "deepseek-v3-yarn")

    from_dir = LLM(str(tmp_path / "hf"), **OPTIONS)
    from_file = LLM(str(path), **OPTIONS)
    assert from_file.engine.model_config.mla == from_dir.engine.model_config.mla
    assert from_file.engine.model_config.moe == from_dir.engine.model_config.moe
    file_cfg, dir_cfg = from_file.engine.model_config, from_dir.engine.model_config
    assert file_cfg.rope_theta == dir_cfg.rope_theta
    if variant == "deepseek-v3-yarn":  # HF's dict also repeats rope_theta
        assert file_cfg.rope_scaling.items() <= dir_cfg.rope_scaling.items()
    tokens_dir, logprob_dir = _run(from_dir)
    tokens_file, logprob_file = _run(from_file)
    assert tokens_file == tokens_dir
    torch.testing.assert_close(logprob_file, logprob_dir, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the greedy tokens are transformers' too
        ids = torch.tensor([PROMPTS[1] + tokens_file[1]])
        ref = hf(ids).logits[0, len(PROMPTS[1]) - 1 : -1].argmax(-1).tolist()
    assert ref == tokens_file[1]


def test_a_file_from_before_llama_cpps_mla_reads_the_same(tmp_path):
    """One attn_kv_b per layer and the per-head key/value lengths (head_count_kv = heads)."""
    build("deepseek-v2-lite", tmp_path / "hf", seed=5)
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()
    new = write_gguf(tmp_path / "hf", hf_config, tmp_path / "new.gguf")
    model = GGUFModel(new)
    joined = {n: t.dense() for n, t in model.tensors.items() if n.endswith("kv_b_proj.weight")}
    heads, nope, v = hf_config["num_attention_heads"], hf_config["qk_nope_head_dim"], hf_config["v_head_dim"]

    def old_layout(name, values):
        if name.endswith("attn_k_b.weight"):  # its layer's kv_b_proj whole, under the old name
            layer = name.split(".")[1]
            return joined[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].numpy(), gguf.GGMLQuantizationType.F32
        if name.endswith("attn_v_b.weight"):
            return "drop"
        return None

    old = rewrite(
        new,
        tmp_path / "old.gguf",
        old_layout,
        rename={"attn_k_b": "attn_kv_b"},
        uints={
            "deepseek2.attention.head_count_kv": heads,
            "deepseek2.attention.key_length": nope + hf_config["qk_rope_head_dim"],
            "deepseek2.attention.value_length": v,
        },
        skip_keys=("deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla"),
    )
    old_model = GGUFModel(old)
    for name, weight in joined.items():
        assert np.array_equal(old_model.tensors[name].dense().numpy(), weight.numpy())
    assert old_model.hf_config["qk_nope_head_dim"] == nope and old_model.hf_config["v_head_dim"] == v
    assert _run(LLM(str(old), **OPTIONS))[0] == _run(LLM(str(new), **OPTIONS))[0]

    def matrices(m, skip):  # every 2-D weight but the (untied) embedding, the routers and ``skip``
        assert "lm_head.weight" in m.tensors
        leave_out = ("model.embed_tokens.weight", ".mlp.gate.weight", skip)
        return sum(
            t.shape[0] * t.shape[1]
            for n, t in m.tensors.items()
            if len(t.shape) == 2 and n.endswith(".weight") and not any(part in n for part in leave_out)
        )

    # weights_by_format: the absorbed decode reads the per-head halves, so the joined kv_b_proj
    # counts only where the file has no halves (the routers are priced apart, in float32)
    assert sum(model.weights_by_format().values()) == matrices(model, ".kv_b_proj.")
    assert not any(".k_b_proj." in n for n in old_model.tensors)
    assert sum(old_model.weights_by_format().values()) == matrices(old_model, "no name has this")


def _q8(name, values):
    if values.ndim >= 2 and values.shape[-1] % 32 == 0 and "norm" not in name and "gate_inp" not in name:
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return None


@pytest.mark.parametrize("kernels", ["auto", "avx2"])
def test_a_quantized_deepseek2_file_keeps_its_blocks(tmp_path, kernels):
    """Q8_0 matrices stay Q8_0: the latent attention's projections (q_a, kv_a, q_b: the fused
    a-projection and q_b_proj, o_proj), stacked experts too. attn_k_b and attn_v_b are the
    absorbed decode's per-head matrices, the file's bytes as they are (k_b_proj, v_b_proj);
    joined, dense, within Q8_0's rounding, they are kv_b_proj for prefill."""
    config_cls, model_cls, extra = VARIANTS["deepseek-v3-yarn"]
    widths = {"qk_nope_head_dim": 32, "q_lora_rank": 32}  # k_b's and q_b's K: whole Q8_0 blocks
    save_spread(model_cls, config_cls(**{**COMMON, **extra, **widths}), tmp_path / "hf", seed=6)
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()
    dense = write_gguf(tmp_path / "hf", hf_config, tmp_path / "f32.gguf")
    path = rewrite(dense, tmp_path / "q8.gguf", _q8)
    if kernels == "avx2" and not cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    on_cpu = {**OPTIONS, "device": "cpu"}  # the CPU kernels' layouts (a GPU dequantizes the per-head blocks)
    llm = LLM(str(path), kernels=kernels, **on_cpu)
    layer = llm.engine.executor.worker.model.model.layers[1]
    attention = layer.self_attn
    for linear in (attention.fused_qkv_a_proj, attention.q_b_proj, attention.o_proj, layer.mlp.experts.gate_up_proj):
        assert linear.method.format.name == "int8"
    file = GGUFModel(path)
    for name in ("k_b_proj", "v_b_proj"):
        stack = getattr(attention, name)
        assert stack.method.format.name == "int8"
        assert torch.equal(
            stack.method.blocks_of(stack).cpu(), file.tensors[f"model.layers.1.self_attn.{name}.weight"].blocks()
        )
    assert attention.kv_b_proj.method.format is None  # joined from k_b / v_b: dense
    # the weight pricing counts kv_b_proj's parameters once, as decode reads them (the file's
    # Q8_0 copies), not also as prefill's dense join
    model = llm.engine.executor.worker.model
    read = model.decode_read_layers()
    assert attention.kv_b_proj not in read and attention.k_b_proj in read and attention.v_b_proj in read
    assert model.linear_weight_params() == sum(m.in_features * m.out_features for m in model.linear_layers()) - sum(
        layer.self_attn.kv_b_proj.in_features * layer.self_attn.kv_b_proj.out_features for layer in model.model.layers
    )
    assert llm.engine.model_info.weight_bytes == model.linear_weight_bytes()
    reference = GGUFModel(dense).tensors["model.layers.1.self_attn.kv_b_proj.weight"].dense()
    got = attention.kv_b_proj.dense_weight().float()
    assert (got - reference).abs().max().item() <= reference.abs().max().item() / 127
    # the torch kernels on the same file (its blocks dequantized, x not quantized): the same
    # greedy tokens, summed logprobs of 10 tokens within the int8 rounding of the activations
    tokens, logprobs = _run(llm)
    if cpu_has_avx2():  # decode reads the file's blocks (either CPU kernel set; torch's: dense copies)
        assert attention.absorbed == (attention.k_b_proj, attention.v_b_proj)
    torch_tokens, torch_logprobs = _run(LLM(str(path), kernels="torch", **on_cpu))
    assert tokens == torch_tokens
    assert (logprobs - torch_logprobs).abs().max().item() < 0.2


def test_llama_cpp_decodes_the_same_greedy_tokens(tmp_path):
    """ridge's deepseek2 file of DeepSeek-V3 (q_lora_rank, sigmoid router with its bias, YaRN)
    in llama.cpp (where llama-cpp-python is installed): the same greedy tokens as ridge."""
    pytest.importorskip("llama_cpp")
    hf = build("deepseek-v3-yarn", tmp_path / "hf", seed=0)
    path = write_gguf(tmp_path / "hf", hf.config.to_dict(), tmp_path / "tiny-v3.gguf")
    assert _run(LLM(str(path), **OPTIONS))[0][1] == llama_cpp_greedy(path, PROMPTS[1], 10)


def test_a_deepseek2_model_exports_hugging_faces_tensors_only(tmp_path):
    """hf_state_dict of a model read from a deepseek2 file: kv_b_proj, not the file's per-head
    copies of its rows (k_b_proj, v_b_proj); q's a-projection under the one name the model
    has (q_a_proj with q_lora_rank). Written again, the file computes the same tokens."""
    from ridge.models.export import hf_state_dict

    hf = build("deepseek-v3-yarn", tmp_path / "hf", seed=7)
    path = write_gguf(tmp_path / "hf", hf.config.to_dict(), tmp_path / "tiny.gguf")
    llm = LLM(str(path), **OPTIONS)
    state = hf_state_dict(llm)
    assert not [name for name in state if name.endswith((".k_b_proj.weight", ".v_b_proj.weight", ".q_proj.weight"))]
    assert "model.layers.0.self_attn.q_a_proj.weight" in state and "model.layers.0.self_attn.kv_b_proj.weight" in state
    again = write_gguf(state, llm.engine.hf_config, tmp_path / "again.gguf")
    assert not [t.name for t in gguf.GGUFReader(again).tensors if t.name.endswith("attn_q.weight")]
    assert _run(LLM(str(again), **OPTIONS))[0] == _run(llm)[0]
