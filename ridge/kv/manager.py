"""The KV-cache manager: the only thing the scheduler knows about memory.

Contract (what a request must offer): ``request_id``, ``all_token_ids`` (prompt + output),
``num_tokens``, ``num_computed_tokens``, and ``block_hashes`` (a list this manager fills).

    get_computed_blocks(req) -> (blocks, num_tokens)   prefix-cache hits for a new request
    allocate_slots(req, n, hits) -> bool               room for n more tokens, or False
    trim(req, num_tokens)                              return blocks past num_tokens' need
    free(req)                                          drop the request's references
    block_table(req) -> list[int]                      logical block i -> physical block id

Prefix caching: a full block is named by a hash of its tokens chained to the hash of the
block before it, so equal hashes mean equal prefixes, not just equal blocks:

    tokens:  [t0 .. t15][t16 .. t31][t32 ..
    hashes:      h0 = H(-, t0..15)   h1 = H(h0, t16..31)   ...
"""

from __future__ import annotations

import hashlib
from array import array

from ridge.kv.block_pool import Block, BlockPool


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[Block]] = {}
        # Kept beside the blocks so a step reads them without rebuilding: each request's
        # block ids (its block table) and how many of its leading blocks are hashed.
        self._req_table: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}
        # Prefix-cache statistics, in tokens: what new requests asked for and what was found.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- prefix cache -------------------------------------------------------------------
    def _update_hashes(self, req) -> list[bytes]:
        bs, tokens, hashes = self.block_size, req.all_token_ids, req.block_hashes
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else b""
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, req) -> tuple[list[Block], int]:
        """The longest cached prefix of a request that holds no blocks yet.

        At least one token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (failed admissions retry and must not count)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(
        self, req, num_new_tokens: int, new_computed_blocks: list[Block] = (), cache: bool = True
    ) -> bool:
        """Make room for ``num_new_tokens`` after the request's computed tokens (and cache hits).

        Returns False, changing nothing, when the pool cannot supply the blocks. ``cache=False``:
        the blocks' contents come later (a KV transfer), so they join the prefix cache only
        when the request's next allocation finds them full.
        """
        rid = req.request_id
        blocks = self._req_blocks.get(rid)
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total_tokens = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        if blocks and not new_computed_blocks and total_tokens <= len(blocks) * self.block_size:
            # The usual decode step: the last block has room.
            if self.enable_prefix_caching and total_tokens // self.block_size > self._num_hashed[rid]:
                self._cache_full_blocks(req, blocks, total_tokens)
            return True
        if blocks is None:
            blocks = self._req_blocks[rid] = []
            self._req_table[rid] = []
            self._num_hashed[rid] = 0
        needed = -(-total_tokens // self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hits that sit unreferenced in the free queue stop being available once taken.
        hits_in_queue = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(needed, 0) > self.pool.num_free_blocks - hits_in_queue:
            if not blocks:
                self._forget(rid)
            return False
        self.pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        self._req_table[rid].extend(b.block_id for b in blocks[len(self._req_table[rid]) :])
        if self.enable_prefix_caching and cache:
            self._cache_full_blocks(req, blocks, total_tokens)
        return True

    def _cache_full_blocks(self, req, blocks: list[Block], num_tokens: int) -> None:
        # Blocks full once this step's tokens are written can be shared from now on: the
        # step runs before any other request could read them.
        hashes = self._update_hashes(req)
        first = self._num_hashed[req.request_id]
        last = min(num_tokens // self.block_size, len(hashes))
        for i in range(first, last):
            if blocks[i].block_hash is None:
                self.pool.cache(blocks[i], hashes[i])
        self._num_hashed[req.request_id] = max(first, last)

    def trim(self, req, num_tokens: int) -> None:
        """Return the blocks past those ``num_tokens`` tokens need (taken for proposed tokens
        that were rejected). They were never hashed: only accepted tokens fill hashed blocks."""
        rid = req.request_id
        blocks = self._req_blocks.get(rid)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        del self._req_table[rid][keep:]
        self._num_hashed[rid] = min(self._num_hashed[rid], keep)
        self.pool.release(list(reversed(extra)))

    def _forget(self, request_id: str) -> list[Block]:
        self._req_table.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        return self._req_blocks.pop(request_id, [])

    def free(self, req) -> None:
        """Release the request's blocks, tail first, so a prefix outlives its suffix in the LRU."""
        blocks = self._forget(req.request_id)
        self.pool.release(list(reversed(blocks)))

    def block_table(self, req) -> list[int]:
        """The request's physical block ids, in order: kept up to date, read-only for callers."""
        return self._req_table.get(req.request_id, [])

    # -- state --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for rid, blocks in self._req_blocks.items():
            assert self._req_table[rid] == [b.block_id for b in blocks], f"request {rid}: block table out of date"
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs.get(block.block_id, 0)} requests"
            )
