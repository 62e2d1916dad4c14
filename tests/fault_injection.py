"""Test-only tensor-parallel worker: tidal's worker process with one fault injected.

`use_faulty_workers(monkeypatch, "1:3")` makes MultiprocExecutor start its ranks as
`python tests/fault_injection.py 1:3 <worker_proc arguments>` instead of
`python -m tidal.worker.worker_proc ...`. The spec "RANK:STEP" makes that rank raise when it
receives its STEP-th step (1-based); "RANK:STEP:hang" makes it stop answering instead;
"RANK:poison:TOKEN" makes it SIGKILL itself in any step that starts a request whose prompt
holds TOKEN (a request that crashes a worker every time it runs). The fault wraps `Worker.execute_model`, which the worker loop calls once per step, so the
production loop carries no test branch.

Per-request faults (tests/test_isolation.py): `use_sampling_fault(monkeypatch, TOKEN)` makes
`ModelRunner._sample` raise for any batch that samples a request whose prompt holds TOKEN (as
a request whose index broke the sampler would), `use_prompt_logprobs_fault(monkeypatch, TOKEN)`
makes the runner's prompt-logprob computation raise for a prompt chunk that scores TOKEN, and
`use_update_fault(monkeypatch, TOKEN)` makes the scheduler's per-request update raise for such a
request. For an engine core in a process of its own,
`python tests/fault_injection.py core:sample:TOKEN <core_proc arguments>` runs
`tidal.core.core_proc` with the sampling fault installed (`core_command`), and
`core:workers:SPEC` runs it with its workers started with the worker fault SPEC
(`use_faulty_workers_in_spawned_cores`).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from tidal.protocol.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:  # the worker process imports neither
    import pytest


def worker_entry(spec: str) -> tuple[str, ...]:
    """The `MultiprocExecutor.worker_entry` that starts this script with `spec`."""
    return (os.path.abspath(__file__), spec)


def use_faulty_workers(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    from tidal.core.multiproc_executor import MultiprocExecutor

    monkeypatch.setattr(MultiprocExecutor, "worker_entry", worker_entry(spec))


def use_faulty_workers_in_spawned_cores(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    """`use_faulty_workers` for the engine cores a front-end spawns (processes of their own,
    which a monkeypatch here does not reach): each runs `tidal.core.core_proc` with its
    workers started as this script with `spec`."""
    from tidal.frontend.core_process import CoreProcess

    monkeypatch.setattr(CoreProcess, "core_entry", (os.path.abspath(__file__), f"core:workers:{spec}"))


def faulty_sample(sample: Callable[..., None], token_id: int) -> Callable[..., None]:
    """`ModelRunner._sample` that raises when a sampled row's prompt holds `token_id`."""

    def _sample(self: Any, batch: Any, logits: Any, out: ModelRunnerOutput) -> None:
        for i in batch.sample_rows:
            st = self.requests[batch.req_ids[i]]
            if token_id in st.token_ids[: st.num_prompt_tokens]:
                raise IndexError(f"injected sampling failure (a prompt holds token {token_id})")
        sample(self, batch, logits, out)

    return _sample


def use_sampling_fault(monkeypatch: pytest.MonkeyPatch, token_id: int) -> None:
    from tidal.worker.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "_sample", faulty_sample(ModelRunner._sample, token_id))


def use_prompt_logprobs_fault(monkeypatch: pytest.MonkeyPatch, token_id: int) -> None:
    """The model runner's prompt-logprob computation (called once per request and chunk) raises
    when the prompt tokens it scores hold `token_id` (a prompt's first token is never scored)."""
    from tidal.worker import logprobs

    compute = logprobs.compute_prompt_logprobs

    def _compute(logits: Any, target_token_ids: Any, k: int) -> Any:
        if token_id in target_token_ids.tolist():
            raise IndexError(f"injected prompt logprobs failure (a prompt holds token {token_id})")
        return compute(logits, target_token_ids, k)

    monkeypatch.setattr(logprobs, "compute_prompt_logprobs", _compute)


def use_update_fault(monkeypatch: pytest.MonkeyPatch, token_id: int) -> None:
    """The scheduler's stop check (run while building a request's output) raises for a request
    whose prompt holds `token_id`, after the first token was appended to it."""
    from tidal.core.scheduler import Scheduler

    check = Scheduler._append_and_check_stop

    def _append_and_check_stop(self: Scheduler, request: Any, token_ids: list[int]) -> list[int]:
        kept = check(self, request, token_ids)
        if token_id in request.prompt_token_ids:
            raise KeyError(f"injected update failure (a prompt holds token {token_id})")
        return kept

    monkeypatch.setattr(Scheduler, "_append_and_check_stop", _append_and_check_stop)


def core_command(token_id: int) -> list[str]:
    """argv prefix of an engine-core process with the sampling fault for `token_id` (append
    core_proc's own arguments)."""
    return [sys.executable, os.path.abspath(__file__), f"core:sample:{token_id}"]


def install(spec: str, rank: int) -> None:
    from tidal.worker.worker import Worker

    fault_rank, fault_step, *mode = spec.split(":")
    if int(fault_rank) != rank:
        return
    execute_model = Worker.execute_model
    steps = 0
    if fault_step == "poison":
        token_id = int(mode[0])

        def poisoned_execute_model(self: Worker, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
            if any(token_id in new.prompt_token_ids for new in scheduler_output.scheduled_new_reqs):
                os.kill(os.getpid(), signal.SIGKILL)
            return execute_model(self, scheduler_output)

        Worker.execute_model = poisoned_execute_model  # type: ignore[method-assign]
        return

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
    if spec.startswith("core:workers:"):
        from tidal.core import core_proc
        from tidal.core.multiproc_executor import MultiprocExecutor

        MultiprocExecutor.worker_entry = worker_entry(spec[len("core:workers:"):])
        core_proc.main(args)  # exits
        return
    if spec.startswith("core:sample:"):
        from tidal.core import core_proc
        from tidal.worker.model_runner import ModelRunner

        token_id = int(spec.rsplit(":", 1)[1])
        ModelRunner._sample = faulty_sample(ModelRunner._sample, token_id)  # type: ignore[method-assign]
        core_proc.main(args)  # exits
        return
    install(spec, int(args[args.index("--rank") + 1]))
    worker_proc.main(args)  # never returns: the worker ends with os._exit


if __name__ == "__main__":
    main(sys.argv[1:])
