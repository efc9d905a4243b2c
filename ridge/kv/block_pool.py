"""The pool of KV blocks: reference counts, an LRU free queue, and the prefix-cache map.

Every block is in exactly one of three states:

    used    ref_cnt > 0                      held by one or more running requests
    cached  ref_cnt == 0 and has a hash      free, but its contents can still be reused
    free    ref_cnt == 0 and no hash         free and empty

Cached and free blocks both sit in the free queue, least recently freed first; taking a
block from the queue evicts its hash. ``check_integrity`` asserts that the states add up.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-and-evictable)."""
        return len(self._free_queue)

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` blocks from the head of the free queue, evicting their cached contents."""
        if count > len(self._free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free_queue)} free")
        out = []
        for _ in range(count):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on (possibly cached, unreferenced) blocks: a prefix-cache hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop a reference; a block nobody holds joins the tail of the free queue (kept cached)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = None

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Register a full block's contents; the first block with given contents wins."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def counts(self) -> dict[str, int]:
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        free = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is None)
        return {"free": free, "used": used, "cached": cached, "total": self.num_blocks}

    def check_integrity(self) -> None:
        """free + used + cached == total, and the queue and hash map agree with the blocks."""
        c = self.counts()
        assert c["free"] + c["used"] + c["cached"] == c["total"], c
        unreferenced = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert set(self._free_queue) == unreferenced, "free queue differs from the unreferenced blocks"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative reference count"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"hash map points at block {block.block_id} with another hash"
        assert len(self._cached) == sum(1 for b in self.blocks if b.block_hash is not None)
