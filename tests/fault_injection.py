"""Test-only tensor-parallel worker: tidal's worker process with one fault injected.

`use_faulty_workers(monkeypatch, "1:3")` makes MultiprocExecutor start its ranks as
`python tests/fault_injection.py 1:3 <worker_proc arguments>` instead of
`python -m tidal.worker.worker_proc ...`. The spec "RANK:STEP" makes that rank raise when it
receives its STEP-th step (1-based); "RANK:STEP:hang" makes it stop answering instead. The
fault wraps `Worker.execute_model`, which the worker loop calls once per step, so the
production loop carries no test branch.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from tidal.protocol.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:  # the worker process imports neither
    import pytest


def worker_entry(spec: str) -> tuple[str, ...]:
    """The `MultiprocExecutor.worker_entry` that starts this script with `spec`."""
    return (os.path.abspath(__file__), spec)


def use_faulty_workers(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    from tidal.core.multiproc_executor import MultiprocExecutor

    monkeypatch.setattr(MultiprocExecutor, "worker_entry", worker_entry(spec))


def install(spec: str, rank: int) -> None:
    from tidal.worker.worker import Worker

    fault_rank, fault_step, *mode = spec.split(":")
    if int(fault_rank) != rank:
        return
    execute_model = Worker.execute_model
    steps = 0

    def faulty_execute_model(self: Worker, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        nonlocal steps
        steps += 1
        if steps == int(fault_step):
            if mode == ["hang"]:
                while True:  # the probe thread still answers: "in step N, not in a collective"
                    time.sleep(3600)
            raise RuntimeError(f"injected failure at step {steps}")
        return execute_model(self, scheduler_output)

    Worker.execute_model = faulty_execute_model  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    from tidal.worker import worker_proc

    spec, args = argv[0], argv[1:]
    install(spec, int(args[args.index("--rank") + 1]))
    worker_proc.main(args)  # never returns: the worker ends with os._exit


if __name__ == "__main__":
    main(sys.argv[1:])
