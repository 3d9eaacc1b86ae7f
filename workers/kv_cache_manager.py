"""Maps requests to KV blocks: on-demand growth, prefix-cache hits, sharing between siblings, freeing."""

from __future__ import annotations

from workers.block_pool import BlockPool, hash_block
from workers.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block bookkeeping for the scheduler; the cache tensors themselves live in the model runner."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._hashes: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Chained hashes of the request's first `num_full_blocks` blocks, extended incrementally."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest cached prefix of the request, in whole blocks. The last token is always left to
        compute, since its logits are needed. None for a request that skips reading the cache."""
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return []
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._block_hashes(request, max_blocks)
        blocks: list[int] = []
        parent = None
        tokens = request.all_token_ids
        for i, h in enumerate(hashes[:max_blocks]):
            block_id = self.pool.lookup(h, (parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if block_id is None:
                break
            blocks.append(block_id)
            parent = h
        return blocks

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (plus any prefix
        hits in `computed_blocks`, which must start the block table). False if the pool is too small."""
        if not computed_blocks and request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * \
                self.block_size:
            return True  # its blocks hold them already (a decode, most steps): nothing to change
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, needed - len(request.block_ids) - len(computed_blocks))
        num_revived = sum(1 for b in computed_blocks if self.pool.is_evictable(b))
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
            if self.enable_prefix_caching and len(request.block_ids) == len(computed_blocks):
                # prefix hits and a sibling's blocks are in the cache already, under these tokens' hashes
                self._num_published[request.request_id] = len(computed_blocks)
        if num_new_blocks:
            request.block_ids.extend(self.pool.allocate(num_new_blocks))
        return True

    def shareable_prefix(self, child: Request, parent: Request) -> list[int]:
        """The parent's computed full blocks that `child` (same prompt) can take by reference, leaving
        the last prompt token to compute. Pass them to `allocate_slots` as computed blocks."""
        num_blocks = (child.num_tokens - 1) // self.block_size
        num_blocks = min(num_blocks, parent.num_computed_tokens // self.block_size, len(parent.block_ids))
        return parent.block_ids[:num_blocks]

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full, computed blocks to the prefix cache. After every call (and once a
        request is allocated its prefix hits) its published blocks are all its full computed ones, so a
        caller that advanced a request by one token within a block may skip the call (the scheduler does)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_ids))
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        tokens = request.all_token_ids
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else None
            self.pool.cache(request.block_ids[i], hashes[i], (parent, tuple(tokens[i * bs:(i + 1) * bs])))
        self._num_published[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a shared prefix outlives its suffix in the LRU."""
        self.pool.release(reversed(request.block_ids))
        request.block_ids = []
        self._hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
