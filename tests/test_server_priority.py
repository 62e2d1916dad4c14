"""TIDAL_SERVER_NICE (frontend/priority.py): `tidal serve`'s event loop runs nicer than a CPU
engine it started, and every engine-core process, a replacement after a crash too, starts at
the priority the server had before. Priorities are read from the kernel (psutil's nice(): the
process's main thread, which runs the loop)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.server_utils import Server, wait_for

FLAGS = ["--model-runner", "null", "--served-model-name", "tiny"]
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's"),
    pytest.mark.skipif(sys.platform.startswith("linux") and os.getpriority(os.PRIO_PROCESS, 0) > 12,
                       reason="the test runner's own nice value leaves no room to lower one by 7"),
]


def _cores(srv: Server) -> list[psutil.Process]:
    """The server's live engine-core processes."""
    alive = []
    for p in srv.children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "tidal.core.core_proc" in " ".join(p.cmdline()):
                alive.append(p)
        except psutil.Error:
            pass  # gone meanwhile
    return alive


def _one_completion(srv: Server) -> int:
    out = srv.client().completions.create(model="tiny", prompt="the sea", max_tokens=5,
                                          extra_body={"ignore_eos": True})
    return out.usage.completion_tokens


def test_priority_module_in_a_fresh_process() -> None:
    """In a process of its own (a nice value cannot be taken back): the calling thread is
    lowered, threads it starts inherit that, a plain Popen child does too, a `popen` child
    does not; the value is capped at 19; 0 changes nothing; a negative increment is refused."""
    script = textwrap.dedent("""
        import json, subprocess, sys, threading
        from tidal.frontend import priority
        base = priority.thread_nice()
        zero = priority.lower_thread_priority(0)
        try:
            priority.lower_thread_priority(-1)
            refused = ""
        except ValueError as e:
            refused = str(e)
        lowered = priority.lower_thread_priority(3)
        now = priority.thread_nice()
        seen = []
        t = threading.Thread(target=lambda: seen.append(priority.thread_nice()))
        t.start(); t.join(10)
        child = [sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"]
        plain = int(subprocess.run(child, capture_output=True, text=True, timeout=60).stdout)
        proc = priority.popen(child, stdout=subprocess.PIPE, text=True)
        spawned = int(proc.communicate(timeout=60)[0])
        capped = priority.lower_thread_priority(50)
        print(json.dumps(dict(base=base, zero=zero, refused=refused, lowered=lowered,
                              now=now, thread=seen[0], plain=plain,
                              spawned=spawned, capped=capped)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    base = got["base"]
    assert got["zero"] is None and "increment >= 0" in got["refused"]
    assert got["lowered"] == got["now"] == min(19, base + 3)
    assert got["thread"] == got["plain"] == got["lowered"]  # what the spawner is there for
    assert got["spawned"] == base
    assert got["capped"] == 19


def test_which_engines_the_loop_yields_to() -> None:
    """yield_to_cpu_engine in a process of its own, cases that must not lower the priority
    first: a headless core, a GPU engine, the user's own OpenMP wait policy (unless
    TIDAL_SERVER_NICE is set), setpriority refused (a warning, and the server goes on)."""
    script = textwrap.dedent("""
        import json, logging, os, types
        from tidal.frontend import priority
        from tidal.frontend.entrypoints.openai.api_server import yield_to_cpu_engine
        warnings = []
        logging.getLogger("tidal.frontend.entrypoints.openai.api_server").addHandler(
            type("H", (logging.Handler,), {"emit": lambda self, r: warnings.append(r.levelname)})())
        def engine(address=None, device="cpu"):
            return types.SimpleNamespace(config=types.SimpleNamespace(core_address=address),
                                         info=types.SimpleNamespace(device=device))
        os.environ.pop("TIDAL_SERVER_NICE", None)
        os.environ.pop("GOMP_SPINCOUNT", None)
        got = {"base": priority.thread_nice()}
        got["headless"] = [yield_to_cpu_engine(engine(address="tcp://127.0.0.1:1"), 5), priority.thread_nice()]
        got["cuda"] = [yield_to_cpu_engine(engine(device="cuda"), 5), priority.thread_nice()]
        os.environ["OMP_WAIT_POLICY"] = "active"
        got["omp"] = [yield_to_cpu_engine(engine(), 5), priority.thread_nice()]
        real, os.setpriority = os.setpriority, lambda *a: (_ for _ in ()).throw(PermissionError("refused"))
        os.environ["TIDAL_SERVER_NICE"] = "5"
        got["refused"] = [yield_to_cpu_engine(engine(), 5), priority.thread_nice(), warnings[:]]
        os.setpriority = real
        got["asked"] = [yield_to_cpu_engine(engine(), 5), priority.thread_nice()]
        print(json.dumps(got))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    base = got["base"]
    assert got["headless"] == got["cuda"] == got["omp"] == [None, base]
    assert got["refused"] == [None, base, ["WARNING"]]
    assert got["asked"] == [base + 5, base + 5]


def test_spawner_call_times_out_and_hands_a_late_result_on() -> None:
    from tidal.utils.process import SpawnerThread

    spawner = SpawnerThread("test-spawner")
    late: list[str] = []
    try:
        with pytest.raises(TimeoutError):
            spawner.call(lambda: time.sleep(0.5) or "started", timeout_s=0.05, on_late=late.append)
        assert spawner.call(lambda: "next", timeout_s=30.0) == "next"  # queued behind the slow one
        assert late == ["started"]
        with pytest.raises(ZeroDivisionError):
            spawner.call(lambda: 1 // 0, timeout_s=30.0)
    finally:
        spawner.release()


def test_server_loop_is_nicer_than_its_core_also_after_a_restart(tiny_model_dir: str,
                                                                  tidal_cache_dir: str) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    srv = Server(tiny_model_dir, FLAGS, tidal_cache_dir, env={"TIDAL_SERVER_NICE": "7"})
    try:
        assert psutil.Process(srv.proc.pid).nice() == min(19, base + 7)
        (core,) = _cores(srv)
        assert core.nice() == base
        assert _one_completion(srv) == 5
        core.kill()  # the front-end starts a replacement (from a thread at the lowered priority)
        wait_for(lambda: [p.pid for p in _cores(srv)] not in ([], [core.pid]), 60.0, "a replacement core")
        (replacement,) = _cores(srv)
        assert replacement.nice() == base
        assert _one_completion(srv) == 5  # and it serves
        assert psutil.Process(srv.proc.pid).nice() == min(19, base + 7)
    finally:
        srv.stop()


def test_server_nice_zero_keeps_the_priority(tiny_model_dir: str, tidal_cache_dir: str) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    srv = Server(tiny_model_dir, FLAGS, tidal_cache_dir, env={"TIDAL_SERVER_NICE": "0"})
    try:
        assert psutil.Process(srv.proc.pid).nice() == base
        assert [p.nice() for p in _cores(srv)] == [base]
        assert _one_completion(srv) == 5
    finally:
        srv.stop()


@pytest.mark.parametrize("value", ["20", "-1", "ten"])
def test_bad_server_nice_is_refused_at_start(tiny_model_dir: str, tidal_cache_dir: str,
                                                        value: str) -> None:
    env = {**os.environ, "TIDAL_CACHE_DIR": tidal_cache_dir, "TIDAL_SERVER_NICE": value}
    out = subprocess.run([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "serve", tiny_model_dir, *FLAGS,
                          "--port", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"TIDAL_SERVER_NICE must be an integer in [0, 19], got '{value}'" in out.stderr
