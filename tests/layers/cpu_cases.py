"""The cases both CPU extensions' kernels run (``CpuKernels`` in test_cpu_kernels.py,
``Avx2Kernels`` in test_avx2_ops.py), each against torch's path (``TorchKernels``):

- MoE routing: the experts topk_route picks, best first, their weights within a bf16 rounding
  of its, a token's choice whatever its batch, the groups a config names checked first;
- prefill attention as each token's decode: within a rounding of scaled_dot_product_attention
  over the gathered context, a prompt in one chunk and in three the same bytes, each row the
  decode of that token, slots past the context (NaN here) never read;
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
    with pytest.raises(RuntimeError, match=r"\(T, K\) bf16 x and an \(E, K\) float32 router"):
        fast.ext.route_topk(x, router[:, :16], 2, True, False, 0.0, 1.0, 1, 1, None)
    xf, args = x.float(), (2, True, False, 0.0, 1.0)
    got, want = fast.route_topk(xf, router, *args), TorchKernels().route_topk(xf, router, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


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
