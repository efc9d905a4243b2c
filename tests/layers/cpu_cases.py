"""The cases both CPU extensions' kernels run (``CpuKernels`` in test_cpu_kernels.py,
``Avx2Kernels`` in test_avx2_ops.py), each against torch's path (``TorchKernels``):

- MoE routing: the experts topk_route picks, best first, their weights within a bf16 rounding
  of its, a token's choice whatever its batch, the groups a config names checked first;
- prefill attention as each token's decode: within a rounding of scaled_dot_product_attention
  over the gathered context, a prompt in one chunk and in three the same bytes, each row the
  decode of that token, slots past the context (NaN here) never read;
- decode attention's jobs of several KV heads past a long context: each head's output the same
  bits as in a job of its own, whatever the batch, the threads or the grouping bound;
- structured output's token bitmask: what llguidance's own reading of the mask gives;
- where a kernel set keeps the weights it streams: memory that asks for 2 MiB pages
  (``asks_for_huge_pages``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ridge.kv.cache import PagedKV, quantize
from ridge.layers.attention import AttentionMetadata, PrefillChunk
from ridge.layers.kernels import TorchKernels

# Mixtral / Qwen3-MoE / a sigmoid router renormalized and scaled; widths with a tail that 8 and
# 16 lanes do not divide, and one under 8
GREEDY = pytest.mark.parametrize(
    "softmax,norm_topk,scaling,k_width",
    [(s, n, c, k) for s, n, c in [(True, False, 1.0), (True, True, 1.0), (False, True, 2.5)] for k in (64, 200, 13)],
)
# DeepSeek-V2's group_limited_greedy; V3's noaux_tc (sigmoid, bias); a bias without groups; one group kept
GROUPED = pytest.mark.parametrize(
    "softmax,n_group,topk_group,biased",
    [(True, 4, 2, False), (False, 8, 3, True), (False, 1, 1, True), (True, 4, 1, False)],
)


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of bf16 rounding at each element's magnitude."""
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-3) * 2**-8
    return ((a.float() - b.float()).abs() / scale).max().item()


def check_greedy(fast, softmax: bool, norm_topk: bool, scaling: float, k_width: int) -> None:
    experts, top_k = 24, 4
    x = _bf16(9, k_width, seed=11)
    router = torch.randn(experts, k_width, generator=torch.Generator().manual_seed(12)) * 0.2
    eps = 1e-20 if not softmax else 0.0
    want_ids, want_w = TorchKernels().route_topk(x, router, top_k, softmax, norm_topk, eps, scaling)
    got_ids, got_w = fast.route_topk(x, router, top_k, softmax, norm_topk, eps, scaling)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.bfloat16 and got_w.shape == (9, top_k)
    assert torch.equal(got_ids, want_ids)
    assert _ulps(got_w, want_w) <= 1
    alone_ids, alone_w = fast.route_topk(x[4:5], router, top_k, softmax, norm_topk, eps, scaling)
    assert torch.equal(alone_ids, got_ids[4:5]) and torch.equal(alone_w, got_w[4:5])


def check_grouped(fast, softmax: bool, n_group: int, topk_group: int, biased: bool) -> None:
    """Only the best groups' experts, chosen by the bias-corrected scores where there is a bias,
    weighted by the uncorrected ones."""
    experts, top_k, width = 32, 6 if topk_group > 1 else 4, 96
    x = _bf16(9, width, seed=21)
    router = torch.randn(experts, width, generator=torch.Generator().manual_seed(22)) * 0.3
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(23)) * 0.5 if biased else None
    args = (top_k, softmax, True, 0.0 if softmax else 1e-20, 2.5, n_group, topk_group, bias)
    want_ids, want_w = TorchKernels().route_topk(x, router, *args)
    got_ids, got_w = fast.route_topk(x, router, *args)
    assert torch.equal(got_ids, want_ids)
    assert _ulps(got_w, want_w) <= 1
    per = experts // n_group
    assert all(len({int(e) // per for e in row}) <= topk_group for row in got_ids)  # only kept groups' experts
    if biased:  # the bias moves the choice: without it some token picks differently
        plain_ids, _ = fast.route_topk(x, router, *args[:-1], None)
        assert not torch.equal(plain_ids, got_ids)
    alone_ids, alone_w = fast.route_topk(x[4:5], router, *args)
    assert torch.equal(alone_ids, got_ids[4:5]) and torch.equal(alone_w, got_w[4:5])


def check_refusals(fast) -> None:
    """Groups that do not divide the experts, a top_k past them, a router of another width: one
    clear error each; float32 rows go to topk_route's own ops."""
    x, router = _bf16(2, 32, seed=1), torch.randn(12, 32)
    with pytest.raises(RuntimeError, match="groups"):
        fast.route_topk(x, router, 2, True, False, 0.0, 1.0, 5, 2, None)
    with pytest.raises(RuntimeError, match="top_k must be in 1..12"):
        fast.ext.route_topk(x, router, 13, True, False, 0.0, 1.0, 1, 1, None)
    with pytest.raises(RuntimeError, match=r"\(T, K\) bf16 x and an \(E, K\) float32 or bf16 router"):
        fast.ext.route_topk(x, router[:, :16], 2, True, False, 0.0, 1.0, 1, 1, None)
    with pytest.raises(RuntimeError, match=r"float32 or bf16 router"):
        fast.ext.route_topk(x, router.half(), 2, True, False, 0.0, 1.0, 1, 1, None)
    xf, args = x.float(), (2, True, False, 0.0, 1.0)
    got, want = fast.route_topk(xf, router, *args), TorchKernels().route_topk(xf, router, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def check_bf16_router(fast) -> None:
    """A router whose values are all bf16 (Router.for_kernels stores it so) gives the kernel the
    same logits read from half the bytes: ids and weights equal to the float32 copy's bit for
    bit, greedy and grouped with a bias, any width (the vector loop and its tail), a token alone
    as in its batch."""
    for width, n_group, topk_group, bias_seed in [(96, 1, 1, None), (70, 4, 2, 23), (2048, 1, 1, None)]:
        x = _bf16(9, width, seed=31)
        router = (torch.randn(32, width, generator=torch.Generator().manual_seed(32)) * 0.3).bfloat16()
        bias = None if bias_seed is None else torch.randn(32, generator=torch.Generator().manual_seed(bias_seed))
        args = (4, bias is None, True, 0.0 if bias is None else 1e-20, 2.5, n_group, topk_group, bias)
        got_ids, got_w = fast.ext.route_topk(x, router, *args)  # the kernel itself, on the bf16 rows
        want_ids, want_w = fast.route_topk(x, router.float(), *args)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
        ref_ids, ref_w = TorchKernels().route_topk(x, router, *args)
        assert torch.equal(got_ids, ref_ids) and _ulps(got_w, ref_w) <= 1
        alone_ids, alone_w = fast.ext.route_topk(x[4:5], router, *args)
        assert torch.equal(alone_ids, got_ids[4:5]) and torch.equal(alone_w, got_w[4:5])


def check_prefill_as_decodes(fast, dtype: torch.dtype = torch.bfloat16, kind: str | None = None) -> None:
    """``kind``: an int8 or fp8 cache (the codes of the same K/V), else one of ``dtype``."""
    ctx, block_size, heads, kv_heads, dim = 45, 4, 8, 2, 64
    blocks = -(-ctx // block_size)
    gen = torch.Generator().manual_seed(7)
    k, v, q = (torch.randn(ctx, h, dim, generator=gen).to(dtype) for h in (kv_heads, kv_heads, heads))
    table = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:blocks]
    slots = (table.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(blocks))[:ctx]
    k_cache, v_cache = (torch.full((40, block_size, kv_heads, dim), float("nan"), dtype=dtype) for _ in range(2))
    k_cache.view(-1, kv_heads, dim)[slots], v_cache.view(-1, kv_heads, dim)[slots] = k, v
    cache = PagedKV(k_cache, v_cache)
    if kind is not None:
        (k8, ks), (v8, vs) = quantize(k_cache, kind), quantize(v_cache, kind)
        cache = PagedKV(k8, v8, ks, vs, kind)

    def chunked(ops, cuts):
        return torch.cat(
            [
                ops.prefill_attention(q[s:e], k[s:e], v[s:e], cache, PrefillChunk(s, e, e, table))
                for s, e in zip(cuts, cuts[1:])
            ]
        )

    whole = chunked(fast, [0, ctx])
    want = chunked(TorchKernels(), [0, ctx]).float()
    # an int8 cache: the kernels quantize the query to int8 per group too (outputs within 1%)
    tolerance = 0.01 if dtype is torch.bfloat16 or kind == "int8" else 1e-5
    assert (whole.float() - want).abs().max().item() <= tolerance * want.abs().max().item()
    assert torch.equal(chunked(fast, [0, 7, 30, ctx]), whole)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(3, dtype=torch.long),
        num_decode_tokens=3,
        decode_block_tables=table.expand(3, blocks),
        decode_context_lens=torch.tensor([1, 20, ctx]),
    )
    assert torch.equal(fast.decode_attention(q[[0, 19, ctx - 1]], cache, meta), whole[[0, 19, ctx - 1]])


# a cache of q's dtype, int8 or e4m3 codes
KV_KINDS = pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
# groups of 4 and 3 query heads a KV head (the PV passes' two ways of cutting them)
KV_GROUPS = pytest.mark.parametrize("heads,kv_heads,dim", [(16, 4, 64), (12, 4, 32)])


def _kv_cache_of(k: torch.Tensor, v: torch.Tensor, kind: str) -> PagedKV:
    if kind == "auto":
        return PagedKV(k, v)
    (kc, ks), (vc, vs) = quantize(k, kind), quantize(v, kind)
    return PagedKV(kc, vc, ks, vs, kind)


def check_kv_heads_read_together(
    fast, kind: str, heads: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Past a mean context of 1 MiB (kv_head_jobs, csrc/paged_rows.h) a job of the decode
    kernels (a cache of q's dtype or int8; fp8 keeps one head a job) takes several KV heads of a
    sequence, however many the batch and the threads leave it: each head's output is the same
    bits in any such job as in a job of its own, as the gathered torch path gives within its
    bounds, and never reads past its context."""
    from ridge.kv import cache as kv_cache

    block_size, mib = 16, 1 << 20
    row_bytes = dim * dtype.itemsize if kind == "auto" else dim + 2 * kv_cache.scale_groups(dim)  # codes, fp16 scales
    token_bytes = 2 * kv_heads * row_bytes  # K and V rows of every KV head
    # 2.25 and 2.5 MiB of K and V: grouped, alone too (on 2 threads a job of half the heads, which
    # pays past twice the bound); with three one-token sequences the batch's mean is short
    long = [mib // token_bytes * 9 // 4, mib // token_bytes * 5 // 2 + 5]
    lens = [*long, 1, 1, 1]
    assert min(long) * token_bytes > 2 * mib and (sum(long) + 3) * token_bytes <= 5 * mib
    width = -(-max(lens) // block_size)
    blocks = len(lens) * width
    dense = [_bf16(blocks, block_size, kv_heads, dim, seed=seed).to(dtype) for seed in (21, 22)]
    tables = torch.randperm(blocks, generator=torch.Generator().manual_seed(23)).view(len(lens), width)
    q = _bf16(len(lens), heads, dim, seed=24).to(dtype)

    def run(rows, cache, kernels=fast, q_dtype=dtype):
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(len(rows), dtype=torch.long),
            num_decode_tokens=len(rows),
            decode_block_tables=tables[rows],
            decode_context_lens=torch.tensor(lens)[rows],
        )
        return kernels.decode_attention(q[rows].to(q_dtype), cache, meta)

    cache = _kv_cache_of(*dense, kind)
    grouped = run([0, 1], cache)
    one_head_a_job = run([0, 1, 2, 3, 4], cache)[:2]
    assert torch.equal(grouped, one_head_a_job)
    for i in (0, 1):
        assert torch.equal(run([i], cache)[0], grouped[i])  # alone: more jobs a sequence on 2+ threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run([0, 1], cache), grouped)  # one job a sequence
    finally:
        torch.set_num_threads(threads)
    if kind == "auto":
        want = run([0, 1], cache, kernels=TorchKernels())
    else:  # the dequantized values through the gathered path (the int8 query adds its rounding)
        pairs = ((cache.k, cache.k_scale), (cache.v, cache.v_scale))
        values = [kv_cache.dequantize(codes, scales, kind, torch.float32) for codes, scales in pairs]
        want = run([0, 1], PagedKV(*values), kernels=TorchKernels(), q_dtype=torch.float32)
    assert (grouped.float() - want.float()).abs().max().item() <= 0.02 * want.float().abs().max().item()
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    for row, n in zip(tables[:2], long):
        written[(row.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(width))[:n]] = True
    poisoned = [d.clone() for d in dense]
    for d in poisoned:
        d.view(-1, kv_heads, dim)[~written] = float("nan")  # a quantized pool: NaN codes and scales there
    assert torch.equal(run([0, 1], _kv_cache_of(*poisoned, kind)), grouped)


def check_kv_grouping_bound(fast, kind: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """set_kv_grouped_bytes (what benchmarks/decode_attention.py alternates): 0 groups a job's
    KV heads at any context, a huge bound never; the same bits either way, and None gives the
    extension its own bound back (1 MiB, or never for the AVX-512 kernels on Zen 4)."""
    lens, block_size, heads, kv_heads, dim = [5, 40, 17], 4, 16, 4, 64
    width = max(-(-n // block_size) for n in lens)
    k, v = (_bf16(40, block_size, kv_heads, dim, seed=seed).to(dtype) for seed in (6, 7))
    tables = torch.randperm(40, generator=torch.Generator().manual_seed(8))[: len(lens) * width].view(len(lens), width)
    q = _bf16(len(lens), heads, dim, seed=9).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        num_decode_tokens=len(lens),
        decode_block_tables=tables,
        decode_context_lens=torch.tensor(lens),
    )
    cache, ext = _kv_cache_of(k, v, kind), fast.ext
    default = ext.kv_grouped_bytes()
    assert default == ext.kv_grouped_default() and default in (1 << 20, 1 << 62)
    outputs = []
    try:
        for bound in (0, 1 << 62, 1 << 20):
            ext.set_kv_grouped_bytes(bound)
            assert ext.kv_grouped_bytes() == bound
            outputs.append(fast.decode_attention(q, cache, meta))
        with pytest.raises(RuntimeError, match="byte count"):
            ext.set_kv_grouped_bytes(-1)
    finally:
        ext.set_kv_grouped_bytes(None)
    assert ext.kv_grouped_bytes() == default
    assert all(torch.equal(out, outputs[-1]) for out in outputs)
    if kind == "auto":  # grouped at these short contexts too, in runs cut short: torch's to rounding
        want = TorchKernels().decode_attention(q, cache, meta).float()
        assert (outputs[0].float() - want).abs().max().item() <= 0.02 * want.abs().max().item()


# a vocabulary of whole words, one with a partial last word, one past 4 x 32 (the tail disallowed)
BITMASK = pytest.mark.parametrize("vocab,words", [(100, 4), (96, 3), (130, 4)])


def check_token_bitmask(fast, dtype: torch.dtype, vocab: int, words: int) -> None:
    import llguidance.torch

    gen = torch.Generator().manual_seed(vocab)
    mask = torch.randint(-(2**31), 2**31, (5, words), dtype=torch.int32, generator=gen)
    mask[1] = -1  # every token allowed
    mask[2] = 0  # none
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    expected = logits.clone()
    llguidance.torch.apply_token_bitmask_inplace(expected, mask)  # the grammar engine's own reading
    for kernels in (TorchKernels(), fast):
        got = logits.clone()
        kernels.apply_token_bitmask_(got, mask)
        assert torch.equal(got, expected), kernels.name
    assert torch.isinf(expected[2]).all() and torch.equal(expected[1, : 32 * words], logits[1, : 32 * words])


def thp_mode() -> str:
    """The system's transparent huge page mode: always, madvise or never."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1 : text.index("]")]


def asks_for_huge_pages(t: torch.Tensor) -> bool:
    """Whether the mapping that holds t's first byte may take 2 MiB pages (smaps' THPeligible:
    memory that asked for them, where the mode is madvise). Whether the kernel then found free
    2 MiB pages for it depends on the machine's memory, not on ridge."""
    addr, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if not head.endswith(":"):  # a mapping's first line: start-end perms offset ...
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= addr < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return False
