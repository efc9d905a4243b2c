"""Exporting a ridge model: transformers loads the same weights; GGUF reads back as llama.cpp expects."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ridge import LLM, SamplingParams
from ridge.models.export import hf_state_dict, permute_for_llama_cpp, save_hf_checkpoint, write_gguf

from .hf_tiny import build

ATOL = 1e-4


def _ridge_logits(llm: LLM, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of every sampled row (float32 engine)."""
    runner = llm.engine.executor.worker.runner
    seen: list[torch.Tensor] = []
    original = runner.forward_logits

    def recording(batch):
        logits = original(batch)
        seen.extend(row.clone() for row in logits)
        return logits

    runner.forward_logits = recording
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    runner.forward_logits = original
    return out[0].outputs[0].token_ids, torch.stack(seen)


def test_transformers_loads_the_same_model(tmp_path):
    import transformers

    llm = LLM("random:tiny", dtype="float32", seed=7)
    directory = save_hf_checkpoint(llm, llm.engine.hf_config, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to("cpu").eval()
    prompt = torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens, logits = _ridge_logits(llm, prompt, steps=6)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    assert (logits.cpu() - ref).abs().max().item() <= ATOL  # the engine may run on CUDA
    assert tokens == ref.argmax(-1).tolist()


def test_round_trip_of_a_tied_checkpoint(tmp_path):
    original = build("llama-tied-llama3-rope", tmp_path / "orig")
    llm = LLM(str(tmp_path / "orig"), tokenizer="bytes", dtype="float32")
    names = set(hf_state_dict(llm))
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.q_proj.weight" in names
    save_hf_checkpoint(llm, llm.engine.hf_config, tmp_path / "export")
    saved = load_file(str(tmp_path / "export" / "model.safetensors"))
    reference = {k: v for k, v in original.state_dict().items() if k != "lm_head.weight"}
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(saved[name], tensor), name


def test_gguf_reads_back(tmp_path):
    gguf = pytest.importorskip("gguf")
    llm = LLM("random:tiny", dtype="bfloat16", seed=3)
    cfg = llm.engine.model_config
    directory = save_hf_checkpoint(llm, llm.engine.hf_config, tmp_path / "hf")
    path = write_gguf(directory, llm.engine.hf_config, tmp_path / "model.gguf")

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{n}.weight" for i in range(cfg.num_layers) for n in per_layer}
    assert set(tensors) == expected
    # GGUF lists dimensions innermost first: (in_features, out_features)
    shapes = {
        "token_embd.weight": (cfg.hidden_size, cfg.vocab_size),
        "output.weight": (cfg.hidden_size, cfg.vocab_size),
        "blk.0.attn_q.weight": (cfg.hidden_size, cfg.q_size),
        "blk.0.attn_k.weight": (cfg.hidden_size, cfg.kv_size),
        "blk.0.ffn_gate.weight": (cfg.hidden_size, cfg.intermediate_size),
        "blk.0.ffn_down.weight": (cfg.intermediate_size, cfg.hidden_size),
        "blk.0.attn_norm.weight": (cfg.hidden_size,),
    }
    for name, shape in shapes.items():
        assert tuple(int(d) for d in tensors[name].shape) == shape, name
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32

    state = {name: t.cpu() for name, t in hf_state_dict(llm).items()}  # the engine may run on CUDA

    def stored(name):  # raw bf16 bits as written
        return torch.from_numpy(tensors[name].data.copy()).view(torch.bfloat16).reshape(-1)

    k = state["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(stored("blk.1.attn_k.weight"), permute_for_llama_cpp(k, cfg.num_kv_heads).reshape(-1))
    assert torch.equal(stored("blk.1.attn_v.weight"), state["model.layers.1.self_attn.v_proj.weight"].reshape(-1))

    field = reader.fields["llama.attention.head_count_kv"]
    assert int(field.parts[field.data[0]][0]) == cfg.num_kv_heads
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == cfg.vocab_size


def test_permutation_interleaves_rotate_half_pairs():
    # one head of dim 4: HF pairs rows (0, 2) and (1, 3); llama.cpp wants them adjacent
    weight = torch.arange(4.0).reshape(4, 1)
    assert permute_for_llama_cpp(weight, 1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]
