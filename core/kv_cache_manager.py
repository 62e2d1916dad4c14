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
- Sliding window W (every layer of the model slides, see tidal.protocol.sliding_window): a
  query at position p reads keys (p - W, p] only, so before computing from position c a request
  needs no block wholly before c - W + 1. Such blocks go back to the pool (still cached, so
  still hittable until evicted) and their place in `req_to_blocks` holds `SKIPPED`, so index i
  still means positions [i*block_size, ...); the worker sees block id 0 there and its attention
  never reads (or writes) those positions. A prefix hit then needs only the blocks of the last
  window before the hit point (vLLM's SlidingWindowManager).
"""
from __future__ import annotations

from tidal.core.block_pool import BlockPool, KVCacheBlock, update_block_hashes
from tidal.core.request import Request
from tidal.protocol.sizing import cdiv

# Placeholder for a position whose block was released behind the sliding window; no pool
# block (never ref-counted, never cached). The worker gets WORKER_SKIPPED_ID in its place.
SKIPPED_ID = -1  # its id in get_computed_blocks' result
SKIPPED = KVCacheBlock(SKIPPED_ID)
WORKER_SKIPPED_ID = 0  # any valid id: the worker's range checks pass, its kernels never read it


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}.")
        self.block_size: int = block_size
        self.enable_caching: bool = enable_caching
        self.sliding_window: int | None = sliding_window  # None: every position stays needed
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
        """The request's block table as the worker gets it (WORKER_SKIPPED_ID where skipped)."""
        return [WORKER_SKIPPED_ID if b is SKIPPED else b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def held_block_ids(self, request_id: str) -> list[int]:
        """The pool blocks the request holds (skipped positions left out)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ()) if b is not SKIPPED]

    def _first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block the next query (at num_computed_tokens) reads."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

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
        if self.sliding_window is not None:
            return self._sliding_window_hit(request, max_hit_blocks)
        hit_ids: list[int] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_ids.append(block.block_id)
        return hit_ids, len(hit_ids) * self.block_size

    def _sliding_window_hit(self, request: Request, max_hit_blocks: int) -> tuple[list[int], int]:
        """The longest hit of n blocks whose blocks from _first_needed_block(n * block_size) on
        are all cached (earlier ones may be evicted: SKIPPED_ID in the result). A hash names
        its whole prefix, so a cached block is valid wherever the blocks before it went."""
        pool = self.block_pool
        cached: list[int | None] = []  # block id per hash, None when not cached
        best = 0
        run_start = 0  # first index of the current run of cached blocks
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = pool.get_cached_block(block_hash)
            cached.append(None if block is None else block.block_id)
            if block is None:
                run_start = i + 1
            elif run_start <= self._first_needed_block((i + 1) * self.block_size):
                best = i + 1
        first = self._first_needed_block(best * self.block_size)
        ids = [SKIPPED_ID] * first + [i for i in cached[first:best] if i is not None]
        return ids, best * self.block_size

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
            if blocks[i] is not SKIPPED:  # (released blocks were cached before they went)
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
        pool cannot supply them; then nothing has changed but the release of blocks behind the
        sliding window (dead either way).
        """
        if num_new_tokens <= 0 and not new_computed_blocks:
            return []
        pool = self.block_pool
        hit_blocks = [SKIPPED if i == SKIPPED_ID else pool.blocks[i] for i in new_computed_blocks or ()]
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is not None:
            # Blocks behind the window are dead whatever happens next (even if this fails).
            self._release_skipped(req_blocks, request.num_computed_tokens)
        num_held = len(req_blocks) if req_blocks is not None else 0

        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = cdiv(num_total_tokens, self.block_size) - num_held - len(hit_blocks)
        # Hit blocks that sit in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0 and b is not SKIPPED)
        if num_new_blocks > pool.get_num_free_blocks() - num_evictable_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        if new_computed_blocks is not None and self._lookup_allowed(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        if hit_blocks:
            pool.touch(b for b in hit_blocks if b is not SKIPPED)
            req_blocks.extend(hit_blocks)
            self.num_cached_block[request_id] = len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def drop_tail(self, request: Request, num_tokens: int) -> int:
        """Free the request's blocks past those that positions [0, num_tokens) need (after a
        speculative step, the blocks that held only rejected rows: never cached, since only
        computed positions are). Returns how many were dropped (the runner must be told)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        dropped = blocks[keep:]
        del blocks[keep:]
        assert self.num_cached_block.get(request.request_id, 0) <= keep
        self.block_pool.free_blocks(reversed(dropped))
        return len(dropped)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head
        (a later request sharing the prefix hits the head)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not SKIPPED)

    def _release_skipped(self, req_blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Free the blocks wholly behind the sliding window of the next query (SKIPPED in
        their place), nearest first, so the oldest are evicted last (a short shared prefix,
        e.g. a system prompt, is what later requests hit)."""
        end = min(self._first_needed_block(num_computed_tokens), len(req_blocks))
        released: list[KVCacheBlock] = []
        for i in range(end - 1, -1, -1):
            block = req_blocks[i]
            if block is SKIPPED:
                break  # everything before was released already
            released.append(block)
            req_blocks[i] = SKIPPED
        if released:
            self.block_pool.free_blocks(released)
