"""The kernels' thread team (worker/csrc/thread_pool.h, runtime.c) that the GEMM and GEMV run
their tasks on: the same bits as the OpenMP regions it replaces (TIDAL_CPU_THREAD_POOL=0) at
every thread count, and no hang and no wrong result when several Python threads call the
kernels at once (one caller owns the team, the others run alone), when team threads are more
than the cores, or in a child forked after the team started (it has no team threads)."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from tidal.worker import cpu_kernels as ck
from tidal.worker import panel_gemm as hg

pytestmark = pytest.mark.skipif(ck.cpu_kernels() is None, reason="no C compiler: kernels unavailable")

SHAPES = [(1, 1000, 1000), (3, 200, 520), (4, 8192, 64), (9, 1000, 520), (64, 700, 300)]  # (m, n, k)


@pytest.fixture
def threads() -> Iterator[callable]:
    """set(n): torch's and the kernels' thread count (restored after), as the worker sets them."""
    saved, lib = torch.get_num_threads(), ck.cpu_kernels()

    def set_threads(n: int) -> None:
        torch.set_num_threads(n)
        lib.tidal_set_num_threads(n)

    yield set_threads
    set_threads(saved)
    lib.tidal_set_thread_pool(1)


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    packed = hg.pack_weight(torch.randn(n, k, generator=gen), dtype)
    return torch.randn(m, k, generator=gen), packed, torch.randn(n, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_team_gives_the_bits_of_the_openmp_regions(dtype: torch.dtype, threads) -> None:
    lib = ck.cpu_kernels()
    for count in (1, 2, 5):  # 5: more team threads than this machine's cores
        threads(count)
        for i, (m, n, k) in enumerate(SHAPES):
            x, packed, bias = operands(m, n, k, dtype, i)
            lib.tidal_set_thread_pool(0)
            want = hg.panel_linear(x, packed, n, k, bias)
            lib.tidal_set_thread_pool(1)
            for _ in range(3):
                assert torch.equal(hg.panel_linear(x, packed, n, k, bias), want), (count, m, n, k)


def test_concurrent_callers_each_get_their_own_result(threads) -> None:
    threads(3)
    cases = [operands(m, n, k, torch.float32, 100 + i) for i, (m, n, k) in enumerate(SHAPES)]
    want = [hg.panel_linear(x, p, p_n, p_k, b) for (x, p, b), (_, p_n, p_k) in zip(cases, SHAPES)]
    failures: list[str] = []

    def caller(offset: int) -> None:
        for step in range(60):  # ctypes drops the GIL: the calls really overlap
            j = (offset + step) % len(cases)
            x, packed, bias = cases[j]
            _, n, k = SHAPES[j]
            if not torch.equal(hg.panel_linear(x, packed, n, k, bias), want[j]):
                failures.append(f"caller {offset} step {step} shape {SHAPES[j]}")

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a kernel call hung"
    assert not failures, failures[:3]


def test_a_forked_child_runs_the_kernels_without_the_team(threads) -> None:
    threads(2)
    x, packed, bias = operands(4, 1000, 1000, torch.float32, 7)
    want = hg.panel_linear(x, packed, 1000, 1000, bias)  # the team is up in this process now
    pid = os.fork()
    if pid == 0:  # the child: no team threads; the caller must run every task itself
        ok = all(torch.equal(hg.panel_linear(x, packed, 1000, 1000, bias), want) for _ in range(5))
        os._exit(0 if ok else 1)
    deadline_s, waited = 60.0, 0.0
    while waited < deadline_s:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        threading.Event().wait(0.05)
        waited += 0.05
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's kernel calls hung")
