"""GGUF files load as they are: the F32 stories260K file computes what the HF directory
computes; Q8_0/Q4_0/Q4_1 files (written here with llama.cpp's quantizer code) compute what
transformers computes on the same dequantized weights; K-quants convert as llama.cpp
dequantizes them; bad files fail with one clear error."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import transformers

from ridge import LLM, SamplingParams
from ridge.layers.cpu_kernels import cpu_has_avx2, cpu_has_avx512_bf16
from ridge.layers.kernels import AVX2_PACKED_FORMATS
from ridge.models.gguf_file import GGUFModel, widest
from ridge.quantization.formats import FORMATS, FORMATS_BY_GGML_TYPE

from .hf_tiny import COMMON, save_spread
from .test_parity import _record_logits

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from ridge.quantization.random_blocks import random_blocks  # noqa: E402

from .gguf_files import llama_cpp_greedy, quantize_any, quantized, rewrite  # noqa: E402


@pytest.fixture(scope="session")
def stories_gguf(stories_dir):
    path = stories_dir.parent / "stories260K-gguf" / "stories260K.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return path


def _logits(llm: LLM, prompts, steps=6):
    seen = _record_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, torch.stack(seen[o.request_id])) for o in outs]


def _story_prompts(llm: LLM):
    return [llm.engine.tokenizer.encode(t) for t in ("Once upon a time", "The cat sat", "Lily and Ben went")]


def test_f32_gguf_equals_the_hf_directory(stories_gguf, stories_dir):
    a = LLM(str(stories_gguf), num_kv_blocks=64, device="cpu")
    b = LLM(str(stories_dir), num_kv_blocks=64, device="cpu")
    assert a.engine.dtype == torch.float32
    prompts = _story_prompts(b)
    # (a text that starts with a space: test_gguf_tokenizer_spaces_text_as_sentencepiece_does)
    for text in ("Once upon a time", "Hello   world\n\nÜber 日本 "):
        assert a.engine.tokenizer.encode(text) == b.engine.tokenizer.encode(text)
    for (ta, la), (tb, lb) in zip(_logits(a, prompts), _logits(b, prompts)):
        assert ta == tb and (la - lb).abs().max().item() <= 1e-4
    p = SamplingParams(temperature=0, max_tokens=40)
    text = a.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].text
    assert text == b.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].text


def test_gguf_tokenizer_spaces_text_as_sentencepiece_does(stories_gguf, stories_dir, tmp_path):
    """A SentencePiece ("llama") vocabulary in a GGUF file tokenizes as sentencepiece does on
    the model's own tokenizer.model, and as llama.cpp does (a space before each text: " leading
    space" starts with a lone U+2581), whatever the installed transformers builds (5.17 and
    5.24 build it differently); decoding gives the text back. Without add_space_prefix no
    space is added."""
    import sentencepiece

    from ridge.engine.tokenizer import load_gguf_tokenizer

    sp = sentencepiece.SentencePieceProcessor(model_file=str(stories_dir / "tokenizer.model"))
    tok = load_gguf_tokenizer(stories_gguf)
    texts = [" leading space", "  two", "Once upon a time", "Hello   world\n\nÜber 日本 ", "end ", ""]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text
    assert tok.encode(" leading space", add_special_tokens=False)[0] == sp.piece_to_id("\u2581")
    bare = rewrite(
        stories_gguf, tmp_path / "bare.gguf", lambda n, v: None, bools={"tokenizer.ggml.add_space_prefix": False}
    )
    tok = load_gguf_tokenizer(bare)
    assert tok.encode(" Once", add_special_tokens=False) == sp.encode("Once")  # the space is the text's own
    assert tok.encode("Once", add_special_tokens=False) != sp.encode("Once")
    assert tok.decode(tok.encode(" leading", add_special_tokens=False)) == " leading"


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_gguf_tokenizer_adds_bos_as_the_file_says(stories_gguf, tmp_path, add_bos):
    """llama.cpp's rule, whatever the installed transformers does: the file's add_bos_token,
    else bos for a SentencePiece ("llama") vocabulary."""
    from ridge.engine.tokenizer import load_gguf_tokenizer

    path = stories_gguf
    if add_bos is not None:
        path = rewrite(
            stories_gguf, tmp_path / "bos.gguf", lambda n, v: None, bools={"tokenizer.ggml.add_bos_token": add_bos}
        )
    tok = load_gguf_tokenizer(path)
    bare = tok.encode("Once upon a time", add_special_tokens=False)
    assert bare[0] != tok.bos_token_id
    expected = [tok.bos_token_id, *bare] if add_bos is not False else bare
    assert tok.encode("Once upon a time") == expected


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.IQ4_NL], ids=lambda t: t.name)
def test_quantized_gguf_matches_transformers_on_its_dequantized_weights(stories_gguf, stories_dir, tmp_path, qtype):
    path = quantized(stories_gguf, tmp_path / f"stories-{qtype.name}.gguf", qtype)
    llm = LLM(str(path), num_kv_blocks=64, kernels="torch", device="cpu")
    layer = llm.engine.executor.worker.model.model.layers[0].self_attn.qkv_proj
    assert layer.method.format.ggml_type == qtype  # loaded as they are, not requantized
    assert llm.engine.executor.worker.model.model.layers[0].mlp.down_proj.method.format is None  # K = 172 stayed F32

    hf = transformers.LlamaForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(hf.model.embed_tokens.weight.clone())  # the file's own output.weight
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.shape[1] % 32 == 0:
                w = module.weight.detach().numpy()
                module.weight.copy_(torch.from_numpy(dequantize(quantize_any(w, qtype), qtype)))
    prompts = _story_prompts(llm)
    for prompt, (tokens, logits) in zip(prompts, _logits(llm, prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens])).logits[0][len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        assert (logits - ref).abs().max().item() <= 1e-4
        assert tokens == ref.argmax(-1).tolist()


def test_weights_by_format_counts_the_matrices_a_decode_step_reads(stories_gguf, tmp_path):
    """Each matrix under the format ridge holds it in: stories' Q8_0 file keeps ffn_down (K =
    172) in F32, which loads dense; the token embedding counts only where the lm_head is tied."""
    path = quantized(stories_gguf, tmp_path / "stories-Q8_0.gguf", T.Q8_0)
    model = GGUFModel(path)
    cfg = model.hf_config
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    blocks = layers * (2 * h * h + 2 * kv * h + 2 * inter * h) + vocab * h  # q, o, k, v, gate, up; lm_head
    assert model.weights_by_format() == {"int8": blocks, "bf16": layers * h * inter}
    assert GGUFModel(stories_gguf).weights_by_format() == {"bf16": blocks + layers * h * inter}
    tied = rewrite(stories_gguf, tmp_path / "tied.gguf", lambda name, v: "drop" if name == "output.weight" else None)
    tied_model = GGUFModel(tied)
    assert "lm_head.weight" not in tied_model.tensors
    assert tied_model.weights_by_format() == {"bf16": blocks + layers * h * inter}  # the embedding is the lm_head


@pytest.mark.parametrize("qtype", [T.Q8_0, T.IQ4_NL], ids=lambda t: t.name)
def test_quantized_gguf_runs_on_the_cpu_kernels(stories_gguf, tmp_path, qtype):
    path = quantized(stories_gguf, tmp_path / f"stories-{qtype.name}.gguf", qtype)
    llm = LLM(str(path), num_kv_blocks=64, device="cpu")
    layer = llm.engine.executor.worker.model.model.layers[0].self_attn.qkv_proj
    assert layer.method.format.ggml_type == qtype and _native(layer)  # the file's bytes, on the kernels
    text = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert text[0].outputs[0].text.startswith(", there was a little girl named Lily.")


def _native(layer) -> bool:
    """Whether the layer's matmul reads the file's bytes on ridge's CPU kernels: repacked at
    load by the AVX-512 ones; by the AVX2 ones (csrc/avx2_blocks.cpp) repacked at their size
    for AVX2_PACKED_FORMATS (blocks of 8 rows, where the rows are a multiple of 8), as
    loaded for the others."""
    if cpu_has_avx512_bf16():
        return layer.packed is not None
    if not cpu_has_avx2():
        return False
    if layer.method.format.name in AVX2_PACKED_FORMATS and layer.out_features % 8 == 0:
        return (
            layer.packed is not None
            and layer.packed.numel() == layer.method.format.row_bytes(layer.in_features) * layer.out_features
        )
    return layer.packed is None and layer.blocks.numel() > 0


# -- K-quants: random blocks (finite fp16 scales) against gguf's dequantize ----------------


def _random_blocks(qtype, rows: int, k: int, seed: int) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    scales = rng.uniform(-0.02, 0.02, size=(rows, k // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:  # d is the last 2 bytes
        data[..., -2:] = scales[..., 0:2]
    else:  # d, dmin first
        data[..., 0:4] = scales.reshape(rows, k // block, 4)
    return data.reshape(rows, -1)


def test_a_q4_k_m_style_file_keeps_each_tensors_format(tmp_path, caplog):
    """A tiny Llama with K = 256 (what K-quants need) and Llama 3 RoPE (a rope_freqs tensor),
    exported by ridge's GGUF writer; then q/k/o in Q4_K and v in Q6_K (a Q4_K_M file's mix)."""
    from ridge.models.export import write_gguf

    config = transformers.LlamaConfig(
        **{
            **COMMON,
            "hidden_size": 256,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        }
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    dense = write_gguf(tmp_path / "hf", hf.config.to_dict(), tmp_path / "dense.gguf")

    # the dense export computes what transformers computes (q/k un-permuted, rope_freqs applied)
    llm = LLM(str(dense), tokenizer="bytes", dtype="float32", num_kv_blocks=16, device="cpu")
    prompt = list(range(3, 40))
    ((tokens, logits),) = _logits(llm, [prompt])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0][len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    assert (logits - ref).abs().max().item() <= 1e-3  # the export rounds matrices to bf16

    def fn(name, values):
        if name.endswith(("attn_q.weight", "attn_k.weight", "attn_output.weight")):
            return _random_blocks(T.Q4_K, values.shape[0], values.shape[1], seed=len(name)), T.Q4_K
        if name.endswith("attn_v.weight"):
            return _random_blocks(T.Q6_K, values.shape[0], values.shape[1], seed=3), T.Q6_K
        return None

    mixed = rewrite(dense, tmp_path / "mixed.gguf", fn)
    with caplog.at_level(logging.INFO, logger="ridge"):
        llm = LLM(str(mixed), tokenizer="bytes", num_kv_blocks=16, device="cpu")
    layer0 = llm.engine.executor.worker.model.model.layers[0]
    qkv = layer0.self_attn.qkv_proj
    # each shard as the file holds it: q and k one Q4_K part, v (Q6_K) another
    assert qkv.method.name == "q4_k+q4_k+q6_k" and [p.method.name for p in qkv.parts] == ["q4_k", "q6_k"]
    assert [p.out_features for p in qkv.parts] == [256 + 128, 128] and all(_native(p) for p in qkv.parts)
    assert qkv.weight_nbytes() == sum(p.weight_nbytes() for p in qkv.parts) == (256 + 128) * 144 + 128 * 210
    assert layer0.self_attn.o_proj.method.format.name == "q4_k"  # as the file holds it
    assert _native(layer0.self_attn.o_proj)  # on the CPU kernels (AVX-512: regrouped at load)
    assert layer0.mlp.gate_up_proj.method.format is None  # bf16 in the file, no --quantization
    model = GGUFModel(mixed)
    o_ref = dequantize(model.tensors["model.layers.0.self_attn.o_proj.weight"].data, T.Q4_K)
    o_got = layer0.self_attn.o_proj.dense_weight().float().numpy()
    assert np.array_equal(o_got, o_ref)  # the file's bytes, read back from the kernels' layout
    v_ref = dequantize(model.tensors["model.layers.0.self_attn.v_proj.weight"].data, T.Q6_K)
    v_got = layer0.self_attn.qkv_proj.dense_weight()[256 + 128 :].float().numpy()
    assert np.array_equal(v_got, v_ref)  # Q6_K's bytes too
    log = caplog.text
    assert "Q4_K -> " not in log  # q and k keep their format beside v's
    assert "Q6_K -> " not in log
    llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)  # runs


@pytest.mark.parametrize(
    "qtype,mixed",
    [
        (T.Q4_K, False),
        (T.Q5_K, False),
        (T.Q6_K, False),
        (T.IQ4_XS, False),
        (T.Q3_K, False),
        (T.Q2_K, False),
        (T.Q4_K, True),
    ],
    ids=["Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q3_K", "Q2_K", "mix"],
)
def test_a_k_quant_file_computes_what_transformers_computes_on_its_weights(tmp_path, qtype, mixed):
    """Every linear weight in one super-block format (K = 256): ridge reads the blocks as they
    are; the torch path equals transformers on the dequantized weights, the CPU kernels stay
    within int8 activations. ``mixed``: v and down in Q8_0 (where a Q4_K_M file has Q6_K), so
    qkv keeps two formats side by side."""
    from ridge.models.export import write_gguf

    config = transformers.LlamaConfig(
        **{**COMMON, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
    )
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    dense = write_gguf(tmp_path / "hf", hf.config.to_dict(), tmp_path / "dense.gguf")
    linear = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

    def type_of(name):
        return T.Q8_0 if mixed and name.rsplit(".", 2)[-2] in ("attn_v", "ffn_down") else qtype

    def fn(name, values):
        if name.rsplit(".", 2)[-2] in linear:
            fmt = next(f for f in FORMATS.values() if f.ggml_type == type_of(name))
            return random_blocks(fmt, values.shape[0], values.shape[1], seed=len(name)).numpy(), fmt.ggml_type
        return None

    path = rewrite(dense, tmp_path / f"{qtype.name}.gguf", fn)
    model = GGUFModel(path)
    with torch.no_grad():  # transformers on the file's weights, dequantized by gguf
        for name, module in hf.named_modules():
            tensor = model.tensors.get(f"{name}.weight")
            if isinstance(module, torch.nn.Linear) and tensor is not None and tensor.type_name != "F32":
                values = dequantize(tensor.data, T[tensor.type_name])
                module.weight.copy_(torch.from_numpy(values).reshape(module.weight.shape))
                if name.endswith(("q_proj", "k_proj")):  # the file holds them permuted for llama.cpp's RoPE
                    module.weight.copy_(model.tensors[f"{name}.weight"].dense())
    prompt = list(range(3, 30))
    ref_llm = LLM(str(path), tokenizer="bytes", dtype="float32", num_kv_blocks=16, kernels="torch", device="cpu")
    layer = ref_llm.engine.executor.worker.model.model.layers[0]
    assert layer.mlp.gate_up_proj.method.format.ggml_type == qtype
    qkv_formats = [layer.self_attn.qkv_proj.method.shard_format(i).ggml_type for i in range(3)]
    assert qkv_formats == [qtype, qtype, T.Q8_0 if mixed else qtype]
    ((tokens, logits),) = _logits(ref_llm, [prompt])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0][len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    assert (logits - ref).abs().max().item() <= 1e-4
    fast = LLM(str(path), tokenizer="bytes", dtype="float32", num_kv_blocks=16, device="cpu")
    fast_layer = fast.engine.executor.worker.model.model.layers[0]
    assert _native(fast_layer.mlp.gate_up_proj)
    assert all(_native(p) for p in fast_layer.self_attn.qkv_proj.parts or [fast_layer.self_attn.qkv_proj])
    ((fast_tokens, fast_logits),) = _logits(fast, [prompt])
    # the first step's logits (later ones follow each run's own tokens); activations quantized to
    # int8 per 32 in every matmul of 2 layers (the kernel's own bound: tests/layers/test_quant_kernels.py).
    # Where a value lands on the int8 grid is chaotic: the AVX2 kernels' prefill attention (each
    # query as a decode, within 1e-5 of torch's) took IQ4_XS from under 6% to 6.02% (2-core Zen 3)
    assert (fast_logits[0] - logits[0]).abs().max().item() <= 0.07 * logits[0].abs().max().item()


@pytest.mark.parametrize(
    "types",
    [
        {"": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q5_K, "ffn_down": T.Q5_K},
        {"": T.Q2_K, "attn_v": T.Q3_K, "attn_output": T.Q3_K, "ffn_down": T.Q3_K},
    ],
    ids=["Q4_K_M-like", "Q2_K-like"],
)
def test_a_k_quant_file_serves_batched_prefix_cached_and_preempted(tmp_path, types):
    """Mixes of every native K-quant as llama.cpp's Q4_K_M and Q2_K files mix them (q/k/gate/up
    in the file's type, v, o and down wider), on the CPU kernels: requests sharing a prefix,
    served together in chunks from the prefix cache, give each one's tokens alone; a pool too
    small for them preempts and still finishes every request and frees every block."""
    from ridge.models.export import write_gguf

    config = transformers.LlamaConfig(
        **{**COMMON, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
    )
    torch.manual_seed(2)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    dense = write_gguf(tmp_path / "hf", hf.config.to_dict(), tmp_path / "dense.gguf")

    def fn(name, values):
        kind = name.rsplit(".", 2)[-2]
        if kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            fmt = next(f for f in FORMATS.values() if f.ggml_type == types.get(kind, types[""]))
            return random_blocks(fmt, values.shape[0], values.shape[1], seed=len(name)).numpy(), fmt.ggml_type
        return None

    path = str(rewrite(dense, tmp_path / "mix.gguf", fn))
    shared = list(range(3, 43))  # 40 tokens every prompt starts with
    prompts = [shared + list(range(50 + i, 50 + i + 3 * i + 1)) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    options = {"tokenizer": "bytes", "dtype": "float32", "block_size": 4, "device": "cpu"}
    served = LLM(path, num_kv_blocks=256, max_num_batched_tokens=24, **options)
    layer = served.engine.executor.worker.model.model.layers[0]
    names = {kind: FORMATS_BY_GGML_TYPE[t].name for kind, t in types.items()}
    assert [p.method.name for p in layer.self_attn.qkv_proj.parts] == [names[""], names["attn_v"]]
    assert layer.mlp.down_proj.method.name == names["ffn_down"] and _native(layer.mlp.down_proj)
    served.generate(prompts[:1], params, use_tqdm=False)  # the shared prefix now cached
    together = served.generate(prompts, params, use_tqdm=False)
    assert served.engine.kv.prefix_hits >= 6 * 40  # each prompt's shared blocks came from the cache
    alone = LLM(path, num_kv_blocks=256, enable_prefix_caching=False, **options)
    for prompt, out in zip(prompts, together):
        assert out.outputs[0].token_ids == alone.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    crowded = LLM(path, num_kv_blocks=24, max_num_batched_tokens=24, enable_prefix_caching=False, **options)
    outs = crowded.generate(prompts, params, use_tqdm=False)
    assert crowded.engine.scheduler.num_preemptions > 0
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    assert crowded.engine.kv.pool.counts()["used"] == 0


# -- bad files ----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_five_bit_fallback_types_load_as_int8(stories_gguf, tmp_path, qtype):
    """llama.cpp's Q4_K_M falls back to Q5_0 / Q5_1 where K is not a multiple of 256 (stories: 64)."""
    path = quantized(stories_gguf, tmp_path / f"{qtype.name}.gguf", qtype)
    llm = LLM(str(path), num_kv_blocks=32, kernels="torch", device="cpu")
    layer = llm.engine.executor.worker.model.model.layers[0].self_attn.o_proj
    assert layer.method.format.name == "int8"
    ref = dequantize(GGUFModel(path).tensors["model.layers.0.self_attn.o_proj.weight"].data, qtype)
    amax = np.abs(ref.reshape(ref.shape[0], -1, 32)).max(-1).repeat(32, -1)
    assert (np.abs(layer.dense_weight().numpy() - ref) <= amax / 254 + amax / 1024 + 1e-7).all()


def test_truncated_or_corrupt_files_are_one_clear_error(stories_gguf, tmp_path):
    data = stories_gguf.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    (tmp_path / "magic.gguf").write_bytes(b"XXXX" + data[4:])
    (tmp_path / "empty.gguf").write_bytes(b"")
    for name in ("cut.gguf", "magic.gguf", "empty.gguf"):
        with pytest.raises(ValueError, match=name):
            LLM(str(tmp_path / name))
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))


def test_unsupported_types_and_architectures_name_what_is_supported(stories_gguf, tmp_path):
    def iq2_xxs(name, values):  # stories' K = 64 holds no 256-weight block: only the type is read
        if name.endswith("attn_q.weight"):
            return np.zeros((values.shape[0], 66), dtype=np.uint8), T.IQ2_XXS
        return None

    path = rewrite(stories_gguf, tmp_path / "iq2_xxs.gguf", iq2_xxs)
    with pytest.raises(ValueError, match="type IQ2_XXS, which ridge does not run; supported: F32, BF16, F16, Q8_0"):
        LLM(str(path))
    path = rewrite(stories_gguf, tmp_path / "gpt2.gguf", lambda n, v: None, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported; ridge runs GGUF files of llama"):
        LLM(str(path))


def test_cli_reports_a_bad_gguf_in_one_line(tmp_path, capsys):
    from ridge.cli import main

    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    assert main(["generate", "--model", str(tmp_path / "bad.gguf"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.gguf is not a readable GGUF file" in err[0]


def test_a_packed_layer_takes_the_widest_format_ridge_can_requantize_into():
    int8, int4, int4_asym, iq4_nl = (FORMATS[n] for n in ("int8", "int4", "int4_asym", "iq4_nl"))
    assert widest([int4, int4_asym]) is int4_asym
    assert widest([iq4_nl, iq4_nl]) is iq4_nl  # kept as the file holds it
    assert widest([iq4_nl, int4]) is int8  # ridge does not produce IQ4_NL: Q4_0's shard could not join it
    assert widest([iq4_nl, None]) is None


# -- llama.cpp on its own quantizations (where llama-cpp-python is installed) -------------------


@pytest.mark.parametrize("ftype", ["Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS", "Q3_K_M", "Q2_K"])
def test_llama_cpp_decodes_what_ridge_ranks_first_on_its_k_quant_files(tmp_path, ftype):
    """A tiny Llama with K in 256s, exported in f32 and quantized by llama.cpp's own
    llama_model_quantize (each file type's mix of K-quants, IQ4_XS and Q8_0 / Q5_0 fallbacks),
    read by ridge at the file's size on its CPU kernels. Along llama.cpp's 12 greedy tokens,
    each is ridge's top token at 10 steps or more, and never more than 0.15 nats below it: the
    two engines' int8 activations (per 32 in ridge, per 256 in llama.cpp) part only near-ties
    of this random model, whose next-token entropy is ~5 nats (a misread tensor costs nats)."""
    lc = pytest.importorskip("llama_cpp")
    import ctypes

    from ridge.models.export import write_gguf

    config = transformers.LlamaConfig(
        **{**COMMON, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 320}
    )
    save_spread(transformers.LlamaForCausalLM, config, tmp_path / "hf", seed=7)
    dense = write_gguf(tmp_path / "hf", config.to_dict(), tmp_path / "f32.gguf")
    path = tmp_path / f"{ftype}.gguf"
    lc.llama_backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    assert lc.llama_model_quantize(str(dense).encode(), str(path).encode(), ctypes.byref(params)) == 0
    prompt = [5, 6, 7, 8, 9, 40, 41, 250]
    theirs = llama_cpp_greedy(path, prompt, 12)
    llm = LLM(str(path), tokenizer="bytes", dtype="float32", num_kv_blocks=32, device="cpu")
    native = {t.type_name for t in GGUFModel(path).tensors.values()}
    layer = llm.engine.executor.worker.model.model.layers[1]
    held = {p.method.format.ggml_name for p in (layer.self_attn.qkv_proj.parts or [layer.self_attn.qkv_proj])}
    assert held <= native and held - {"Q8_0"}  # the file's K-quants (or IQ4_XS), held as they are
    logprobs = llm.engine.score(prompt + theirs)[len(prompt) - 1 :]
    below = torch.stack([logprobs[i].max() - logprobs[i][t] for i, t in enumerate(theirs)])
    assert (below == 0).sum().item() >= 10 and below.max().item() <= 0.15
