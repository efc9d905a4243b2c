"""Latent attention: the absorbed decode and the expanded prefill against attention written
out by hand on the expanded keys and values, over the paged latent cache."""

from __future__ import annotations

import pytest
import torch

from ridge.kv import cache as kv_cache
from ridge.kv.cache import KVCacheSpec
from ridge.layers.attention import AttentionMetadata, PrefillChunk
from ridge.layers.cpu_kernels import cpu_has_avx512_bf16
from ridge.layers.kernels import TorchKernels
from ridge.layers.linear import Linear
from ridge.layers.mla import mla_attention

H, NOPE, ROPE, RANK, V = 4, 16, 8, 32, 12
BLOCK = 4


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kv_b = Linear(RANK, H * (NOPE + V), bias=False)
    with torch.no_grad():
        kv_b.weight.normal_(0, 0.2, generator=gen)
    w = kv_b.weight.detach().view(H, NOPE + V, RANK)
    absorbed = (w[:, :NOPE].contiguous(), w[:, NOPE:].transpose(1, 2).contiguous())  # W_uk, W_uv^T
    return gen, kv_b, absorbed


def _reference(q_nope, q_rope, entries, absorbed, scale):
    """Every query at the end of the context: the keys and values expanded per head."""
    w_uk, w_uv_t = absorbed
    latent, k_rope = entries[:, 0, :RANK], entries[:, 0, RANK:]
    keys = torch.cat((torch.einsum("lr,hnr->lhn", latent, w_uk), k_rope[:, None].expand(-1, H, -1)), -1)
    values = torch.einsum("lr,hrv->lhv", latent, w_uv_t)
    query = torch.cat((q_nope, q_rope), -1)  # (H, nope + p)
    probs = (torch.einsum("hd,lhd->hl", query, keys) * scale).softmax(-1)
    return torch.einsum("hl,lhv->hv", probs, values)


@pytest.mark.parametrize("kind", ["auto", "int8"])
@pytest.mark.parametrize("context", [1, 5, 13])
def test_absorbed_decode_and_expanded_prefill_equal_attention_on_expanded_heads(kind, context):
    gen, kv_b, absorbed = _setup(context)
    scale = 0.3
    entries = torch.randn(context, 1, RANK + ROPE, generator=gen)
    q_nope, q_rope = torch.randn(context, H, NOPE, generator=gen), torch.randn(context, H, ROPE, generator=gen)
    spec = KVCacheSpec(1, 1, RANK + ROPE, keys_only=True)
    ops = TorchKernels()
    table = torch.tensor([5, 2, 7, 0])  # scattered physical blocks
    slots = table[torch.arange(context) // BLOCK] * BLOCK + torch.arange(context) % BLOCK

    # the whole context as one prefill chunk (expanded)
    cache = kv_cache.allocate(spec, 8, BLOCK, torch.float32, torch.device("cpu"), kind)[0]
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, context, context, table)])
    prefill = mla_attention(q_nope, q_rope, entries, cache, meta, absorbed, kv_b, scale, ops)

    # the same context: the prefix as a prefill, then the last token as a decode (absorbed)
    cache2 = kv_cache.allocate(spec, 8, BLOCK, torch.float32, torch.device("cpu"), kind)[0]
    if context > 1:
        n = context - 1
        meta = AttentionMetadata(slot_mapping=slots[:n], prefills=[PrefillChunk(0, n, n, table)])
        mla_attention(q_nope[:n], q_rope[:n], entries[:n], cache2, meta, absorbed, kv_b, scale, ops)
    meta = AttentionMetadata(
        slot_mapping=slots[-1:],
        num_decode_tokens=1,
        decode_block_tables=table[None],
        decode_context_lens=torch.tensor([context]),
    )
    decode = mla_attention(q_nope[-1:], q_rope[-1:], entries[-1:], cache2, meta, absorbed, kv_b, scale, ops)

    stored = entries
    if kind != "auto":  # what the cache holds is the quantized latent: the reference sees the same
        codes, scales = kv_cache.quantize(entries, kind)
        stored = kv_cache.dequantize(codes, scales, kind, torch.float32)
    ref = _reference(q_nope[-1], q_rope[-1], stored, absorbed, scale)
    torch.testing.assert_close(decode[0], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefill[-1], ref, rtol=1e-5, atol=1e-5)


def test_the_latent_cache_holds_rank_plus_rope_values_per_token_and_layer():
    from ridge import LLM
    from ridge.models.presets import get_preset
    from ridge.roofline.shapes import ModelShape

    llm = LLM("random:tiny-deepseek-v3", device="cpu", dtype="float32", num_kv_blocks=16, block_size=4)
    engine = llm.engine
    mla = engine.model_config.mla
    assert engine.model_info.kv_spec == KVCacheSpec(3, 1, mla.kv_lora_rank + mla.qk_rope_head_dim, keys_only=True)
    assert engine.executor.worker.kv_caches[0].k.shape == (16, 4, 1, mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert (
        engine.executor.worker.kv_caches[0].v is engine.executor.worker.kv_caches[0].k
    )  # one vector is both key and value
    per_token = 3 * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert engine.kv_bytes_per_block == 4 * per_token * 4  # float32
    shape = ModelShape.from_hf_config(get_preset("tiny-deepseek-v3"))
    assert shape.kv_cache_elements_per_token() == per_token  # the analyzer agrees


def test_the_expanded_decode_form_generates_what_the_absorbed_one_does():
    """benchmarks/mla_decode.py's comparison runs the same arithmetic both ways."""
    from ridge import LLM, SamplingParams
    from ridge.models.deepseek import DeepseekAttention

    llm = LLM("random:tiny-deepseek-v3", device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    absorbed = llm.generate(prompts, params, use_tqdm=False)
    for module in llm.engine.executor.worker.model.modules():
        if isinstance(module, DeepseekAttention):
            module.absorb_decode = False
    expanded = llm.generate(prompts, params, use_tqdm=False)
    for a, e in zip(absorbed, expanded):
        assert a.outputs[0].token_ids == e.outputs[0].token_ids
        assert abs(a.outputs[0].cumulative_logprob - e.outputs[0].cumulative_logprob) < 1e-4


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="ridge's CPU kernels need AVX-512 BF16")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_kv_b_proj_is_absorbed_in_block_formats(tmp_path, quantization):
    """kv_b_proj in a block format, on the CPU kernels: W_uv is kv_b_proj's own v rows, byte
    for byte; W_uk^T is int8 (Q8_0) blocks of kv_b_proj's values (its blocks run along r,
    W_uk^T's along nope), within Q8_0's rounding. The absorbed decode through them is the one
    through dense matrices of the same values within the int8 rounding of the activations."""
    from ridge import LLM, SamplingParams
    from ridge.layers.linear import ExpertLinear
    from ridge.quantization.formats import Q8_0

    from ..models.hf_tiny import COMMON, VARIANTS, save_spread

    nope, v, rank, rope = 32, 16, 64, 8
    config_cls, model_cls, extra = VARIANTS["deepseek-v2-lite"]
    widths = {"qk_nope_head_dim": nope, "v_head_dim": v, "kv_lora_rank": rank, "qk_rope_head_dim": rope}
    save_spread(model_cls, config_cls(**{**COMMON, **extra, **widths}), tmp_path, seed=3)
    llm = LLM(
        str(tmp_path), tokenizer="bytes", dtype="float32", device="cpu", num_kv_blocks=64, quantization=quantization
    )
    llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=4), use_tqdm=False)  # decodes absorbed
    model = llm.engine.executor.worker.model
    attention = model.model.layers[1].self_attn
    w_uk, w_uv = attention.absorbed
    assert isinstance(w_uk, ExpertLinear) and w_uk.method.format is Q8_0
    assert isinstance(w_uv, ExpertLinear) and w_uv.method.format is attention.kv_b_proj.method.format
    kv_b = attention.kv_b_proj
    own = kv_b.method.blocks_of(kv_b).view(H, nope + v, -1)[:, nope:].reshape(H * v, -1)
    assert torch.equal(w_uv.method.blocks_of(w_uv), own)
    values = kv_b.dense_weight().view(H, nope + v, rank)
    w_uk_t = values[:, :nope].transpose(1, 2).reshape(H * rank, nope)
    assert (w_uk.dense_weight() - w_uk_t).abs().max() <= w_uk_t.abs().max() / 127

    gen = torch.Generator().manual_seed(1)
    context = 11
    entries = torch.randn(context, 1, rank + rope, generator=gen)
    q_nope, q_rope = torch.randn(1, H, nope, generator=gen), torch.randn(1, H, rope, generator=gen)
    cache = kv_cache.allocate(
        KVCacheSpec(1, 1, rank + rope, keys_only=True), 8, BLOCK, torch.float32, torch.device("cpu")
    )[0]
    table = torch.tensor([5, 2, 7, 0])
    slots = table[torch.arange(context) // BLOCK] * BLOCK + torch.arange(context) % BLOCK
    cache.k.view(-1, rank + rope)[slots] = entries[:, 0]
    meta = AttentionMetadata(
        slot_mapping=slots[-1:],
        num_decode_tokens=1,
        decode_block_tables=table[None],
        decode_context_lens=torch.tensor([context]),
    )
    got = mla_attention(q_nope, q_rope, entries[-1:], cache, meta, (w_uk, w_uv), kv_b, 0.3, model.kernels)
    dense = (values[:, :nope].contiguous(), values[:, nope:].transpose(1, 2).contiguous())
    want = mla_attention(q_nope, q_rope, entries[-1:], cache, meta, dense, kv_b, 0.3, TorchKernels())
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
