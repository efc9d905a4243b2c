"""ridge's AVX-512 BF16 linear kernel against an fp32 reference (skipped without AVX-512 BF16)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ridge import SamplingParams
from ridge.kv.cache import PagedKV
from ridge.layers.cpu_kernels import cpu_has_avx512_bf16, load_extension, select_kernels
from ridge.layers.kernels import Avx2Kernels, CpuKernels, TorchKernels

from . import cpu_cases

pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16")


@pytest.fixture(scope="module")
def kernel():
    return load_extension()  # compiled once per machine (setup does it), then cached on disk


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 64, 130])
@pytest.mark.parametrize("k,n", [(64, 112), (100, 37), (2048, 96), (31, 8), (64, 200)])
def test_matches_fp32_reference_within_one_bf16_rounding(kernel, m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    packed = kernel.pack_vnni(w)
    assert torch.equal(kernel.unpack_vnni(packed, n, k), w)
    for bias in (b, None):
        got = kernel.linear_bf16(x, packed, n, bias)
        want = ref if bias is not None else F.linear(x.float(), w.float())
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # one rounding of the fp32 sum to bf16: relative error <= 2^-8
        assert torch.allclose(got.float(), want, rtol=2**-8, atol=1e-3 * want.abs().max().item())


def test_keeps_leading_dimensions(kernel):
    x = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    assert kernel.linear_bf16(x, kernel.pack_vnni(w), 16, None).shape == (2, 3, 16)


def test_packed_weights_are_carved_from_shared_slabs_and_outlive_each_other(kernel):
    """Packed weights lie one after another in slabs of huge pages (linear_bf16.cpp's
    WeightArena), 4 KiB aligned, not each rounded up to whole 2 MiB pages; each keeps its slab
    alive, so freeing the others leaves its bytes (and results) in place."""
    gen = torch.Generator().manual_seed(7)
    ws = [torch.randn(48, 1040, generator=gen).bfloat16() for _ in range(3)]  # 99,840 bytes each
    packed = [kernel.pack_vnni(w) for w in ws]
    gaps = [b.data_ptr() - a.data_ptr() for a, b in zip(packed, packed[1:])]
    assert 102400 in gaps  # the next 4 KiB after 99,840 bytes (one pair may straddle two slabs)
    x = torch.randn(3, 1040, generator=gen).bfloat16()
    want = F.linear(x.float(), ws[2].float())
    last = packed.pop()
    del packed
    for _ in range(3):  # more carved after the others were freed (and their pages given back)
        kernel.pack_vnni(torch.ones(48, 1040).bfloat16())
    got = kernel.linear_bf16(x, last, 48, None)
    assert torch.allclose(got.float(), want, rtol=2**-8, atol=1e-3 * want.abs().max().item())


def test_a_freed_packed_weight_gives_its_pages_back_while_its_slab_lives(kernel):
    """A weight's whole 2 MiB pages go back to the system when it is freed, though a weight
    carved after it keeps the slab alive."""

    def resident_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    w = torch.randn(2048, 2048).bfloat16()  # 8 MiB packed
    big = kernel.pack_vnni(w)
    small = kernel.pack_vnni(w[:48])  # 192 KiB, carved after it (the same slab, or a new one)
    before = resident_bytes()
    del big
    assert before - resident_bytes() >= 4 << 20  # at least the pages wholly inside it
    assert torch.equal(kernel.unpack_vnni(small, 48, 2048), w[:48])


def test_prepare_packs_linears_frees_dense_copies_but_keeps_a_tied_embedding(kernel, tmp_path):
    from ridge import LLM

    from ..models.hf_tiny import build

    build("llama-tied-llama3-rope", tmp_path)
    fast = LLM(str(tmp_path), tokenizer="bytes", dtype="bfloat16", num_kv_blocks=8, device="cpu")
    ref = LLM(str(tmp_path), tokenizer="bytes", dtype="bfloat16", num_kv_blocks=8, kernels="torch", device="cpu")
    model, ref_model = fast.engine.executor.worker.model, ref.engine.executor.worker.model
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.packed is not None and layer.weight.numel() == 0  # the dense copy is freed
    assert torch.equal(layer.dense_weight(), ref_model.model.layers[0].self_attn.qkv_proj.weight)
    assert model.lm_head.packed is not None  # tied: packed, but the shared embedding stays
    assert torch.equal(model.model.embed_tokens.weight, ref_model.model.embed_tokens.weight)
    prompt = [5, 9, 200, 17, 3]
    lp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    a = fast.generate([prompt], lp, use_tqdm=False)[0].outputs[0]
    b = ref.generate([prompt], lp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and abs(a.cumulative_logprob - b.cumulative_logprob) < 0.05


def test_a_build_lock_is_waited_for_and_a_dead_one_removed(tmp_path, capsys):
    """A live build's lock (its directory still being written) is waited for, saying so, until
    it goes; a lock whose directory has not been written for the stale time (a killed build,
    which cpp_extension would wait on forever) is removed at once. Never a silent hang."""
    import os
    import threading
    import time

    from ridge.layers.cpu_kernels import _wait_for_build_lock

    lock, obj = tmp_path / "lock", tmp_path / "linear_quant.o"
    _wait_for_build_lock(tmp_path, sys.stderr)  # no lock: returns at once
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))  # an old lock, but the build still writes its objects

    def build() -> None:
        for _ in range(6):
            obj.touch()
            time.sleep(0.1)
        lock.unlink()

    obj.touch()
    worker = threading.Thread(target=build)
    worker.start()
    _wait_for_build_lock(tmp_path, sys.stderr, stale_s=0.5, poll_s=0.05, quiet_s=0.0)
    worker.join()
    err = capsys.readouterr().err
    assert "waiting for another process's build" in err and "removed" not in err

    lock.touch()  # a moment's wait (another load's no-op check) says nothing
    threading.Timer(0.2, lock.unlink).start()
    _wait_for_build_lock(tmp_path, sys.stderr, stale_s=60.0, poll_s=0.05, quiet_s=30.0)
    assert capsys.readouterr().err == ""

    lock.touch()
    for f in (lock, obj):
        os.utime(f, (old, old))
    start = time.monotonic()
    _wait_for_build_lock(tmp_path, sys.stderr, stale_s=0.5, poll_s=0.05)
    assert time.monotonic() - start < 0.5 and not lock.exists()
    assert "removed a build lock" in capsys.readouterr().err


def test_a_build_counts_as_built_only_for_this_checkout_and_torch(tmp_path, monkeypatch):
    """cpp_extension rebuilds (minutes, which ridge announces) where its build file names
    another checkout's sources or another environment's torch headers: such a build is not
    taken as this one's, nor one older than a source."""
    import os

    from torch.utils.cpp_extension import include_paths

    from ridge.layers import cpu_kernels

    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))
    build = cpu_kernels.extension_build_dir()
    build.mkdir(parents=True)
    assert not cpu_kernels.extension_is_built()

    def recipe(csrc: str, torch_include: str) -> None:
        lines = [f"cflags = -isystem {torch_include} -O3"]
        lines += [f"build {name[:-4]}.o: compile {csrc}/{name}" for name in cpu_kernels.SOURCES]
        (build / "build.ninja").write_text("\n".join(lines) + "\n")
        (build / f"{cpu_kernels.EXTENSION_NAME}.so").touch()

    recipe(str(cpu_kernels.CSRC_DIR), include_paths()[0])
    assert cpu_kernels.extension_is_built()
    recipe("/elsewhere/ridge/layers/csrc", include_paths()[0])  # another checkout
    assert not cpu_kernels.extension_is_built()
    recipe(str(cpu_kernels.CSRC_DIR), "/other/venv/torch/include")  # another environment's torch
    assert not cpu_kernels.extension_is_built()
    recipe(str(cpu_kernels.CSRC_DIR), include_paths()[0])
    os.utime(build / f"{cpu_kernels.EXTENSION_NAME}.so", (0, 0))  # older than the sources
    assert not cpu_kernels.extension_is_built()


def test_select_kernels_choices():
    cpu = torch.device("cpu")
    assert type(select_kernels("torch", cpu, torch.bfloat16)) is TorchKernels
    assert type(select_kernels("auto", cpu, torch.float16)) is TorchKernels
    assert isinstance(select_kernels("auto", cpu, torch.bfloat16), CpuKernels)
    assert isinstance(select_kernels("auto", cpu, torch.float32), CpuKernels)
    with pytest.raises(ValueError, match="bfloat16 or float32 on CPU"):
        select_kernels("ridge", cpu, torch.float16)
    # avx2: the AVX2 kernels on this AVX-512 CPU too (what a CPU without AVX-512 runs)
    assert isinstance(select_kernels("avx2", cpu, torch.bfloat16), Avx2Kernels)
    with pytest.raises(ValueError, match="kernels='avx2' runs bfloat16 or float32 on CPU only"):
        select_kernels("avx2", cpu, torch.float16)


# -- the fused decode ops against the torch reference path, in bf16 --------------------------


@pytest.fixture(scope="module")
def pair(kernel):
    return TorchKernels(), CpuKernels(kernel)


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of bf16 rounding at each element's magnitude."""
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-3) * 2**-8
    return ((a.float() - b.float()).abs() / scale).max().item()


def test_rms_norm_and_fused_add(pair):
    ref, fast = pair
    x, w, delta = _bf16(5, 192, seed=1), _bf16(192, seed=2), _bf16(5, 192, seed=3)
    assert _ulps(fast.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)) <= 2
    r1, r2 = x.clone(), x.clone()
    y_ref, y_fast = ref.add_rms_norm(delta, r1, w, 1e-5), fast.add_rms_norm(delta, r2, w, 1e-5)
    assert torch.equal(r1, r2)  # the residual add rounds the same way
    assert _ulps(y_fast, y_ref) <= 2


@pytest.mark.parametrize("head_dim", [64, 80, 128, 24])  # 80 and 24: a half that 16 lanes do not divide
def test_rope_in_place_equals_torch(pair, head_dim):
    from ridge.layers.rotary import RotaryEmbedding

    ref, fast = pair
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    positions = torch.tensor([0, 7, 300, 511])
    qkv = _bf16(4, 6 * head_dim + 64, seed=4) * 8
    view = qkv[:, : 6 * head_dim].view(4, 6, head_dim)  # strided rows, like q|k inside the packed qkv
    want = ref.rope(view, ref.rope_state(rotary, positions, torch.bfloat16))
    got = fast.rope(view, fast.rope_state(rotary, positions, torch.bfloat16))
    assert got.data_ptr() == view.data_ptr()  # in place
    assert torch.equal(got, want)


def test_silu_mul(pair):
    ref, fast = pair
    gate_up = _bf16(3, 2 * 100, seed=5) * 4
    assert _ulps(fast.silu_mul(gate_up), ref.silu_mul(gate_up)) <= 1


@cpu_cases.GREEDY
def test_greedy_routing_picks_what_torch_picks(pair, softmax, norm_topk, scaling, k_width):
    cpu_cases.check_greedy(pair[1], softmax, norm_topk, scaling, k_width)


@cpu_cases.GROUPED
def test_grouped_routing_picks_what_torch_picks(pair, softmax, n_group, topk_group, biased):
    cpu_cases.check_grouped(pair[1], softmax, n_group, topk_group, biased)


def test_routing_refuses_what_it_does_not_take(pair):
    cpu_cases.check_refusals(pair[1])


def test_a_bf16_router_routes_as_its_float32_copy(pair):
    cpu_cases.check_bf16_router(pair[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@cpu_cases.BITMASK
def test_token_bitmask_matches_llguidance_and_the_torch_path(pair, dtype, vocab, words):
    cpu_cases.check_token_bitmask(pair[1], dtype, vocab, words)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 37, 32000])  # shorter than a vector, one, a tail, TinyLlama's
def test_argmax_picks_what_torch_picks(pair, dtype, vocab):
    """Greedy sampling's argmax: torch's index in every row, ties (the first of equal maxima,
    in a vector's lanes, across vectors and in the tail), NaNs (the first NaN), infinities,
    a row of -inf."""
    ref, fast = pair
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen).to(dtype)
    last = vocab - 1
    logits[1, :] = 0.0  # all tied: index 0
    logits[2, [last, last // 2]] = 9.0  # a tie between the tail (or a later lane) and an earlier index
    logits[3, last] = float("inf")
    logits[4, :] = float("-inf")
    logits[5, [last // 3, last]] = float("nan")  # the first NaN wins over anything
    logits[6, last] = float("nan")  # a NaN in the tail only
    logits[7, 0] = float("nan")
    logits[8, [last // 2, last]] = float("inf")  # tied infinities
    logits[9, min(17, last)] = 50.0  # a maximum in a later lane of a later vector
    logits[10, :: max(1, vocab // 5)] = 3.0  # several maxima spread over vectors
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(ref.argmax(logits), expected)
    got = fast.argmax(logits)
    assert got.dtype is torch.long and torch.equal(got, expected), (got, expected)
    assert torch.equal(fast.argmax(logits[2:3]), expected[2:3])  # a row alone: the same index


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 8), (torch.float32, 64), (torch.bfloat16, 24)])
@pytest.mark.parametrize("lens", [[1], [5, 40, 17]])
def test_portable_decode_attention_any_head_size(pair, lens, dtype, dim):
    """The portable kernel (any head size; float32 or bfloat16) against the gathered torch path."""
    from ridge.layers.attention import AttentionMetadata, decode_valid_mask

    ref, fast = pair
    block_size, heads, kv_heads = 4, 6, 2
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(40, block_size, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    width = max(-(-n // block_size) for n in lens)
    tables = torch.randperm(40, generator=gen)[: len(lens) * width].view(len(lens), width)
    context = torch.tensor(lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        num_decode_tokens=len(lens),
        decode_block_tables=tables,
        decode_context_lens=context,
        decode_mask=decode_valid_mask(context, width * block_size),
    )
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    got = fast.decode_attention(q, PagedKV(k_cache, v_cache), meta)
    want = ref.decode_attention(q, PagedKV(k_cache, v_cache), meta)
    tol = 1e-5 if dtype is torch.float32 else 0.02
    assert (
        got.dtype == dtype and (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
    )


def _paged_case(lens: list[int], dim: int, block_size: int = 4, heads: int = 8, kv_heads: int = 2):
    """bf16 pools of 40 blocks, sequences of ``lens`` tokens over scattered blocks, queries, and
    a function building fresh decode metadata (a kernel may cache state in it)."""
    from ridge.layers.attention import AttentionMetadata, decode_valid_mask

    k_cache, v_cache = _bf16(40, block_size, kv_heads, dim, seed=6), _bf16(40, block_size, kv_heads, dim, seed=7)
    width = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(8))  # scattered blocks
    tables = perm[: len(lens) * width].view(len(lens), width)
    context = torch.tensor(lens)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(len(lens), dtype=torch.long),
            num_decode_tokens=len(lens),
            decode_block_tables=tables,
            decode_context_lens=context,
            decode_mask=decode_valid_mask(context, width * block_size),
        )

    return k_cache, v_cache, tables, _bf16(len(lens), heads, dim, seed=9), meta


@pytest.mark.parametrize("lens", [[1], [5, 40, 17], [64, 3]])
@pytest.mark.parametrize("dim", [16, 48, 64, 128])  # K rows of 8 and 24 dim pairs: a part of a 16-pair column
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (16, 2), (8, 1)])  # groups of 4, 8 and 8 heads (V's two paths)
def test_paged_decode_attention_reads_the_pool_like_the_gathered_path(pair, lens, dim, heads, kv_heads):
    ref, fast = pair
    k_cache, v_cache, _, q, meta = _paged_case(lens, dim=dim, heads=heads, kv_heads=kv_heads)
    got = fast.decode_attention(q, PagedKV(k_cache, v_cache), meta())
    want = ref.decode_attention(q, PagedKV(k_cache, v_cache), meta())
    assert (got.float() - want.float()).abs().max().item() <= 0.02 * want.float().abs().max().item()


@cpu_cases.KV_KINDS
@cpu_cases.KV_GROUPS
def test_long_contexts_read_a_jobs_kv_heads_together_with_the_same_results(pair, kind, heads, kv_heads, dim):
    """A job of several KV heads past a long mean context (cpu_cases.py)."""
    cpu_cases.check_kv_heads_read_together(pair[1], kind, heads, kv_heads, dim)


@cpu_cases.KV_KINDS
def test_the_kv_grouping_bound_is_a_setting_that_never_changes_a_result(pair, kind):
    """set_kv_grouped_bytes (cpu_cases.py)."""
    cpu_cases.check_kv_grouping_bound(pair[1], kind)


def test_a_build_at_first_use_says_what_it_is_doing(monkeypatch):
    """The first run compiled silently for ~2 minutes and looked hung."""
    import io
    import time as time_module

    import torch.utils.cpp_extension

    from ridge.layers import cpu_kernels

    def slow_load(**kwargs):
        time_module.sleep(0.2)
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", slow_load)
    monkeypatch.setattr(cpu_kernels, "PROGRESS_EVERY_S", 0.05)
    monkeypatch.setattr(cpu_kernels, "extension_is_built", lambda spec=None: False)
    monkeypatch.setattr(cpu_kernels, "_LOADED", None)  # as in a fresh process
    out = io.StringIO()
    assert cpu_kernels.load_extension(progress=out) == "module"
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("ridge: compiling the CPU kernels") and "still compiling" in lines[1]
    assert lines[-1].startswith("ridge: the CPU kernels compiled in")
    monkeypatch.setattr(cpu_kernels, "extension_is_built", lambda spec=None: True)
    monkeypatch.setattr(cpu_kernels, "_LOADED", None)
    quiet = io.StringIO()
    cpu_kernels.load_extension(progress=quiet)
    assert quiet.getvalue() == ""  # a cached build only loads


def test_a_process_loads_the_extension_once(kernel, tmp_path, monkeypatch):
    """Another $RIDGE_CACHE_DIR later in the process (a test's, a probe's) neither compiles a
    second copy nor loads one (pybind11 could not register the DecodePlan class twice)."""
    from ridge.layers import cpu_kernels

    first = cpu_kernels.load_extension()
    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))
    assert cpu_kernels.load_extension() is first
    assert not (tmp_path / "extensions").exists()


@pytest.mark.parametrize("dim", [64, 24])  # the AVX-512 bf16 kernel (16k head sizes) and the portable one
def test_decode_attention_never_reads_slots_past_a_context(pair, dim):
    """The pool is not zero-filled: NaN in every slot no sequence wrote changes nothing."""
    lens, block_size, kv_heads = [5, 40, 17], 4, 2
    k_cache, v_cache, tables, q, meta = _paged_case(lens, dim, block_size=block_size, kv_heads=kv_heads)
    width = tables.shape[1]
    written = torch.zeros(40 * block_size, dtype=torch.bool)
    for row, n in zip(tables, lens):
        slots = row.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(width)
        written[slots[:n]] = True
    for kernels in pair:
        clean = kernels.decode_attention(q, PagedKV(k_cache, v_cache), meta())
        poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
        for cache in (poisoned_k, poisoned_v):
            cache.view(-1, kv_heads, dim)[~written] = float("nan")
        assert torch.equal(kernels.decode_attention(q, PagedKV(poisoned_k, poisoned_v), meta()), clean), kernels.name


def _shared_kv_case(lens: list[int], heads: int, dim: int, block_size: int = 16):
    """MLA's decode: one bf16 pool that is both K and V (one KV head), ``heads`` queries on it."""
    pool = _bf16(60, block_size, 1, dim, seed=11)
    width = max(-(-n // block_size) for n in lens)
    tables = torch.randperm(60, generator=torch.Generator().manual_seed(12))[: len(lens) * width].view(len(lens), width)

    def meta(rows=None):
        from ridge.layers.attention import AttentionMetadata

        rows = list(range(len(lens))) if rows is None else rows
        return AttentionMetadata(
            slot_mapping=torch.zeros(len(rows), dtype=torch.long),
            num_decode_tokens=len(rows),
            decode_block_tables=tables[rows],
            decode_context_lens=torch.tensor(lens)[rows],
        )

    return pool, tables, _bf16(len(lens), heads, dim, seed=13), meta


@pytest.mark.parametrize(
    "lens,heads,dim,value_dim,block_size",
    [
        ([1], 16, 40, 32, 16),
        ([5, 300, 17], 16, 40, 32, 16),
        ([129, 2], 20, 72, 64, 16),
        ([700], 32, 288, 256, 16),
        ([130, 17], 16, 40, 32, 5),  # chunks of 128 tokens start inside a block
    ],
)
def test_shared_kv_decode_attention_matches_the_gathered_path(pair, lens, heads, dim, value_dim, block_size):
    """Many heads on one KV head (MLA's latent, 16+ heads): heads in lanes, contexts split in
    chunks over the threads; against the torch path within bf16 rounding, the first
    ``value_dim`` dims of each value only; 20 heads leave lanes of a second vector empty."""
    ref, fast = pair
    pool, _, q, meta = _shared_kv_case(lens, heads, dim, block_size)
    cache = PagedKV(pool, pool)
    got = fast.decode_attention(q, cache, meta(), 0.2, value_dim)
    want = ref.decode_attention(q, cache, meta(), 0.2, value_dim).float()
    assert got.shape == (len(lens), heads, value_dim)
    assert (got.float() - want).abs().max().item() <= 0.02 * want.abs().max().item()


def test_shared_kv_decode_attention_is_batch_invariant_and_reads_only_the_context(pair):
    """A sequence's output alone equals its output beside others (chunks never mix sequences),
    and NaN in every slot no sequence wrote changes nothing."""
    _, fast = pair
    lens, block_size = [300, 7, 129], 16
    pool, tables, q, meta = _shared_kv_case(lens, 16, 40, block_size)
    whole = fast.decode_attention(q, PagedKV(pool, pool), meta(), 0.2, 32)
    for i in range(len(lens)):
        assert torch.equal(fast.decode_attention(q[[i]], PagedKV(pool, pool), meta([i]), 0.2, 32), whole[[i]])
    written = torch.zeros(60 * block_size, dtype=torch.bool)
    for row, n in zip(tables, lens):
        slots = row.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(tables.shape[1])
        written[slots[:n]] = True
    poisoned = pool.clone()
    poisoned.view(-1, 40)[~written] = float("nan")
    assert torch.equal(fast.decode_attention(q, PagedKV(poisoned, poisoned), meta(), 0.2, 32), whole)


@pytest.mark.parametrize("rows,heads,k,n", [(1, 16, 64, 256), (3, 5, 40, 48), (9, 2, 256, 64)])
def test_head_matmul_is_bmm_per_head(pair, rows, heads, k, n):
    """MLA's absorbed W_uk / W_uv^T: one matrix per head, against torch.bmm within one bf16
    rounding; strided x (a view into q) is read as it lies."""
    ref, fast = pair
    x = _bf16(heads, rows, k + 8, seed=14)[..., 4 : k + 4].transpose(0, 1)  # (rows, H, K), not contiguous
    w = _bf16(heads, k, n, seed=15)
    got, want = fast.head_matmul(x, w), ref.head_matmul(x, w)
    assert got.shape == want.shape == (rows, heads, n)
    assert (got.float() - want.float()).abs().max().item() <= 0.01 * want.float().abs().max().item()


@pytest.mark.parametrize("kind", [None, "int8"])
def test_prefill_attention_is_each_tokens_decode_whatever_the_chunking(pair, kind):
    """bf16 prefill runs each query as a decode over the context up to it (cpu_cases.py)."""
    cpu_cases.check_prefill_as_decodes(pair[1], torch.bfloat16, kind)


@pytest.mark.parametrize("k", [64, 2048, 31])
def test_a_rows_output_does_not_depend_on_its_batch(kernel, k):
    # batch invariance: the same row among 2, 20 (streaming tiles) or 100 (prefill tiles) gives
    # bit-identical outputs; alone (M = 1) too, except on AMX machines, where one row runs the
    # AVX-512 kernel and several the AMX one: the two accumulate a pair's products with
    # different rounding in rare cases (measured: 0.03% of outputs, by one bf16 rounding)
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(400, k, generator=gen).bfloat16()
    packed = kernel.pack_vnni(w)
    x = torch.randn(100, k, generator=gen).bfloat16()
    pairs = torch.cat([kernel.linear_bf16(x[i : i + 2], packed, 400, None)[:1] for i in range(100)])
    alone = torch.cat([kernel.linear_bf16(x[i : i + 1], packed, 400, None) for i in range(100)])
    for m in (2, 3, 7, 20, 64, 100):
        assert torch.equal(kernel.linear_bf16(x[:m], packed, 400, None), pairs[:m])
    if kernel.linear_bf16_uses_amx(k):
        differ = alone != pairs
        assert differ.float().mean() < 0.005
        # one bf16 rounding of the output, plus fp32 accumulation noise for outputs near zero
        torch.testing.assert_close(alone.float(), pairs.float(), rtol=2.0**-7, atol=1e-3)
    else:
        assert torch.equal(alone, pairs)


@pytest.mark.parametrize("env,want", [({}, True), ({"MALLOC_TRIM_THRESHOLD_": "131072"}, False)])
def test_freed_memory_is_kept_unless_the_user_set_malloc(env, want):
    # glibc (this project's Linux) takes the thresholds; a user's MALLOC_* setting wins
    code = "from ridge.layers.cpu_kernels import keep_freed_memory\nprint(keep_freed_memory())\n"
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(want)]
