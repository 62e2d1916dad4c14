"""Sizing rules the front-end, the core and the workers must agree on (torch-free): KV cache
blocks, the tokens one step may schedule, CUDA graph batch sizes."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def max_useful_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that every sequence at full length can use at once (+1: a block may be held by
    the prefix cache while a sequence fills its last one); more is memory for nothing."""
    return max_num_seqs * cdiv(max_model_len, block_size) + 1


def max_step_tokens(max_num_batched_tokens: int, max_model_len: int, enable_chunked_prefill: bool) -> int:
    """The most tokens one step can schedule: without chunked prefill a whole max_model_len
    prompt must fit one step (as vLLM). The scheduler's budget and the runner's buffers."""
    return max_num_batched_tokens if enable_chunked_prefill else max(max_num_batched_tokens, max_model_len)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def kv_cache_budget_from_memory(total_bytes: int, used_bytes: int, peak_activation_bytes: int,
                                utilization: float) -> int:
    """KV cache bytes under vLLM's `gpu_memory_utilization`: this engine may hold `utilization`
    of the device's memory in all; what is in use already (weights, CUDA context, other
    processes) and the activation peak of the largest step come off it. May be negative."""
    return int(total_bytes * utilization) - used_bytes - peak_activation_bytes


def kv_blocks_for_budget(budget_bytes: int, bytes_per_block: int, *, max_num_seqs: int, max_model_len: int,
                         block_size: int, how: str) -> int:
    """Blocks of `bytes_per_block` the budget holds, capped at what max_num_seqs sequences of
    max_model_len can use. A budget that cannot hold one max_model_len sequence is a ValueError
    with the numbers (`how` says where the budget came from, to name the knob to turn)."""
    per_seq = cdiv(max_model_len, block_size)
    blocks = max(0, budget_bytes) // bytes_per_block
    if blocks < per_seq:
        raise ValueError(
            f"the KV cache budget ({how}) is {_gib(max(0, budget_bytes))}, {blocks} blocks of "
            f"{bytes_per_block} bytes; one sequence of max_model_len={max_model_len} needs {per_seq} "
            f"blocks ({_gib(per_seq * bytes_per_block)}): raise it or lower max_model_len")
    return min(blocks, max_useful_kv_blocks(max_num_seqs, max_model_len, block_size))


def cuda_graph_capture_sizes(cap: int) -> list[int]:
    """vLLM's CUDA graph batch sizes up to `cap`, ascending: 1, 2, 4, then steps of 8 up to
    256, then of 16; `cap` itself included, so every batch up to it has a graph to replay."""
    if cap < 1:
        return []
    grid = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, cap + 1, 16))
    return [s for s in grid if s < cap] + [cap]
