"""A model quantized at load against transformers running the same quantized weights.

The reference: a Hugging Face model whose linear weights were quantized and dequantized by
llama.cpp's own Python code (``gguf.quants``). ridge's torch path must match it as any
float32 model does (1e-4); ridge's CPU kernels (int8 activations, integer dot products)
within the error an 8-bit activation adds.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from ridge import LLM, SamplingParams
from ridge.layers.cpu_kernels import cpu_has_avx512_bf16
from ridge.quantization.formats import FORMATS, QUANTIZATION_FORMATS

from ..models.hf_tiny import COMMON, save_spread
from ..models.test_parity import _prompts, _record_logits

gguf = pytest.importorskip("gguf")
quants = pytest.importorskip("gguf.quants")

STEPS = 8
# the formats gguf.quants can quantize (the reference); the K-quants (K in 256s) are tested apart
PER_32 = [name for name in QUANTIZATION_FORMATS if FORMATS[name].block == 32]


def _build(directory, tied: bool) -> None:
    # every K a multiple of 32: every layer quantizes
    config = transformers.LlamaConfig(**{**COMMON, "intermediate_size": 96, "tie_word_embeddings": tied})
    save_spread(transformers.LlamaForCausalLM, config, directory)


def _reference(directory, fmt_name: str, tied: bool):
    """transformers on the weights llama.cpp's quantizer would give (embedding and a tied head stay)."""
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    qtype = gguf.GGMLQuantizationType(FORMATS[fmt_name].ggml_type)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not (tied and name == "lm_head"):
                w = module.weight.detach().numpy()
                module.weight.copy_(torch.from_numpy(quants.dequantize(quants.quantize(w, qtype), qtype)))
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("quant-tied" if request.param else "quant")
    _build(directory, request.param)
    return directory, request.param


def _run(directory, fmt_name: str, kernels: str):
    llm = LLM(
        str(directory),
        tokenizer="bytes",
        dtype="float32",
        quantization=fmt_name,
        kernels=kernels,
        num_kv_blocks=64,
        device="cpu",
    )
    seen = _record_logits(llm)
    prompts = _prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, prompts, outputs, seen


def _hf_logits(hf, prompt, tokens):
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0]
    return ref[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


@pytest.mark.parametrize("fmt_name", PER_32)
def test_torch_path_matches_transformers_on_the_quantized_weights(model_dir, fmt_name):
    directory, tied = model_dir
    hf = _reference(directory, fmt_name, tied)
    llm, prompts, outputs, seen = _run(directory, fmt_name, "torch")
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        ref = _hf_logits(hf, prompt, tokens)
        got = torch.stack(seen[out.request_id])
        assert (got - ref).abs().max().item() <= 1e-4
        assert tokens == ref.argmax(-1).tolist()
    head = llm.engine.executor.worker.model.lm_head
    assert (head.method.format is None) == tied  # a tied head stays with the embedding


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 + VNNI")
@pytest.mark.parametrize("fmt_name", PER_32)
def test_cpu_kernels_match_transformers_within_int8_activations(model_dir, fmt_name):
    directory, tied = model_dir
    hf = _reference(directory, fmt_name, tied)
    llm, prompts, outputs, seen = _run(directory, fmt_name, "auto")
    layer = llm.engine.executor.worker.model.model.layers[0].mlp.down_proj
    assert layer.packed is not None and layer.blocks.numel() == 0  # repacked by the kernels, plain copy freed
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        ref = _hf_logits(hf, prompt, tokens)
        got = torch.stack(seen[out.request_id])
        scale = ref.abs().max().item()
        assert (got - ref).abs().max().item() <= 0.03 * scale
        assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item() > 0.999


@pytest.mark.parametrize("fmt_name", PER_32)
def test_weight_bytes_are_the_formats(model_dir, fmt_name):
    directory, tied = model_dir
    llm = LLM(str(directory), tokenizer="bytes", dtype="float32", quantization=fmt_name, num_kv_blocks=8)
    fmt = FORMATS[fmt_name]
    for layer in (
        llm.engine.executor.worker.model.model.layers[0].self_attn.o_proj,
        llm.engine.executor.worker.model.model.layers[1].mlp.down_proj,
    ):
        rows = -(-layer.out_features // 16) * 16 if layer.packed is not None else layer.out_features
        assert layer.weight_nbytes() == rows * layer.in_features // 32 * fmt.type_size


def test_layers_that_cannot_quantize_stay_and_the_log_says_so(stories_dir, caplog):
    with caplog.at_level(logging.INFO, logger="ridge"):
        llm = LLM(str(stories_dir), quantization="int8", num_kv_blocks=32)
    model = llm.engine.executor.worker.model
    assert model.model.layers[0].self_attn.qkv_proj.method.format is FORMATS["int8"]
    assert model.model.layers[0].mlp.gate_up_proj.method.format is FORMATS["int8"]
    assert model.model.layers[0].mlp.down_proj.method.format is None  # K = 172
    assert model.lm_head.method.format is None  # tied to the embedding
    log = caplog.text
    assert "model.layers.*.mlp.down_proj: unquantized (K = 172 is not a multiple of 32)" in log
    assert "lm_head: unquantized (tied to the embedding" in log
    assert "model.layers.*.self_attn.qkv_proj: int8 (Q8_0, 8.5 bits)" in log


def test_int8_stories_still_tells_the_story(stories_dir):
    llm = LLM(str(stories_dir), quantization="int8", num_kv_blocks=64)
    text = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert text[0].outputs[0].text.startswith(", there was a little girl named Lily. She loved to play outside")


def test_unknown_quantization_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM("random:tiny", quantization="int3")


@pytest.mark.parametrize("fmt_name", ["q4_k", "q6_k"])
def test_k_quants_at_load(tmp_path, fmt_name):
    """--quantization q4_k / q6_k on a model whose K are multiples of 256: every linear layer
    holds llama.cpp's super-blocks (its reference quantizer), the torch path computes what
    transformers computes on those weights, the CPU kernels stay within int8 activations."""
    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    fmt = FORMATS[fmt_name]
    with torch.no_grad():  # the reference: transformers on the weights ridge's quantizer gives
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(fmt.dequantize(fmt.quantize(module.weight), module.in_features))
    llm, prompts, outputs, seen = _run(tmp_path, fmt_name, "torch")
    layers = llm.engine.executor.worker.model.model.layers
    assert layers[0].mlp.down_proj.method.format is fmt and layers[1].self_attn.qkv_proj.method.format is fmt
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        ref = _hf_logits(hf, prompt, tokens)
        assert (torch.stack(seen[out.request_id]) - ref).abs().max().item() <= 1e-4
        assert tokens == ref.argmax(-1).tolist()
    if cpu_has_avx512_bf16():
        llm, prompts, outputs, seen = _run(tmp_path, fmt_name, "auto")
        assert llm.engine.executor.worker.model.model.layers[0].mlp.down_proj.packed is not None
        for prompt, out in zip(prompts, outputs):
            ref = _hf_logits(hf, prompt, out.outputs[0].token_ids)
            got = torch.stack(seen[out.request_id])
            assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item() > 0.999
