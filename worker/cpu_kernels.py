"""C kernels for CPUs, compiled on first use with the machine's C compiler and loaded with ctypes.

Plain C (no torch headers) compiles in well under a second, so there is no build step at install
time: the shared object is cached under $TIDAL_CACHE_DIR (default ~/.cache/tidal/kernels), named
by a hash of the source, the flags, the compiler's version and this CPU's feature flags
(`-march=native`), and written atomically so concurrent workers never load a partial file.

If there is no compiler or the build fails, `cpu_kernels()` returns None and callers keep the
torch implementation: the kernels make things faster, never possible.
Set TIDAL_CPU_KERNELS=0 to skip them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tidal.protocol import envs

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
# -fno-math-errno lets sqrtf / rintf inline into vectorized loops; -fno-trapping-math lets a
# loop with a float compare-and-select (exp_clamped's clamp: SiLU, the softmax) vectorize at
# all (tidal never reads the FP exception flags; values are unchanged); -ffp-contract=fast turns
# a * b + c into FMAs (ISO C mode forbids it otherwise). NaN/inf semantics stay (no -ffast-math).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-fopenmp",
          "-fPIC", "-shared", "-std=c11"]
_BUILD_TIMEOUT_S = 120


def _cpu_flags() -> str:
    """What -march=native depends on: x86's `flags`, arm's `Features` and CPU part lines."""
    keys = ("flags", "Features", "CPU implementer", "CPU part", "model name")
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({line for line in f if line.startswith(keys)}))
    except OSError:
        return platform.processor()


def _compile(sources: list[Path], compiler: list[str]) -> Path:
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                             timeout=_BUILD_TIMEOUT_S, check=True).stdout
    parts = [p.read_bytes() for p in sorted(_CSRC.iterdir()) if p.suffix in (".c", ".h")]
    key = hashlib.sha256(
        b"\0".join([*parts, " ".join(_FLAGS).encode(), version.encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    out_dir = Path(envs.TIDAL_CACHE_DIR) / "kernels"
    target = out_dir / f"libtidal_cpu-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([*compiler, *_FLAGS, *map(str, sources), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=_BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(compiler)} failed: {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp made it 0600; other users of a shared cache load it too
        os.replace(tmp, target)  # atomic: a concurrent loader sees no file or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# name -> (restype, argtypes); pointers are passed as tensor.data_ptr() integers.
_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    # q, q_row_stride, out, out_row_stride, rows, num_q_rows, k_cache, v_cache, num_blocks,
    # block_tables, table_width, seq_lens, num_decodes, num_heads, num_kv_heads, head_dim,
    # block_size, scale
    "tidal_paged_decode_attention_f32": (
        ctypes.c_int, [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32]),
    # the same, over fp16 / bf16 caches (q and out float32)
    "tidal_paged_decode_attention_f16": (
        ctypes.c_int, [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32]),
    "tidal_paged_decode_attention_bf16": (
        ctypes.c_int, [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32]),
    # the same three with a trailing sliding window (int64, <= 0: none)
    **{f"tidal_paged_decode_attention_sw_{suffix}": (
        ctypes.c_int, [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i64])
       for suffix in ("f32", "f16", "bf16")},
    # ... and a logit soft cap after the window (float32, <= 0: none)
    **{f"tidal_paged_decode_attention_swcap_{suffix}": (
        ctypes.c_int,
        [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i64, _f32])
       for suffix in ("f32", "f16", "bf16")},
    # ... and attention sinks after the soft cap (float32 [num_heads] pointer, nullable: gpt-oss)
    **{f"tidal_paged_decode_attention_sink_{suffix}": (
        ctypes.c_int,
        [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i64, _f32, _p])
       for suffix in ("f32", "f16", "bf16")},
    # k, k_stride, v, v_stride, slots, num_tokens, k_cache, v_cache, num_slots, row_len
    "tidal_write_kv_cache_f32": (ctypes.c_int, [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _i64]),
    # the same, float32 k/v rounded to nearest even into fp16 / bf16 caches
    "tidal_write_kv_cache_f16": (ctypes.c_int, [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _i64]),
    "tidal_write_kv_cache_bf16": (ctypes.c_int, [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _i64]),
    # x, x_row_stride, w_packed, bias (nullable), out, out_row_stride, m, n, k, kind (0 f32, 1 f16, 2 bf16)
    "tidal_gemm_panels": (ctypes.c_int, [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, ctypes.c_int]),
    "tidal_gemm_panels_simd": (ctypes.c_int, []),
    # the same arguments as tidal_gemm_panels, for 1 <= m <= 4 (csrc/gemv.c; bit-identical results)
    "tidal_gemv_panels": (ctypes.c_int, [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, ctypes.c_int]),
    # x, x_row_stride, wq (int8 [N, kb*32]), wd (float32 [N, kb]), bias (nullable), out, out_row_stride, m, n, k
    "tidal_int8_gemm": (ctypes.c_int, [_p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _i64]),
    # x, x_stride, out, weight, eps, rows, dim
    "tidal_rms_norm_f32": (None, [_p, _i64, _p, _p, _f32, _i64, _i64]),
    # x, residual, weight, eps, rows, dim
    "tidal_fused_add_rms_norm_f32": (None, [_p, _p, _p, _f32, _i64, _i64]),
    # qkv, row_stride, tokens, q heads, kv heads, head_dim, q_weight, k_weight, eps, positions,
    # cos_cache, sin_cache, max_position
    "tidal_qk_norm_rope_f32": (
        ctypes.c_int, [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _f32, _p, _p, _p, _i64]),
    # x, out, rows, d
    "tidal_silu_and_mul_f32": (None, [_p, _p, _i64, _i64]),
    "tidal_set_num_threads": (None, [ctypes.c_int]),
    "tidal_set_thread_pool": (None, [ctypes.c_int]),
}


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    """The compiled kernels (functions typed per _SIGNATURES), or None when unavailable."""
    if not envs.TIDAL_CPU_KERNELS:
        return None
    cc = envs.CC or shutil.which("cc") or shutil.which("gcc")
    compiler = shlex.split(cc) if cc else []  # CC may carry a launcher: "ccache gcc"
    if not compiler:
        logger.warning("no C compiler found; CPU kernels disabled, using torch ops")
        return None
    try:
        # torch is imported (above), so its libgomp.so.1 is the one the kernels' OpenMP binds to.
        lib = ctypes.CDLL(str(_compile(sorted(_CSRC.glob("*.c")), compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable, using torch ops: %s", exc)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    lib.tidal_set_num_threads(torch.get_num_threads())
    lib.tidal_set_thread_pool(int(envs.TIDAL_CPU_THREAD_POOL))  # csrc/thread_pool.h
    return lib


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def is_f32_cpu(*tensors: torch.Tensor) -> bool:
    """Every tensor float32 on the CPU, and the kernels built: the common precondition."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and cpu_kernels() is not None
