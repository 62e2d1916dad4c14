"""A/B of two versions of the panel GEMM (worker/csrc/gemm_panels.c) in one run.

This machine's speed drifts by 10-50% over minutes, more than most kernel changes are worth,
so two builds measured in separate runs cannot be compared. This script builds both versions
with tidal's own compiler flags, loads both, and times them call for call, alternating which
goes first, on the bench_offline model's shapes with the weights cycled from DRAM (as a decode
step reads them). Both must give bit-identical outputs. It prints the median per call and the
speed-up of B over A.

    python scripts/bench_gemm_ab.py                        # A: HEAD's gemm_panels.c, B: the working tree's
    python scripts/bench_gemm_ab.py --a-rev HEAD~3 --dtype bfloat16 --rows 1 4 8 16 32
    python scripts/bench_gemm_ab.py --a-file old.c --b-file new.c
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

_CSRC = "worker/csrc"
_SHAPES = ((1024, 512), (512, 512), (3072, 512), (512, 1536), (8192, 512))  # qkv, o, gate_up, down, lm_head
_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}  # gemm_panels.c's W_F32, W_F16, W_BF16
_WEIGHT_BYTES = 128 << 20  # cycled per shape: well past this machine's 32 MiB L3


def build(sources: dict[str, str], out_dir: str) -> ctypes.CDLL:
    """Compile gemm_panels.c with the headers of the same version (`sources`: file name ->
    text) in `out_dir`, with tidal's flags, and type its entry point as tidal does."""
    from tidal.worker import cpu_kernels

    os.makedirs(out_dir)
    for name, text in sources.items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    lib = os.path.join(out_dir, "gemm_panels.so")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    subprocess.run([*shlex.split(cc), *cpu_kernels._FLAGS, os.path.join(out_dir, "gemm_panels.c"), "-o", lib,
                    "-lm"], check=True, timeout=120)
    dll = ctypes.CDLL(lib)
    restype, argtypes = cpu_kernels._SIGNATURES["tidal_gemm_panels"]
    dll.tidal_gemm_panels.restype, dll.tidal_gemm_panels.argtypes = restype, argtypes
    return dll


def sources(rev: str | None, path: str | None) -> dict[str, str]:
    """gemm_panels.c (from `path`, git revision `rev`, or the working tree) and the headers of
    worker/csrc at the same revision (the working tree's for a file or the working tree)."""
    def read(name: str) -> str:
        if rev is None:
            with open(os.path.join(_CSRC, name)) as f:
                return f.read()
        return subprocess.run(["git", "show", f"{rev}:{_CSRC}/{name}"], check=True, capture_output=True,
                              text=True, timeout=30).stdout

    if rev is None:
        headers = [n for n in os.listdir(_CSRC) if n.endswith(".h")]
    else:
        listing = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{_CSRC}/"], check=True,
                                 capture_output=True, text=True, timeout=30).stdout
        headers = [os.path.basename(n) for n in listing.split() if n.endswith(".h")]
    out = {name: read(name) for name in headers}
    if path is not None:
        with open(path) as f:
            out["gemm_panels.c"] = f.read()
    else:
        out["gemm_panels.c"] = read("gemm_panels.c")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a-rev", default="HEAD", help="git revision of A (default HEAD)")
    ap.add_argument("--a-file", default=None, help="A from this file instead")
    ap.add_argument("--b-file", default=None, help="B from this file (default: the working tree's)")
    ap.add_argument("--dtype", choices=sorted(_KINDS), default="float32", help="the packed weights' dtype")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--calls", type=int, default=200, help="timed calls per version, shape and row count")
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="idle time before each call, as the Python between a model's GEMMs (with tidal's "
                         "GOMP_SPINCOUNT=3000 the OpenMP threads fall asleep in it and must be woken)")
    args = ap.parse_args()
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        # As tidal's engine processes run (tidal_pkg/utils/openmp.py). libgomp reads it when it loads,
        # which `import torch` above has done: start again with it set.
        os.environ["GOMP_SPINCOUNT"] = "3000"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    from tidal.worker.panel_gemm import pack_weight

    dtype, kind = getattr(torch, args.dtype), _KINDS[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        a_rev = None if args.a_file is not None else args.a_rev
        libs = {"A": build(sources(a_rev, args.a_file), os.path.join(tmp, "a")),
                "B": build(sources(None, args.b_file), os.path.join(tmp, "b"))}
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.dtype} panels; "
              f"A = {args.a_file or args.a_rev}, B = {args.b_file or 'working tree'}")
        torch.manual_seed(0)
        for n, k in _SHAPES:
            weights = [pack_weight(torch.randn(n, k), dtype) for _ in range(max(4, _WEIGHT_BYTES // (n * k * 4)))]
            for m in args.rows:
                x = torch.randn(m, k)
                outs = {name: torch.empty(m, n) for name in libs}
                times: dict[str, list[float]] = {name: [] for name in libs}
                for call in range(args.calls):
                    w = weights[call % len(weights)]
                    for name in ("A", "B") if call % 2 == 0 else ("B", "A"):
                        if args.gap_us:
                            time.sleep(args.gap_us * 1e-6)
                        t0 = time.perf_counter()
                        rc = libs[name].tidal_gemm_panels(x.data_ptr(), k, w.data_ptr(), None, outs[name].data_ptr(),
                                                          n, m, n, k, kind)
                        times[name].append(time.perf_counter() - t0)
                        assert rc == 0, rc
                if not torch.equal(outs["A"], outs["B"]):
                    sys.exit(f"N={n} K={k} M={m}: A and B give different outputs")
                a, b = (statistics.median(times[name]) * 1e6 for name in ("A", "B"))
                print(f"  N={n:5d} K={k:5d} M={m:4d}   A {a:9.1f} us   B {b:9.1f} us   B speed-up {a / b:.2f}x",
                      flush=True)


if __name__ == "__main__":
    main()
