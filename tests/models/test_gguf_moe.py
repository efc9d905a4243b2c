"""Qwen3-MoE as llama.cpp's qwen3moe GGUF: ridge writes it (experts stacked into 3-D tensors),
reads it back (split per expert, stacked again into its own layout), and computes what the
Hugging Face directory computes; llama.cpp, where installed, agrees on the greedy tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from ridge import LLM, SamplingParams
from ridge.models.export import hf_state_dict, write_gguf

from .gguf_files import llama_cpp_greedy, one_tensor_per_expert
from .hf_tiny import COMMON, save_spread

gguf = pytest.importorskip("gguf")

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 250, 3, 3, 3, 17]]


def _tiny_dir(tmp_path_factory, family: str, seed: int, **fields):
    """A random tiny model of ``family`` (transformers' {family}Config / {family}ForCausalLM):
    COMMON's sizes, an untied lm_head, and ``fields``, saved as a Hugging Face directory."""
    config = getattr(transformers, f"{family}Config")(**{**COMMON, "tie_word_embeddings": False, **fields})
    directory = tmp_path_factory.mktemp(family.lower())
    save_spread(getattr(transformers, f"{family}ForCausalLM"), config, directory, seed=seed)
    return directory


@pytest.fixture(scope="module")
def qwen3moe_dir(tmp_path_factory):
    return _tiny_dir(
        tmp_path_factory,
        "Qwen3Moe",
        0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        head_dim=16,
    )


def _run(llm) -> tuple[list[list[int]], list[torch.Tensor]]:
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs], [torch.tensor(o.outputs[0].cumulative_logprob) for o in outs]


def _exported(directory, path):
    """The Hugging Face directory's model written as llama.cpp's GGUF at ``path``."""
    llm = LLM(str(directory), tokenizer="bytes", dtype="float32", num_kv_blocks=64, kernels="torch")
    return write_gguf(hf_state_dict(llm), llm.engine.hf_config, path)


def _assert_same_outputs(from_file, from_dir) -> list[list[int]]:
    """The same greedy tokens and log-probabilities (to float rounding); the tokens."""
    tokens_dir, logprob_dir = _run(from_dir)
    tokens_file, logprob_file = _run(from_file)
    assert tokens_file == tokens_dir
    torch.testing.assert_close(torch.stack(logprob_file), torch.stack(logprob_dir), rtol=1e-4, atol=1e-4)
    return tokens_file


def _check_q8_0_experts(source, directory, target, ffn: str) -> None:
    """llama.cpp's quantizer writes Q8_0 experts into ``target``; ridge loads their bytes as they
    are (int8 blocks), and decodes nearly every greedy token the directory's model does."""
    lc = pytest.importorskip("llama_cpp")
    import ctypes

    params = lc.llama_model_quantize_default_params()
    params.ftype = lc.LLAMA_FTYPE_MOSTLY_Q8_0
    assert lc.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) == 0
    quantized = LLM(str(target), tokenizer="bytes", dtype="float32", num_kv_blocks=64)
    experts = getattr(quantized.engine.executor.worker.model.model.layers[0], ffn).experts
    assert experts.gate_up_proj.method.name == "int8" and experts.down_proj.method.name == "int8"
    tokens, _ = _run(quantized)
    reference, _ = _run(LLM(str(directory), tokenizer="bytes", dtype="float32", num_kv_blocks=64))
    agree = sum(a == b for x, y in zip(tokens, reference) for a, b in zip(x, y)) / sum(map(len, reference))
    assert agree >= 0.75  # int8 weights: nearly every greedy token the same


def _check_routers_left_out_of_the_weight_mix(path, router: str) -> None:
    """weights_by_format (the analyzer's weight mix) counts every matrix a decode step reads
    but the routers, which are priced apart at float32 (and the untied embedding)."""
    from ridge.models.gguf_file import GGUFModel

    model = GGUFModel(path)
    matrices = {
        name: t.shape[0] * t.shape[1]
        for name, t in model.tensors.items()
        if len(t.shape) == 2 and name.endswith(".weight") and name != "model.embed_tokens.weight"
    }
    routers = [name for name in matrices if name.endswith(f".{router}.weight")]
    assert len(routers) == model.hf_config["num_hidden_layers"]
    assert sum(model.weights_by_format().values()) == sum(matrices.values()) - sum(matrices[n] for n in routers)


def _check_llama_cpp_greedy(path) -> None:
    pytest.importorskip("llama_cpp")
    theirs = llama_cpp_greedy(path, PROMPTS[0], 12)
    ours = LLM(str(path), tokenizer="bytes", dtype="float32", num_kv_blocks=64)
    assert _run(ours)[0][0][:8] == theirs[:8]


@pytest.fixture(scope="module")
def qwen3moe_gguf(qwen3moe_dir, tmp_path_factory):
    return _exported(qwen3moe_dir, tmp_path_factory.mktemp("gguf") / "tiny-qwen3moe-f32.gguf")


def test_the_qwen3moe_file_holds_stacked_experts(qwen3moe_gguf):
    reader = gguf.GGUFReader(qwen3moe_gguf)
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    assert reader.fields["qwen3moe.expert_count"].contents() == 8
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == (8, 32, 64)
    assert shapes["blk.1.ffn_down_exps.weight"] == (8, 64, 32)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (8, 64)
    _check_routers_left_out_of_the_weight_mix(qwen3moe_gguf, "mlp.gate")


def test_ridge_reads_its_qwen3moe_gguf_back_to_the_same_outputs(qwen3moe_dir, qwen3moe_gguf):
    from_dir = LLM(str(qwen3moe_dir), tokenizer="bytes", dtype="float32", num_kv_blocks=64)
    from_file = LLM(str(qwen3moe_gguf), tokenizer="bytes", dtype="float32", num_kv_blocks=64)
    assert from_file.engine.model_config.moe == from_dir.engine.model_config.moe
    _assert_same_outputs(from_file, from_dir)


def test_a_q8_0_qwen3moe_file_loads_its_experts_as_int8_blocks(qwen3moe_dir, qwen3moe_gguf, tmp_path):
    _check_q8_0_experts(qwen3moe_gguf, qwen3moe_dir, tmp_path / "q8_0.gguf", "mlp")


def test_llama_cpp_decodes_the_same_greedy_tokens(qwen3moe_gguf):
    _check_llama_cpp_greedy(qwen3moe_gguf)


# -- qwen2moe: the shared expert under its sigmoid gate, q/k/v biases, top-k not renormalized ----


@pytest.fixture(scope="module")
def qwen2moe_dir(tmp_path_factory):
    return _tiny_dir(
        tmp_path_factory,
        "Qwen2Moe",
        1,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
    )


def test_qwen2moe_round_trips_through_its_gguf(qwen2moe_dir, tmp_path):
    """llama.cpp's qwen2moe layout (the shared expert's gate 1-D, experts stacked): written by
    ridge, read back to the outputs of the Hugging Face directory, which transformers agrees with."""
    from_dir = LLM(str(qwen2moe_dir), tokenizer="bytes", dtype="float32", num_kv_blocks=64, kernels="torch")
    path = write_gguf(hf_state_dict(from_dir), from_dir.engine.hf_config, tmp_path / "tiny-qwen2moe-f32.gguf")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "qwen2moe"
    assert reader.fields["qwen2moe.expert_shared_feed_forward_length"].contents() == 48
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (64,) and shapes["blk.1.ffn_up_shexp.weight"] == (48, 64)
    assert shapes["blk.0.attn_q.bias"] == (64,) and shapes["blk.0.ffn_gate_exps.weight"] == (8, 32, 64)

    from_file = LLM(str(path), tokenizer="bytes", dtype="float32", num_kv_blocks=64)
    assert from_file.engine.model_config.moe == from_dir.engine.model_config.moe
    assert from_file.engine.model_config.qkv_bias
    tokens_file = _assert_same_outputs(from_file, from_dir)
    hf = transformers.Qwen2MoeForCausalLM.from_pretrained(qwen2moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # the greedy tokens are transformers' too
        ids = torch.tensor([PROMPTS[0] + tokens_file[0]])
        ref = hf(ids).logits[0, len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()
    assert ref == tokens_file[0]


# -- Mixtral: llama.cpp's llama architecture with experts (w1 gate, w3 up, w2 down) -------------


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    # experts 96 wide: K of the down projection a multiple of 32, so llama.cpp quantizes it too
    return _tiny_dir(tmp_path_factory, "Mixtral", 2, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def mixtral_gguf(mixtral_dir, tmp_path_factory):
    return _exported(mixtral_dir, tmp_path_factory.mktemp("gguf") / "tiny-mixtral-f32.gguf")


def test_a_mixtral_gguf_is_llamas_architecture_with_stacked_experts(mixtral_gguf):
    """As llama.cpp's converter writes Mixtral: general.architecture llama, expert_count and
    expert_used_count, the router and each projection's experts as one 3-D tensor."""
    reader = gguf.GGUFReader(mixtral_gguf)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.expert_count"].contents() == 4
    assert reader.fields["llama.expert_used_count"].contents() == 2
    assert reader.fields["llama.feed_forward_length"].contents() == 96
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    assert shapes["blk.0.ffn_gate_inp.weight"] == (4, 64)
    assert shapes["blk.1.ffn_gate_exps.weight"] == (4, 96, 64) and shapes["blk.1.ffn_down_exps.weight"] == (4, 64, 96)
    assert not any(name.startswith("blk.0.ffn_gate.") for name in shapes)
    _check_routers_left_out_of_the_weight_mix(mixtral_gguf, "block_sparse_moe.gate")


def test_a_mixtral_gguf_runs_as_mixtral_with_the_directorys_outputs(mixtral_dir, mixtral_gguf, tmp_path):
    """Read as MixtralForCausalLM (not a dense Llama): the Hugging Face directory's tokens and
    log-probabilities; a file of the layout before stacked experts (one tensor an expert) the same."""
    from_dir = LLM(str(mixtral_dir), tokenizer="bytes", dtype="float32", num_kv_blocks=64)
    from_file = LLM(str(mixtral_gguf), tokenizer="bytes", dtype="float32", num_kv_blocks=64)
    assert from_file.engine.hf_config["architectures"] == ["MixtralForCausalLM"]
    assert from_file.engine.model_config.moe == from_dir.engine.model_config.moe
    assert from_file.engine.model_config.moe.num_experts == 4
    tokens_file = _assert_same_outputs(from_file, from_dir)

    early = one_tensor_per_expert(mixtral_gguf, tmp_path / "tiny-mixtral-per-expert.gguf")
    assert "blk.0.ffn_gate.3.weight" in {t.name for t in gguf.GGUFReader(early).tensors}
    from_early = LLM(str(early), tokenizer="bytes", dtype="float32", num_kv_blocks=64)
    assert _run(from_early)[0] == tokens_file


def test_llama_cpp_decodes_mixtrals_file_to_the_same_greedy_tokens(mixtral_gguf):
    _check_llama_cpp_greedy(mixtral_gguf)


def test_a_q8_0_mixtral_file_loads_its_experts_as_int8_blocks(mixtral_dir, mixtral_gguf, tmp_path):
    _check_q8_0_experts(mixtral_gguf, mixtral_dir, tmp_path / "tiny-mixtral-q8_0.gguf", "block_sparse_moe")
