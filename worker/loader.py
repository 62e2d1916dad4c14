"""Build a model from its HF config and fill it from safetensors (or with dummy weights)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tidal.worker.layers.embedding import VocabParallelEmbedding
from tidal.worker.layers.gemm import half_storage_enabled
from tidal.worker.layers.quantization import check_quantization, quantize_model
from tidal.worker.layers.linear import LoadedWeight
from tidal.worker.models.registry import get_model_class

logger = logging.getLogger(__name__)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

# Dummy weights: uniform with the std of a 0.02 normal (what HF checkpoints are initialized
# with), norms at a scale of 1 (weight 1; Gemma's 1 + weight norms: 0, their `dummy_weight`).
# Keeps activations finite in bf16/fp16 even at 8B scale.
_DUMMY_STD = 0.02


def _dtype_from_name(name: str) -> torch.dtype:
    key = name.removeprefix("torch.").lower()
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; choose from auto, {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[key]


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any) -> torch.dtype:
    """"auto" -> the checkpoint's dtype (config `dtype` / `torch_dtype`), float32 when absent."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return _dtype_from_name(dtype)
    cfg_dtype = getattr(hf_config, "dtype", None)
    if cfg_dtype is None:
        cfg_dtype = hf_config.__dict__.get("torch_dtype")  # older configs; avoids v5's deprecation warning
    if cfg_dtype is None:
        return torch.float32
    if isinstance(cfg_dtype, torch.dtype):
        return cfg_dtype
    return _dtype_from_name(str(cfg_dtype))


def tune_cpu_malloc() -> None:
    """Keep freed tensor memory in glibc's heap instead of unmapping it.

    Without this every large activation is a fresh mmap whose pages fault in on first touch,
    which costs more than the arithmetic on a CPU decode step (measured 5-10x on gathers).
    Process-wide and idempotent; a no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 1 << 31)
    except (OSError, AttributeError):
        pass


def safetensors_files(model_path: str) -> list[str]:
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model directory not found: {model_path}")
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"shard listed in {index} is missing: {path}")
        return files
    files = sorted(
        os.path.join(model_path, name) for name in os.listdir(model_path) if name.endswith(".safetensors")
    )
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_path} (use load_format='dummy' for random weights)")
    return files


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, LoadedWeight]]:
    """Yield (name, lazy slice); each rank's weight_loader reads only its shard of it."""
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    bound = _DUMMY_STD * 3**0.5
    generators: dict[torch.device, torch.Generator] = {}
    fills = {id(mod.weight): float(mod.dummy_weight) for mod in model.modules()
             if hasattr(mod, "dummy_weight") and isinstance(getattr(mod, "weight", None), torch.Tensor)}
    for name, param in model.named_parameters():
        if id(param) in fills or name.endswith("norm.weight"):
            param.fill_(fills.get(id(param), 1.0))
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.uniform_(-bound, bound, generator=gen)


@torch.no_grad()
def load_model(
    model_path: str,
    hf_config: Any,
    dtype: torch.dtype,
    load_format: str = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    quantization: str | None = None,
) -> nn.Module:
    """Instantiate the architecture named in `hf_config` on `device` in `dtype` and load it.

    quantization: None, or "int8" (CPU): linear layers and the LM head quantized after loading.
    load_format: "auto"/"safetensors" read `*.safetensors` (single or sharded via
    model.safetensors.index.json); "dummy" fills seeded random weights from the config alone.
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unsupported load_format {load_format!r}; choose auto, safetensors or dummy")
    check_quantization(quantization, device)  # before any weight is read: a clear error first
    model_cls = get_model_class(hf_config)
    files = safetensors_files(model_path) if load_format != "dummy" else []
    device = torch.device(device)
    if device.type == "cpu":
        tune_cpu_malloc()

    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = model_cls(hf_config)
    finally:
        torch.set_default_dtype(prev_dtype)

    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
    else:
        model.load_weights(iterate_safetensors(files))  # type: ignore[operator]
    model.requires_grad_(False)
    for module in model.modules():  # e.g. linear layers re-lay their weights for the CPU GEMM
        process = getattr(module, "process_weights_after_loading", None)
        if process is not None:
            process()
    if half_storage_enabled(dtype, device):
        compute_in_float32(model)
    if quantization == "int8":
        if dtype != torch.float32 and not half_storage_enabled(dtype, device):
            raise ValueError(f"quantization='int8' computes in float32: dtype {dtype} needs tidal's half "
                             "weights on the CPU (TIDAL_CPU_HALF_WEIGHTS=1), or use dtype float32")
        quantize_model(model)
    return model.eval()


def compute_in_float32(model: nn.Module) -> None:
    """Half-precision storage, float32 compute (CPU): the linear layers already hold their
    weights packed in fp16/bf16 for the half GEMM and the KV cache is made in the model dtype;
    the embedding table stays half too and widens the rows it looks up. Everything else (norm
    weights, biases, rotary tables: a few KB per layer) becomes float32, so the activations are
    float32 from the embedding to the logits and no op ever runs in torch's slow CPU half path.
    Built in the half dtype first, so a big checkpoint is never held in float32 whole."""
    for module in model.modules():
        keep_half = isinstance(module, VocabParallelEmbedding)  # its table; an LM head's is packed
        if keep_half:
            module.output_dtype = torch.float32
        for _, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and param.dtype != torch.float32 and not keep_half:
                param.data = param.data.float()
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != torch.float32:
                module._buffers[name] = buf.float()
