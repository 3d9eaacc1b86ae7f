"""A fixed pool of KV blocks: O(1) free list in LRU order, reference counts, and a prefix cache of full
blocks keyed by a chained hash of (parent hash, token ids)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

BlockKey = tuple[int | None, tuple[int, ...]]


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash: a block's identity depends on every token before it."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    """Owns block ids `0..num_blocks-1`. A block with `ref_cnt == 0` sits in the free list; if it holds a
    cached prefix it stays findable by hash until it is reused (evicted, least recently freed first)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        # dict keeps insertion order: front = least recently freed, popped first.
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_key: list[BlockKey | None] = [None] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (evictable cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id = next(iter(self._free))
            del self._free[block_id]
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks that are shared (prefix hits, forked siblings)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching zero go to the back of the free list."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise RuntimeError(f"KV block {block_id} released more often than it was taken")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        """A cached block with this hash, if its contents really match (guards against collisions)."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self._block_key[block_id] != key:
            return None
        return block_id

    def cache(self, block_id: int, block_hash: int, key: BlockKey) -> None:
        if not self.enable_caching or self._block_hash[block_id] is not None or block_hash in self._cached:
            return
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        self._block_key[block_id] = key

    def is_evictable(self, block_id: int) -> bool:
        return self.ref_cnt[block_id] == 0

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._block_hash[block_id] = None
            self._block_key[block_id] = None
