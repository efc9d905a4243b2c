"""Block pool and KV manager: reference counts, LRU eviction of cached blocks, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ridge.kv.block_pool import BlockPool
from ridge.kv.manager import KVCacheManager, hash_block


class FakeRequest:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def test_pool_states_add_up_and_lru_evicts_oldest_cached():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"ha")
    pool.cache(b, b"hb")
    pool.release([b, a])  # b freed first -> evicted first
    assert pool.counts() == {"free": 2, "used": 0, "cached": 2, "total": 4}
    got = pool.allocate(3)  # two empty blocks, then the least recently freed cached one
    assert [blk.block_id for blk in got] == [2, 3, b.block_id]
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") is a
    pool.check_integrity()


def test_touch_revives_a_cached_block():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h")
    pool.release([a])
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.check_integrity()


def test_double_release_is_an_error():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(RuntimeError):
        pool.release([a])


def test_chained_hashes_depend_on_the_whole_prefix():
    h0 = hash_block(b"", [1, 2])
    assert hash_block(h0, [3, 4]) != hash_block(hash_block(b"", [9, 9]), [3, 4])
    assert hash_block(b"", [1, 2]) == h0


def test_manager_allocation_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = FakeRequest("a", range(12))
    assert kv.allocate_slots(a, 12)
    b = FakeRequest("b", range(100, 104))
    assert not kv.allocate_slots(b, 4)
    assert kv.block_table(b) == []
    kv.check_integrity()
    kv.free(a)
    assert kv.allocate_slots(b, 4)
    kv.check_integrity()


def test_manager_prefix_hits_after_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = FakeRequest("a", range(10))
    assert kv.allocate_slots(a, 10)
    table_a = kv.block_table(a)
    kv.free(a)
    b = FakeRequest("b", list(range(8)) + [50, 51, 52])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == table_a[:2]
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_table(b)[:2] == table_a[:2]
    kv.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 20), st.booleans()), min_size=1, max_size=40))
def test_random_alloc_free_keeps_integrity(ops):
    kv = KVCacheManager(num_blocks=10, block_size=4)
    live: dict[str, FakeRequest] = {}
    for i, (prefix, length, free_one) in enumerate(ops):
        if free_one and live:
            kv.free(live.pop(sorted(live)[0]))
        else:
            req = FakeRequest(f"r{i}", [prefix] * 4 + list(range(i * 100, i * 100 + length)))
            hits, n = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - n, hits):
                req.num_computed_tokens = req.num_tokens
                live[req.request_id] = req
        kv.check_integrity()
        counts = kv.pool.counts()
        assert counts["free"] + counts["used"] + counts["cached"] == counts["total"]
