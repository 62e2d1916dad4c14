"""KV cache manager: the blocks each request holds, prefix-cache lookups and caching.

Invariants:
- Only requests admitted by the scheduler (RUNNING) hold blocks; `free` returns all of them.
- `req_to_blocks[r][i]` holds the KV of token positions `[i*block_size, (i+1)*block_size)`.
- Blocks are registered in the prefix cache by `cache_blocks` only once *computed* (called
  after the model step), and only when every token of the block is known. So a block can be
  shared only from the step after it was written: the runner never has to order KV writes of
  one request before attention reads of another within a step.
- A lookup never covers the whole sequence: the last token is always recomputed (its logits
  are needed to sample).
"""
from __future__ import annotations

from tidal.core.block_pool import BlockPool, KVCacheBlock, update_block_hashes
from tidal.core.request import Request
from tidal.protocol.utils import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.block_size: int = block_size
        self.enable_caching: bool = enable_caching
        # Without caching, reuse the blocks freed last (their KV pages are resident already).
        self.block_pool: BlockPool = BlockPool(num_blocks, reuse_latest_first=not enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> number of its leading blocks already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Cumulative, in tokens, counted once per admission (not per failed attempt).
        self.prefix_cache_queries: int = 0
        self.prefix_cache_hits: int = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _lookup_allowed(self, request: Request) -> bool:
        # prompt_logprobs need logits at every prompt position: no position may be skipped.
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    # ------------------------------------------------------------------ prefix cache

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks: (block ids, number of tokens they cover).

        Pure (no ref counts taken, no stats): pass the result to `allocate_slots`.
        """
        if not self._lookup_allowed(request):
            return [], 0
        update_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        # The last token is always recomputed, so at most (num_tokens - 1) tokens can hit.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        pool = self.block_pool
        hit_ids: list[int] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_ids.append(block.block_id)
        return hit_ids, len(hit_ids) * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first `num_computed_tokens` tokens."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_full_blocks = min(num_computed_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_block.get(request_id, 0)
        if num_full_blocks <= start:
            return
        blocks = self.req_to_blocks[request_id]
        update_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        hashes = request.block_hashes
        pool = self.block_pool
        for i in range(start, num_full_blocks):
            pool.cache_block(blocks[i], hashes[i])
        self.num_cached_block[request_id] = num_full_blocks

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ alloc / free

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        `new_computed_blocks`/`num_new_computed_tokens` come from `get_computed_blocks` and
        are passed on admission only (a non-None value marks an admission for the stats).
        Returns the ids of the freshly allocated blocks (not the cache hits), or None when the
        pool cannot supply them; then nothing has changed.
        """
        if num_new_tokens <= 0 and not new_computed_blocks:
            return []
        pool = self.block_pool
        hit_blocks = [pool.blocks[i] for i in new_computed_blocks] if new_computed_blocks else []
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        num_held = len(req_blocks) if req_blocks is not None else 0

        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = cdiv(num_total_tokens, self.block_size) - num_held - len(hit_blocks)
        # Hit blocks that sit in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_blocks > pool.get_num_free_blocks() - num_evictable_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        if new_computed_blocks is not None and self._lookup_allowed(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        if hit_blocks:
            pool.touch(hit_blocks)
            req_blocks.extend(hit_blocks)
            self.num_cached_block[request_id] = len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head
        (a later request sharing the prefix hits the head)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
