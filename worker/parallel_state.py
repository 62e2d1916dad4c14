"""Tensor-parallel process-group helpers.

One worker process per device; all ranks of the world form the single tensor-parallel group
(no pipeline parallelism), so the default process group *is* the TP group. When
torch.distributed is not initialized everything degrades to rank 0 of size 1, which keeps
single-device code paths free of collectives.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# Generous but finite: a dead peer must turn into an error, never a hang (see DESIGN.md).
DEFAULT_TIMEOUT_S: float = 300.0


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    listen_fd: int | None = None,
) -> None:
    """Join the tensor-parallel group (e.g. backend="gloo" on CPU, "nccl" on GPU).

    `listen_fd` (rank 0 only): a socket the parent already bound and listens on at the port
    named in `init_method` (tcp://host:port); rank 0 serves the rendezvous store on it, so no
    other process can take the port between choosing and binding it."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method.startswith("tcp://"):
        # Every rank builds its store the same way (init_process_group prefixes the keys of a
        # store it builds itself, not of one it is given, so the ranks must not mix the two).
        host, _, port = init_method[len("tcp://"):].rpartition(":")
        store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout,
                              wait_for_workers=False,
                              master_listen_fd=listen_fd if rank == 0 else None)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        return
    if listen_fd is not None:
        raise ValueError("listen_fd needs a tcp://host:port init_method")
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group in place and return it (identity for size 1)."""
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim` in rank order (identity for size 1)."""
    world_size = get_tp_size()
    if world_size == 1:
        return x
    x = x.contiguous()
    # The list form works on every backend (gloo lacks all_gather_into_tensor).
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def all_reduce_min(value: int) -> int:
    """Smallest `value` over the TP group (e.g. so every rank sizes the same KV block pool)."""
    if get_tp_size() == 1:
        return value
    # NCCL only reduces CUDA tensors; gloo only CPU ones.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
