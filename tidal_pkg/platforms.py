"""vLLM's `vllm.platforms.current_platform`, for the code (and vLLM's tests) that asks which
device the engine runs on: CUDA when torch sees a GPU, else CPU, as tidal's workers choose.
torch is imported on the first question, not with this module."""
from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class Platform:
    @property
    def device_type(self) -> str:
        return "cuda" if _cuda() else "cpu"

    @property
    def device_name(self) -> str:
        return self.device_type

    def is_cuda(self) -> bool:
        return _cuda()

    def is_cuda_alike(self) -> bool:
        return _cuda()

    def is_cpu(self) -> bool:
        return not _cuda()

    def is_rocm(self) -> bool:  # tidal runs no ROCm, TPU, XPU or HPU build
        return False

    def is_tpu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def get_device_name(self, device_id: int = 0) -> str:
        if not _cuda():
            return "cpu"
        import torch

        return str(torch.cuda.get_device_name(device_id))

    def get_device_capability(self, device_id: int = 0) -> Any:
        """(major, minor) of a CUDA device; None on CPU (as vLLM's CPU platform)."""
        if not _cuda():
            return None
        import torch

        return tuple(torch.cuda.get_device_capability(device_id))

    def has_device_capability(self, capability: int | tuple[int, int], device_id: int = 0) -> bool:
        got = self.get_device_capability(device_id)
        if got is None:
            return False
        want = capability if isinstance(capability, tuple) else divmod(capability, 10)
        return tuple(got) >= tuple(want)


current_platform = Platform()

__all__ = ["Platform", "current_platform"]
