"""Data parallelism's scaling on one host: bench_serving.py's streamed workload through DP=1 and
DP=2 with the same total cores, from one run.

    python scripts/bench_dp.py [--repeats 4] [bench_serving.py's workload flags] [engine args]

Three `tidal serve` servers are up at once and each workload runs on each in turn (the order
reversed every other workload, as bench_serving_ab.py does):
  - "DP=1-half": one engine pinned to half the CPUs (the share each DP=2 engine gets);
  - "DP=1": one engine on all the CPUs;
  - "DP=2": `-dp 2`, two engines, each pinned to its half by the engine itself.
Printed per workload and as medians: DP=2 / DP=1 output tok/s (what a user gains by turning DP
on over the same cores), and the scaling efficiency DP=2 / (2 x DP=1-half) (1.0: two engines
do twice what one does on their share; below it, what routing, the front-end and the shared
memory bandwidth cost). With `--model-runner null` the engines compute nothing and the figures
show the routing and front-end overhead alone.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import add_workload_args, check_workload_args, prepare  # noqa: E402
from bench_serving_ab import Side, run_sides  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False, epilog="Every other flag is an engine arg for every server.")
    add_workload_args(p, repeats=4, repeats_help="workloads, each run on every server")
    args, engine_argv = p.parse_known_args()
    check_workload_args(p, args)
    prepare(args)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("error: DP=2 needs at least 2 CPUs")
    half = cpus[:len(cpus) // 2]
    rows = run_sides(args, engine_argv, [Side("DP=1-half", {}, "", half), Side("DP=1", {}, ""),
                                         Side("DP=2", {}, "--data-parallel-size 2")])
    gain = [r["DP=2"] / r["DP=1"] for r in rows]
    efficiency = [r["DP=2"] / (2 * r["DP=1-half"]) for r in rows]
    print(f"CPUs: {len(cpus)} (DP=1-half pinned to {half})")
    for name in ("DP=1-half", "DP=1", "DP=2"):
        print(f"{name}: median {statistics.median(r[name] for r in rows):.1f} output tok/s")
    print(f"DP=2 / DP=1 output tok/s per workload: {', '.join(f'{g:.3f}' for g in gain)}; "
          f"median {statistics.median(gain):.3f}")
    print(f"scaling efficiency DP=2 / (2 x DP=1-half) per workload: {', '.join(f'{e:.3f}' for e in efficiency)}; "
          f"median {statistics.median(efficiency):.3f}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
