"""Triton grouped GEMM for FusedMoE (after vLLM's fused_moe): every expert's GEMMs in one kernel
launch per projection, instead of a Python loop over experts.

Layout of the work: the T * top_k (token, slot) pairs, numbered pair = token * top_k + slot, are
sorted by expert and each expert's run of pairs is padded up to a multiple of BLOCK_M
(`moe_align_block_size`, in torch), so every block of BLOCK_M sorted rows belongs to one expert.
One program computes one block x BLOCK_N output columns: it gathers its rows of A (the hidden
states, row pair // top_k, for w13; the activated intermediate, row pair, for w2), multiplies
them by its expert's weight [N, K] (transposed on the fly), accumulating in fp32, and scatters
the results to rows `pair` of a [T * top_k, N] output. Padding rows (id == T * top_k) load and
store nothing. The w2 launch multiplies each row by its router weight before the store; the
top_k rows of a token are then summed in torch (fp32).

The grid is sized from host ints only (T * top_k + E * (BLOCK_M - 1) rows is an upper bound on
the padded total); blocks past the used ones have expert id -1 and exit at once, so nothing
syncs with the device and a decode step stays CUDA-graph capturable.

Scope: the activation runs in torch between the two launches: SiluAndMul (silu(gate) * up, the
first I columns gate, the next I up) by default, or any callable [.., 2I] -> [.., I] (e.g.
gpt-oss's clamped SwiGLU). Biases on either projection are optional and added in the kernel in
fp32. Weights must be the stacked unpacked tensors (w13 [E, 2I, H], w2 [E, H, I]); no
quantized weights, expert parallelism (-1 ids) or CPU-packed weights. Off CUDA the kernel runs
only under TRITON_INTERPRET=1 (set before this module is imported).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - every triton 3.x has it
    InterpretedFunction = ()  # type: ignore[assignment,misc]

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr,
    N, K, num_valid,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_bias_e,
    A_ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (row blocks, cdiv(N, BLOCK_N)). C[pair, n] = sum_k A[pair // A_ROW_DIV, k] *
    B[expert, n, k] (+ bias[expert, n]) (* topk_weights[pair]) for the block's sorted pairs
    (sorted_ids_ptr; num_valid marks padding), expert = expert_ids[block] (-1: unused block)."""
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    if expert < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_valid
    a_row = pair // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sorted_ids [P], expert_ids [P // block_m], num_valid): the flat (token, slot) pair ids
    (token * top_k + slot) sorted by expert, stable, each expert's run padded with num_valid
    (= T * top_k) to a multiple of block_m; expert_ids the expert of each block, -1 for the
    unused blocks at the end. P = num_valid + num_experts * (block_m - 1) rounded up to a
    multiple of block_m: a host-int upper bound, so nothing here waits for the device."""
    device = topk_ids.device
    flat = topk_ids.flatten().to(torch.int64)
    num_valid = flat.numel()
    capacity = triton.cdiv(num_valid + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(num_valid, device=device) - count_start[sorted_expert]
    sorted_ids = torch.full((capacity,), num_valid, dtype=torch.int32, device=device)
    sorted_ids[padded_start[sorted_expert] + rank] = order.to(torch.int32)
    block_first = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_first, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, num_valid


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """tl.dot operand dtype for inputs of `dtype`: the same (fp32 as IEEE fp32, not TF32),
    except bf16 under the interpreter, whose bf16 tl.dot is wrong (triton 3.9): there the bf16
    values are widened to fp32 (exact)."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"fused_experts_triton: inputs must be float32, float16 or bfloat16, not {dtype}")
    if dtype == torch.bfloat16 and isinstance(_moe_gemm_kernel, InterpretedFunction):
        return tl.float32
    return _TL_DTYPES[dtype]


def _default_blocks(num_pairs: int, n: int, k: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks when each expert gets few rows (decode),
    so less of each block is padding."""
    rows_per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    return block_m, block_n, block_k


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
            topk_weights: torch.Tensor | None, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
            num_valid: int, a_row_div: int, block_m: int, block_n: int, block_k: int) -> None:
    e, n, k = b.shape
    dot_dtype = _dot_dtype(a.dtype)
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"fused_experts_triton: bias has shape {tuple(bias.shape)}, expected {(e, n)}")
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, b, c, bias if bias is not None else c, topk_weights if topk_weights is not None else c,
        sorted_ids, expert_ids, n, k, num_valid,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0,
        A_ROW_DIV=a_row_div, HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiluAndMul: silu(first half) * second half, in x's dtype."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def fused_experts_triton(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                         activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         block_sizes: tuple[int, int, int] | None = None) -> torch.Tensor:
    """sum over slots j of topk_weights[t, j] * down_e(act(gate_up_e(hidden[t]))), e =
    topk_ids[t, j]: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] (float32),
    topk_ids [T, k] -> [T, H] in hidden's dtype. Biases (optional): w13_bias [E, 2I], w2_bias
    [E, H]. activation: [.., 2I] -> [.., I], SiluAndMul if None. block_sizes: (BLOCK_M,
    BLOCK_N, BLOCK_K), each a power of two >= 16, or None for a heuristic (both GEMMs)."""
    if hidden_states.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("fused_experts_triton: hidden must be [T, H], w13 [E, 2I, H], w2 [E, H, I]")
    t, h = hidden_states.shape
    e, two_i, h13 = w13.shape
    if h13 != h or tuple(w2.shape) != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"fused_experts_triton: shapes hidden {tuple(hidden_states.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not agree")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError("fused_experts_triton: topk_weights and topk_ids must both be [T, top_k]")
    if w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype:
        raise ValueError("fused_experts_triton: weights and hidden states must have one dtype")
    top_k = topk_ids.shape[1]
    if t == 0:
        return torch.zeros_like(hidden_states)
    num_pairs = t * top_k
    if block_sizes is None:
        block_sizes = _default_blocks(num_pairs, max(two_i, h), max(h, two_i // 2), e)
    block_m, block_n, block_k = block_sizes
    sorted_ids, expert_ids, num_valid = moe_align_block_size(topk_ids, block_m, e)
    device, dtype = hidden_states.device, hidden_states.dtype
    hidden_states = hidden_states.contiguous()
    gate_up = torch.empty(num_pairs, two_i, device=device, dtype=dtype)
    _launch(hidden_states, w13, gate_up, w13_bias, None, sorted_ids, expert_ids, num_valid,
            top_k, block_m, block_n, block_k)
    act = (activation or silu_and_mul)(gate_up).contiguous()
    down = torch.empty(num_pairs, h, device=device, dtype=dtype)
    weights = topk_weights.to(torch.float32).contiguous().flatten()
    _launch(act, w2, down, w2_bias, weights, sorted_ids, expert_ids, num_valid,
            1, block_m, block_n, block_k)
    return down.view(t, top_k, h).sum(dim=1, dtype=torch.float32).to(dtype)
