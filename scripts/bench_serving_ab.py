"""Two `tidal serve` configurations, A and B, on the same streamed workloads in one run.

    python scripts/bench_serving_ab.py [--a-env K=V] [--b-env K=V] [--a-args "..."] [--b-args "..."]
        [--repeats 6] [bench_serving.py's workload flags] [engine args for both]

This machine's speed drifts by tens of percent within minutes, so two bench_serving.py runs
taken apart cannot tell a 5% change from the drift. Here both servers are up at once (the idle
one's engine waits on its socket and takes no CPU) and each workload runs on A and on B back
to back, in ABBA order so that a drift favours neither. Printed: output tok/s, CPU seconds
(client, front-end, engine core), mean TTFT, TPOT and ITL, and SSE chunks per token (below 1:
tokens arrived merged, a consumer having lagged) of every run, then B / A of output tok/s per
workload and its median. Each side has the same warm-up as bench_serving.py. Both servers are stopped and
reaped on every path.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import tempfile
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import (  # noqa: E402
    add_workload_args,
    check_workload_args,
    compute_metrics,
    make_workloads,
    prepare,
    run_client,
    start_server,
    stop_server,
    wait_healthy,
)


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"error: expected NAME=VALUE, got {item!r}")
        env[name] = value
    return env


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False, epilog="Every other flag is an engine arg for both servers.")
    p.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE", help="server A's environment")
    p.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE", help="server B's environment")
    p.add_argument("--a-args", default="", help="more `tidal serve` arguments for A only (one string)")
    p.add_argument("--b-args", default="", help="more `tidal serve` arguments for B only (one string)")
    add_workload_args(p, repeats=6, repeats_help="workloads, each run on A and on B")
    args, engine_argv = p.parse_known_args()
    check_workload_args(p, args)
    return args, engine_argv


class Side(NamedTuple):
    name: str
    env: dict[str, str]  # set for its server on top of this process's
    extra: str  # more `tidal serve` arguments (one string)
    cpus: list[int] | None = None  # its server (and what it starts) pinned to these CPUs


def run_sides(args: argparse.Namespace, engine_argv: list[str], specs: list[Side]) -> list[dict[str, float]]:
    """Every side's server up at once, each workload run on each side in turn (the order
    reversed every other workload: a drift favours none); output tok/s per side per workload."""
    from tidal.utils.network import free_port

    sides: list[tuple[str, str, Any]] = []  # (name, base url, process)
    logs = []
    try:
        for spec in specs:
            port = free_port()
            log = tempfile.NamedTemporaryFile(prefix=f"tidal-serve-{spec.name}-", suffix=".log", delete=False)
            logs.append(log)
            argv = [*engine_argv, *shlex.split(spec.extra)]
            proc = start_server(args.model, port, argv, log, spec.env)
            if spec.cpus is not None:  # before it starts its core: that inherits the set
                os.sched_setaffinity(proc.pid, spec.cpus)
            sides.append((spec.name, f"http://127.0.0.1:{port}", proc))
        warmups, workloads = make_workloads(args)
        for _, base, proc in sides:
            asyncio.run(wait_healthy(base, proc, args.ready_timeout))
            for requests in warmups:
                asyncio.run(run_client(base, requests, args, proc.pid))
        rows = []
        for i, requests in enumerate(workloads):
            rates = {}
            for name, base, proc in (sides if i % 2 == 0 else sides[::-1]):
                results, duration, cpu = asyncio.run(run_client(base, requests, args, proc.pid))
                if errors := [r.error for r in results if not r.success]:
                    raise RuntimeError(f"server {name}: {len(errors)} requests failed; first: {errors[0]}")
                m = compute_metrics(results, requests, duration)
                rates[name] = m["output_throughput"]
                chunks = (len(m["itl"]) + len(m["ttft"])) / max(1, m["output_tokens"])
                ttft, tpot, itl = (1e3 * statistics.fmean(m[k] or [0.0]) for k in ("ttft", "tpot", "itl"))
                print(f"workload {i} server {name}: {rates[name]:.1f} output tok/s; CPU s: client {cpu[0]:.2f}, "
                      f"front-end {cpu[1]:.2f}, engine core {cpu[2]:.2f}; mean ms: TTFT {ttft:.0f}, "
                      f"TPOT {tpot:.1f}, ITL {itl:.1f}; chunks per token {chunks:.2f}", flush=True)
            rows.append(rates)
        return rows
    except BaseException:
        for log in logs:  # kept: what the failing server said
            log.close()
            print(f"server log kept: {log.name}", file=sys.stderr)
        logs.clear()
        raise
    finally:
        for _, _, proc in sides:
            stop_server(proc)
        for log in logs:
            log.close()
            os.unlink(log.name)


def run(args: argparse.Namespace, engine_argv: list[str]) -> list[tuple[float, float]]:
    """(A's output tok/s, B's) per workload."""
    rows = run_sides(args, engine_argv, [Side("A", parse_env(args.a_env), args.a_args),
                                         Side("B", parse_env(args.b_env), args.b_args)])
    return [(r["A"], r["B"]) for r in rows]


def main() -> None:
    args, engine_argv = parse_args()
    prepare(args)
    pairs = run(args, engine_argv)
    ratios = [b / a for a, b in pairs]
    print(f"A: {' '.join(args.a_env + [args.a_args]).strip() or '(as is)'}   "
          f"B: {' '.join(args.b_env + [args.b_args]).strip() or '(as is)'}")
    print(f"B / A output tok/s per workload: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
