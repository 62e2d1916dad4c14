"""KV cache sizing from memory (gpu_memory_utilization, kv_cache_memory_bytes): the arithmetic
against a straightforward reference, and the ValueError when one max_model_len sequence does
not fit, raised by a real engine core before any request runs."""
from __future__ import annotations

import math
import re

import pytest

from tidal.protocol.sizing import kv_blocks_for_budget, kv_cache_budget_from_memory

GIB = 1 << 30


def reference_blocks(total: int, used: int, peak: int, util: float, per_block: int, max_num_seqs: int,
                     max_model_len: int, block_size: int) -> int | None:
    """Blocks by hand: floor(total * util) - used - peak bytes, whole blocks of it, at most what
    max_num_seqs full-length sequences use (+1); None when one sequence does not fit."""
    budget = math.floor(total * util) - used - peak
    blocks = max(budget, 0) // per_block
    per_seq = math.ceil(max_model_len / block_size)
    if blocks < per_seq:
        return None
    return min(blocks, max_num_seqs * per_seq + 1)


CASES = [
    # total, used, peak, util, per_block, max_num_seqs, max_model_len, block_size
    (141 * GIB, 2 * GIB, GIB // 2, 0.9, 28 * 2 * 16 * 8 * 128 * 2, 256, 4096, 16),  # Qwen3-0.6B bf16 on an H200
    (80 * GIB, 17 * GIB, 3 * GIB, 0.9, 32 * 2 * 16 * 8 * 128 * 2, 256, 8192, 16),  # Llama-8B on an A100-80G
    (24 * GIB, 2 * GIB, GIB, 0.5, 1 << 20, 4, 2048, 32),  # capped: 4 sequences use few blocks
    (16 * GIB, 15 * GIB, GIB, 0.9, 1 << 20, 8, 2048, 16),  # nothing left: negative budget
    (16 * GIB, 13 * GIB, GIB // 4, 0.9, 1 << 22, 8, 4096, 16),  # a few blocks, short of one sequence
]


@pytest.mark.parametrize("total,used,peak,util,per_block,max_num_seqs,max_model_len,block_size", CASES)
def test_blocks_from_memory_match_reference(total: int, used: int, peak: int, util: float, per_block: int,
                                            max_num_seqs: int, max_model_len: int, block_size: int) -> None:
    want = reference_blocks(total, used, peak, util, per_block, max_num_seqs, max_model_len, block_size)
    budget = kv_cache_budget_from_memory(total, used, peak, util)
    assert budget == math.floor(total * util) - used - peak
    kwargs = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
                  how=f"gpu_memory_utilization={util}")
    if want is None:
        with pytest.raises(ValueError) as e:
            kv_blocks_for_budget(budget, per_block, **kwargs)
        msg = str(e.value)
        # The numbers: max_model_len, the blocks one sequence needs, the knob.
        assert f"max_model_len={max_model_len}" in msg
        assert f"needs {math.ceil(max_model_len / block_size)} blocks" in msg
        assert f"gpu_memory_utilization={util}" in msg
    else:
        assert kv_blocks_for_budget(budget, per_block, **kwargs) == want


def test_exactly_one_sequence_fits() -> None:
    per_block, bs, max_len = 1000, 16, 100  # 7 blocks per sequence
    kw = dict(max_num_seqs=4, max_model_len=max_len, block_size=bs, how="test")
    assert kv_blocks_for_budget(7 * per_block, per_block, **kw) == 7
    with pytest.raises(ValueError, match="budget \\(test\\)"):
        kv_blocks_for_budget(7 * per_block - 1, per_block, **kw)


def test_engine_refuses_a_budget_below_one_sequence(tiny_model_dir: str) -> None:
    """A real core on CPU: kv_cache_memory_bytes that cannot hold one max_model_len sequence
    fails the engine's construction with the numbers, before any request."""
    from tests.engine_utils import make_core

    with pytest.raises(ValueError) as e:
        make_core(tiny_model_dir, max_model_len=1024, kv_cache_memory_bytes=4096)
    msg = str(e.value)
    assert "kv_cache_memory_bytes" in msg and "max_model_len=1024" in msg
    assert re.search(r"needs \d+ blocks", msg)
