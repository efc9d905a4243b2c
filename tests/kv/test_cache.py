"""kv/cache.py's pools in host memory: 2 MiB pages, the same values and results, freed with their tensors."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from ridge.kv import cache as kv_cache
from ridge.kv.cache import HUGE_PAGE, KVCacheSpec, PagedKV
from ridge.layers.attention import AttentionMetadata
from ridge.layers.cpu_kernels import select_kernels
from tests.layers.cpu_cases import asks_for_huge_pages, thp_mode

CPU = torch.device("cpu")


def _mapped(addr: int) -> bool:
    """Whether addr lies in one of this process's mappings."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(a, 16) for a in line.split()[0].split("-"))
        if start <= addr < end:
            return True
    return False


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_host_pools_sit_in_their_own_2mib_aligned_mappings_that_ask_for_huge_pages(kind):
    spec = KVCacheSpec(num_layers=2, num_heads=4, head_dim=64)
    caches = kv_cache.allocate(spec, 512, 16, torch.bfloat16, CPU, kind)  # 4 MiB of bf16 a pool
    pools = [t for c in caches for t in (c.k, c.v)]
    assert len({t.data_ptr() for t in pools}) == len(pools)
    for t in pools:
        assert t.shape == (512, 16, 4, 64) and t.is_contiguous()
        assert t.dtype == (torch.bfloat16 if kind == "auto" else torch.int8)
        assert t.data_ptr() % HUGE_PAGE == 0
        if thp_mode() != "never":
            assert asks_for_huge_pages(t)
    if kind == "int8":  # the scales (128 KiB each here): torch's memory, as any small pool
        assert caches[0].k_scale.shape == (512, 16, 4, 2) and caches[0].k_scale.dtype == torch.float16
        if thp_mode() == "madvise":
            assert not asks_for_huge_pages(caches[0].k_scale)


def test_a_pool_under_one_huge_page_is_torchs_own_allocation():
    (cache,) = kv_cache.allocate(KVCacheSpec(1, 2, 16), 8, 16, torch.float32, CPU)
    assert cache.k.shape == (8, 16, 2, 16)
    if thp_mode() == "madvise":
        assert not asks_for_huge_pages(cache.k)


def test_a_pools_mapping_goes_with_its_last_tensor():
    (cache,) = kv_cache.allocate(KVCacheSpec(1, 4, 64), 512, 16, torch.bfloat16, CPU)
    addr = cache.k.data_ptr()
    view = cache.k[3:5]  # a view keeps the mapping
    del cache
    gc.collect()
    assert _mapped(addr)
    view.fill_(1.0)
    del view
    gc.collect()
    assert not _mapped(addr)


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_decode_attention_reads_the_same_values_from_either_memory(kind):
    """The kernels see a pool in the new mapping as they saw torch's: same values, same bits out."""
    gen = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(num_layers=1, num_heads=4, head_dim=64)
    (cache,) = kv_cache.allocate(spec, 512, 16, torch.bfloat16, CPU, kind)
    for t in (cache.k, cache.v):
        if kind == "auto":
            t.copy_(torch.randn(t.shape, generator=gen))
        else:
            t.copy_(torch.randint(-127, 128, t.shape, generator=gen))
    if kind == "int8":
        cache.k_scale.copy_(torch.rand(cache.k_scale.shape, generator=gen) * 0.02 + 0.001)
        cache.v_scale.copy_(torch.rand(cache.v_scale.shape, generator=gen) * 0.02 + 0.001)
    plain = PagedKV(*(t.clone() if isinstance(t, torch.Tensor) else t for t in cache))
    lens = [700, 33, 1]
    tables = torch.randperm(512, generator=gen)[: 3 * 44].view(3, 44)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(3, dtype=torch.long),
        num_decode_tokens=3,
        decode_block_tables=tables,
        decode_context_lens=torch.tensor(lens),
    )
    q = torch.randn(3, 32, 64, generator=gen).bfloat16()
    kernels = select_kernels("ridge", CPU, torch.bfloat16)
    assert torch.equal(kernels.decode_attention(q, cache, meta), kernels.decode_attention(q, plain, meta))
