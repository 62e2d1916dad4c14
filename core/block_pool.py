"""Paged KV blocks with ref counts, an LRU free queue and a prefix-cache index (vLLM V1).

Invariants:
- A block is in the free queue iff its `ref_cnt == 0`. The queue is ordered by the time the
  block was freed: `get_new_blocks` takes the least-recently-freed block first (the prefix
  cache's LRU eviction). Without prefix caching (`reuse_latest_first`) it takes the most
  recently freed block first instead: nothing cached is lost either way, and the same few
  blocks serve request after request. Cycling through the whole pool instead would touch
  every page of the KV cache tensors in turn (zero-filled lazily by the OS), and the core's
  RSS would creep up by ~one block per request until the whole cache is resident.
- A free block keeps its `block_hash` (and its entry in the hash map) until it is handed out
  again: only then is the cached prefix it holds evicted. So a freed block can still be hit.
- `cached_block_hash_to_block[h] is b` implies `b.block_hash == h`. A hash maps to one block;
  a second block computed with the same contents stays unhashed (it is simply not shared).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Hash of one full block: hash((parent_block_hash | None, tuple(token_ids_of_block))).
# Python's hash of ints/tuples is stable within a process, which is all the cache needs
# (the index lives in the engine-core process only).
BlockHash = int


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id: int = block_id
        self.ref_cnt: int = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and cached

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    return hash((parent_block_hash, tuple(token_ids)))


def update_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        salt: str | None = None) -> None:
    """Extend `block_hashes` in place to cover every full block of `token_ids` (chain hash);
    a `salt` is the first block's parent, so every hash of a salted request depends on it."""
    num_full_blocks = len(token_ids) // block_size
    if block_hashes:
        parent: object = block_hashes[-1]
    else:
        parent = None if salt is None else ("cache_salt", salt)
    for i in range(len(block_hashes), num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        block_hashes.append(parent)


class BlockPool:
    def __init__(self, num_blocks: int, *, reuse_latest_first: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks: int = num_blocks
        self.reuse_latest_first: bool = reuse_latest_first  # see the invariants
        # Every block up front (~1 us each), before the core's gc.freeze(): blocks made later
        # would be walked by every full GC pass of the busy loop, 10^5 of them ~5 ms a pass.
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in least-recently-freed-first order (front is reused first).
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    # ------------------------------------------------------------------ queries

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        return 1.0 - len(self.free_block_queue) / self.num_blocks

    def ref_counts(self) -> list[int]:
        """Every block's reference count, by block id (for checks and debugging)."""
        return [b.ref_cnt for b in self.blocks]

    def free_block_ids(self) -> set[int]:
        return set(self.free_block_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    # ------------------------------------------------------------------ alloc / free

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (LRU first), evicting any cached prefix they hold."""
        if num_blocks > len(self.free_block_queue):
            raise ValueError(f"cannot get {num_blocks} free blocks, {len(self.free_block_queue)} left")
        queue = self.free_block_queue
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            _, block = queue.popitem(last=False)
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (cache-hit) blocks; free ones leave the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                del queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue's tail in the given order
        (so the first given is evicted first), or its front with `reuse_latest_first`."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                queue[block.block_id] = block
                if self.reuse_latest_first:
                    queue.move_to_end(block.block_id, last=False)

    # ------------------------------------------------------------------ prefix cache

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under `block_hash` (no-op if already cached or a
        different block already holds that hash)."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Only when no block is in use (as vLLM); else False."""
        if len(self.free_block_queue) != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
