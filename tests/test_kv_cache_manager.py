"""BlockPool / KVCacheManager: ref counts, LRU free order, hash chain, prefix hits."""
from __future__ import annotations

from tidal.core.block_pool import BlockPool, hash_block_tokens
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.request import Request
from tidal.protocol import SamplingParams


def make_request(rid: str, prompt: list[int], **sp: object) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4, **sp), eos_token_id=None, max_model_len=1024)


def admit(kv: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> list[int]:
    """Look up the prefix cache and allocate like the scheduler does on admission."""
    hit_ids, num_hit = kv.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    assert kv.allocate_slots(req, n, hit_ids, num_hit) is not None
    req.num_computed_tokens = num_hit
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = num_hit
    return hit_ids


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    req.num_computed_tokens += n
    kv.cache_blocks(req, req.num_computed_tokens)


def check_pool(pool: BlockPool, holders: list[list[int]]) -> None:
    refs = [0] * pool.num_blocks
    for ids in holders:
        for i in ids:
            refs[i] += 1
    assert pool.ref_counts() == refs
    assert pool.free_block_ids() == {i for i, r in enumerate(refs) if r == 0}
    assert pool.get_num_free_blocks() == refs.count(0)
    assert all(b.block_id == i for i, b in enumerate(pool.blocks))
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h


def test_hash_chain_matches_formula() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    req = make_request("a", prompt)
    kv.get_computed_blocks(req)
    h0 = hash((None, (0, 1, 2, 3)))
    h1 = hash((h0, (4, 5, 6, 7)))
    assert req.block_hashes == [h0, h1]
    assert hash_block_tokens(h0, [4, 5, 6, 7]) == h1


def test_least_recently_freed_reused_first() -> None:
    """With prefix caching, the free queue is the cache's LRU eviction order."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a, b = make_request("a", list(range(12))), make_request("b", list(range(100, 112)))
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    assert kv.allocate_slots(b, 12) == [3, 4, 5]
    kv.free(a)  # tail first: 2, 1, 0
    kv.free(b)  # then 5, 4, 3
    assert kv.num_free_blocks == 8
    c = make_request("c", list(range(200, 232)))
    # Never-used blocks first, then in the order freed.
    assert kv.allocate_slots(c, 32) == [6, 7, 2, 1, 0, 5, 4, 3]
    assert kv.num_free_blocks == 0 and kv.usage == 1.0


def test_without_caching_the_blocks_freed_last_are_reused_first() -> None:
    """No cache to keep: request after request reuses the same blocks (whose KV pages are
    resident) instead of walking through the whole pool, which would fault in the entire KV
    cache bit by bit (the soak's RSS creep with prefix caching off)."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a, b = make_request("a", list(range(12))), make_request("b", list(range(100, 112)))
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    assert kv.allocate_slots(b, 12) == [3, 4, 5]
    kv.free(a)  # each to the front, tail first: 0, 1, 2 ...
    kv.free(b)  # ... behind 3, 4, 5
    c = make_request("c", list(range(200, 232)))
    assert kv.allocate_slots(c, 32) == [3, 4, 5, 0, 1, 2, 6, 7]
    kv.free(c)
    used: set[int] = set()
    for i in range(50):  # one request at a time: always the same two blocks
        r = make_request(f"r{i}", list(range(300 + i, 308 + i)))
        used.update(kv.allocate_slots(r, 8))
        kv.free(r)
    assert len(used) == 2 and kv.num_free_blocks == 8


def test_prefix_hit_and_ref_counts() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    shared = list(range(12))
    a = make_request("a", shared + [50, 51])
    assert admit(kv, a) == []
    compute(kv, a, a.num_tokens)
    assert kv.num_free_blocks == 12

    b = make_request("b", shared + [60, 61])
    hits = admit(kv, b)
    assert hits == kv.get_block_ids("a")[:3]
    assert b.num_cached_tokens == 12
    assert kv.get_block_ids("b")[:3] == hits
    check_pool(kv.block_pool, [kv.get_block_ids("a"), kv.get_block_ids("b")])
    assert kv.prefix_cache_queries == 28 and kv.prefix_cache_hits == 12


def test_last_token_always_recomputed() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    compute(kv, a, 12)
    b = make_request("b", list(range(12)))
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and hit_ids == kv.get_block_ids("a")[:2]
    # 13 tokens: all 3 full blocks can hit.
    c = make_request("c", list(range(13)))
    assert kv.get_computed_blocks(c)[1] == 12


def test_freed_blocks_still_hit_until_reused() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    compute(kv, a, 9)
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request("b", list(range(9)))
    hits = admit(kv, b)
    assert hits == a_blocks[:2] and b.num_computed_tokens == 8
    # The hit blocks left the free queue; one new block was needed for token 8.
    assert kv.num_free_blocks == 1
    check_pool(kv.block_pool, [kv.get_block_ids("b")])


def test_reuse_evicts_hash_and_tail_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial: blocks 0..3
    admit(kv, a)
    compute(kv, a, 7)
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    kv.free(a)  # free order: 3 (partial), 2, 1, 0
    c = make_request("c", [9, 9, 9])  # 2 blocks: the tail ones go first
    admit(kv, c)
    assert kv.get_block_ids("c") == [3, 2]
    assert kv.block_pool.blocks[2].block_hash is None  # evicted on reuse
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7])
    assert kv.get_computed_blocks(b) == ([0, 1], 4)  # a's head survived


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    compute(kv, a, 9)
    kv.free(a)
    b = make_request("b", list(range(9)) + list(range(100, 120)))  # 29 tokens: 8 blocks
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = [(blk.ref_cnt, blk.block_hash) for blk in kv.block_pool.blocks]
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hit_ids, num_hit) is None
    assert [(blk.ref_cnt, blk.block_hash) for blk in kv.block_pool.blocks] == before
    assert kv.num_free_blocks == 4 and kv.get_block_ids("b") == []
    assert kv.prefix_cache_queries == 9  # only a's admission counted


def test_evictable_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(9)))  # blocks 0, 1 full + cached; 2 partial
    admit(kv, a)
    compute(kv, a, 9)
    kv.free(a)
    # 13 tokens: 2 hit blocks (free, so touching them uses up 2 of the 3 free) + 2 new: no.
    b = make_request("b", list(range(13)))
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([0, 1], 8)
    assert kv.allocate_slots(b, 5, hit_ids, num_hit) is None
    check_pool(kv.block_pool, [])
    # 12 tokens: 2 hits + 1 new block fits exactly.
    b = make_request("b", list(range(12)))
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 4, hit_ids, num_hit) == [2]
    assert kv.num_free_blocks == 0
    check_pool(kv.block_pool, [kv.get_block_ids("b")])


def test_no_hit_with_prompt_logprobs_or_caching_off() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(13)))
    admit(kv, a)
    compute(kv, a, 13)
    assert kv.get_computed_blocks(make_request("b", list(range(13)), prompt_logprobs=2)) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", list(range(13))))[1] == 12

    off = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    a = make_request("a", list(range(13)))
    admit(off, a)
    compute(off, a, 13)
    assert off.get_computed_blocks(make_request("b", list(range(13)))) == ([], 0)
    assert off.block_pool.cached_block_hash_to_block == {}
    assert off.prefix_cache_queries == 0


def test_only_known_tokens_cached_and_decode_blocks_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(6)))
    admit(kv, a)
    compute(kv, a, 6)
    assert kv.num_cached_block["a"] == 1
    # Decode: tokens 6, 7 appended and computed -> block 1 becomes full and cached.
    a.append_output_token_ids(70)
    kv.allocate_slots(a, 1)
    compute(kv, a, 1)
    a.append_output_token_ids(71)
    assert kv.num_cached_block["a"] == 1
    kv.allocate_slots(a, 1)
    compute(kv, a, 1)
    assert kv.num_cached_block["a"] == 2
    b = make_request("b", list(range(6)) + [70, 71, 5])
    assert kv.get_computed_blocks(b)[1] == 8


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    compute(kv, a, 9)
    assert kv.reset_prefix_cache() is False  # blocks in use
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert all(b.block_hash is None for b in kv.block_pool.blocks)


class _ReferencePool:
    """Reference: a plain list as the free queue, every block in it from the start in id order;
    freed ids join its tail, or its front when reusing latest first."""

    def __init__(self, num_blocks: int, reuse_latest_first: bool) -> None:
        self.queue = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.reuse_latest_first = reuse_latest_first

    def get(self, n: int) -> list[int]:
        out, self.queue = self.queue[:n], self.queue[n:]
        for i in out:
            self.refs[i] = 1
        return out

    def touch(self, ids: list[int]) -> None:
        for i in ids:
            if self.refs[i] == 0:
                self.queue.remove(i)
            self.refs[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                if self.reuse_latest_first:
                    self.queue.insert(0, i)
                else:
                    self.queue.append(i)


def test_pool_hands_out_the_reference_order() -> None:
    """The pool hands out exactly the ids a plain list queue would, under random allocation,
    touches of held or free blocks, and frees, in both reuse orders."""
    import random

    for reuse_latest_first in (False, True):
        rng = random.Random(7 + reuse_latest_first)
        pool, ref = BlockPool(40, reuse_latest_first=reuse_latest_first), _ReferencePool(40, reuse_latest_first)
        held: list[list[int]] = []
        for _ in range(400):
            op = rng.random()
            if op < 0.45 and pool.get_num_free_blocks():
                n = rng.randint(1, min(5, pool.get_num_free_blocks()))
                ids = [b.block_id for b in pool.get_new_blocks(n)]
                assert ids == ref.get(n)
                held.append(ids)
            elif op < 0.6 and pool.blocks:
                ids = rng.sample(range(len(pool.blocks)), rng.randint(1, min(3, len(pool.blocks))))
                pool.touch(pool.blocks[i] for i in ids)
                ref.touch(ids)
                held.append(ids)
            elif held:
                ids = held.pop(rng.randrange(len(held)))
                pool.free_blocks(pool.blocks[i] for i in ids)
                ref.free(ids)
            assert pool.ref_counts() == ref.refs
            assert pool.get_num_free_blocks() == ref.refs.count(0) == len(ref.queue)


def test_cache_salt_isolates_prefixes() -> None:
    """vLLM's cache_salt: the first block's hash includes the salt (so every later one does), so
    only requests with the same salt share blocks; the unsalted chain is the formula's."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    prompt = list(range(13))  # 3 full blocks; the last token is always recomputed
    first = Request("a", prompt, SamplingParams(max_tokens=4), max_model_len=1024, cache_salt="tenant-1")
    admit(kv, first)
    compute(kv, first, 13)
    salt = ("cache_salt", "tenant-1")
    assert first.block_hashes[0] == hash((salt, (0, 1, 2, 3)))
    same = Request("b", prompt, SamplingParams(max_tokens=4), max_model_len=1024, cache_salt="tenant-1")
    other = Request("c", prompt, SamplingParams(max_tokens=4), max_model_len=1024, cache_salt="tenant-2")
    plain = make_request("d", prompt)
    assert kv.get_computed_blocks(same)[1] == 12
    assert kv.get_computed_blocks(other) == ([], 0) and kv.get_computed_blocks(plain) == ([], 0)
    assert not set(other.block_hashes) & set(first.block_hashes)
    assert plain.block_hashes[0] == hash((None, (0, 1, 2, 3)))
