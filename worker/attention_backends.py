"""The attention backend interface, and the choice of a backend by the KV cache's device:
torch reference (worker/attention_torch.py), C kernels on CPU (worker/attention_cpu.py),
Triton on CUDA (worker/attention_triton.py)."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch

from tidal.protocol import envs
from tidal.worker.attention_metadata import AttentionMetadata


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [H] float (gpt-oss's learned attention sinks)
    ) -> torch.Tensor:  # [T, H, D]
        """Write k/v into the caches at metadata.slot_mapping, then attend: each query at
        position i over its sequence's positions (i - sliding_window, i] (all of [0, i] when
        None). Positions before a sliding window are never read: their blocks may be freed.
        softcap (Gemma 2's attn_logit_softcapping; None: none): every scaled score s becomes
        softcap * tanh(s / softcap) before the mask and softmax. Every backend implements it
        (a backend that could not would have to hand the call to one that can, never drop it).
        sinks (None: none): one learned logit per query head that joins every softmax's
        denominator and attends to nothing (transformers' GptOssAttention), so a row's weights
        sum to less than 1; the same rule applies (hand the call on, never drop them)."""


ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def attention_backend_for(device: torch.device) -> AttentionBackend:
    """The backend for KV caches on `device`. auto: the C-kernel backend on CPU (which runs the
    torch path wherever its kernels do not apply), Triton on CUDA (the torch reference when
    triton is not installed). TIDAL_ATTENTION_BACKEND forces one: torch (the reference, any
    device), cpu, or triton (on CPU tensors only under TRITON_INTERPRET=1)."""
    choice = envs.TIDAL_ATTENTION_BACKEND
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"TIDAL_ATTENTION_BACKEND={choice!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    if choice == "auto":
        if device.type == "cpu":
            choice = "cpu"
        else:
            choice = "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if choice == "cpu" and device.type != "cpu":
        raise ValueError(f"TIDAL_ATTENTION_BACKEND=cpu needs the KV cache on the CPU, not {device.type}")
    return _shared_backend(choice)


def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@functools.cache
def _shared_backend(kind: str) -> AttentionBackend:
    """Backends hold no state, so one instance of each serves every layer."""
    if kind == "torch":
        from tidal.worker.attention_torch import TorchAttentionBackend  # imports this module

        return TorchAttentionBackend()
    if kind == "triton":
        from tidal.worker.attention_triton import TritonAttentionBackend  # imports this module

        return TritonAttentionBackend()
    from tidal.worker.attention_cpu import CpuAttentionBackend  # imports this module

    return CpuAttentionBackend()

