"""distributed_executor_backend="ray": the tensor-parallel ranks as Ray actors on a private
local Ray cluster (two CPU "nodes" worth of bundles on this host).

- TP=2 on Ray is token-identical (logprobs within 1e-4) to TP=1 in one process, greedy and
  seeded, with chunked prefill, prefix hits and preemption in the same run.
- A rank's actor SIGKILLed mid-generation fails the step with WorkerFailure naming the rank
  within a bound; the engine shuts down and leaves no Ray process behind.
- Through LLM (the core in its own process) as a user would write it.
- Refusals: a cluster too small for the TP size, and an unknown backend.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest

pytest.importorskip("ray")

from conftest import RAY_TMPDIR  # noqa: E402
from engine_utils import step_outputs  # noqa: E402
from tidal.core.engine_core import EngineCore  # noqa: E402
from tidal.core.ray_executor import RayExecutor, WorkerFailure  # noqa: E402
from tidal.protocol import EngineConfig, SamplingParams  # noqa: E402
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest  # noqa: E402

LOGPROB_ATOL = 1e-4
KILL_DEADLINE_S = 30.0
ENGINE_KWARGS = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=96,
                     max_num_batched_tokens=24, max_num_seqs=6, enable_prefix_caching=True,
                     engine_start_timeout_s=120.0, worker_step_timeout_s=60.0, device="cpu")
PREFIX = [(7 * i + 11) % 480 + 20 for i in range(16)]
PROMPTS = [PREFIX + [(13 * j + 5 * k) % 480 + 20 for k in range(n)] for j, n in enumerate([5, 30, 9, 17])]
MAX_TOKENS = [16, 12, 20, 14]
_RAY_DAEMONS = ("raylet", "gcs_server", "ray::")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> str:
    from tidal.frontend.entrypoints.make_model import make_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        return make_model(str(tmp_path_factory.mktemp("ray-llama")), "llama", hidden_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, vocab_size=512, seed=5)


def _request(i: int) -> EngineCoreRequest:
    seeded = i % 2 == 1  # odd ones sample at temperature 0.8 with a seed
    params = SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.8 if seeded else 0.0,
                            seed=100 + i if seeded else None, logprobs=2, ignore_eos=True)
    return EngineCoreRequest(f"r{i}", list(PROMPTS[i]), params)


def _run(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}

    def collect(outs: list[EngineCoreOutput]) -> None:
        for o in outs:
            assert o.error is None, o.error
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.new_logprobs is not None:
                logprobs.setdefault(o.request_id, []).extend(o.new_logprobs.logprobs[:, 0].tolist())

    core.add_request(_request(0))
    while not tokens.get("r0"):  # r0's prefix blocks are cached before the others arrive
        collect(step_outputs(core))
    for i in range(1, len(PROMPTS)):
        core.add_request(_request(i))
    for _ in range(1000):
        if not core.has_unfinished_requests():
            break
        collect(step_outputs(core))
    assert not core.has_unfinished_requests()
    return tokens, logprobs


def _ray_daemons() -> list[psutil.Process]:
    """This test process's Ray daemons and workers (those of its RAY_TMPDIR, see conftest),
    not another pytest-xdist worker's."""
    found = []
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
            if any(marker in text for marker in _RAY_DAEMONS) and p.environ().get("RAY_TMPDIR") == RAY_TMPDIR:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _wait_no_ray_daemons(timeout_s: float = 30.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    left = _ray_daemons()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return left


@pytest.fixture(scope="module")
def reference(model_dir: str) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    core = EngineCore(EngineConfig(model=model_dir, tensor_parallel_size=1, **ENGINE_KWARGS))
    try:
        return _run(core)
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def ray_core(model_dir: str) -> Any:
    if _ray_daemons():
        pytest.skip("a Ray cluster is already running on this machine; these tests start their own")
    core = EngineCore(EngineConfig(model=model_dir, tensor_parallel_size=2, distributed_executor_backend="ray",
                                   **ENGINE_KWARGS))
    yield core
    core.shutdown()


def test_tp2_on_ray_is_token_identical_to_tp1(ray_core: EngineCore, reference: Any) -> None:
    assert isinstance(ray_core.executor, RayExecutor)
    pids = {a.pid.remote() for a in ray_core.executor.actors}
    assert len(set(ray_core.executor.ray.get(list(pids)))) == 2  # two processes, one per rank
    tokens, logprobs = _run(ray_core)
    ref_tokens, ref_logprobs = reference
    assert tokens == ref_tokens
    for rid, values in ref_logprobs.items():
        assert logprobs[rid] == pytest.approx(values, abs=LOGPROB_ATOL)


def test_cluster_too_small_is_refused_naming_both_sizes(ray_core: EngineCore, model_dir: str) -> None:
    have = ray_core.executor.ray.cluster_resources().get("CPU", 0)
    too_many = int(have) + 1
    executor = RayExecutor(EngineConfig(model=model_dir, tensor_parallel_size=too_many,
                                        distributed_executor_backend="ray", **ENGINE_KWARGS))
    with pytest.raises(ValueError, match=f"tensor_parallel_size={too_many} needs {too_many} CPU"):
        executor.initialize()
    assert executor.actors == []


def test_killed_rank_fails_the_step_naming_it_and_leaves_nothing(ray_core: EngineCore) -> None:
    executor = ray_core.executor
    ray = executor.ray
    rank1_pid = ray.get(executor.actors[1].pid.remote())
    ray_core.add_request(_request(2))
    step_outputs(ray_core)  # the request is running
    os.kill(rank1_pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure, match="worker rank 1") as info:
        for _ in range(100):
            step_outputs(ray_core)
    assert time.monotonic() - t0 < KILL_DEADLINE_S, info.value
    with pytest.raises(WorkerFailure):  # and on every later call, the same error
        executor.execute_model(None)  # type: ignore[arg-type]
    ray_core.shutdown()
    assert _wait_no_ray_daemons() == []


def test_llm_with_ray_backend_matches_one_process(model_dir: str, reference: Any) -> None:
    if _ray_daemons():
        pytest.skip("a Ray cluster is still running")
    from tidal import LLM
    from tidal.inputs import TokensPrompt

    llm = LLM(model=model_dir, tensor_parallel_size=2, distributed_executor_backend="ray",
              dtype="float32", block_size=4, max_model_len=96, enable_prefix_caching=True)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS[0], temperature=0.0, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], params, use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == reference[0]["r0"]
    finally:
        llm.shutdown()
    assert _wait_no_ray_daemons() == []


def test_refusals(model_dir: str) -> None:
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineConfig(model=model_dir, distributed_executor_backend="external_launcher")
    from tidal.frontend.engine_args import EngineArgs

    with pytest.raises(ValueError, match="external_launcher"):
        EngineArgs(model=model_dir, distributed_executor_backend="external_launcher").create_engine_config()
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        EngineCore(EngineConfig(model=model_dir, tensor_parallel_size=2, distributed_executor_backend="uni",
                                **ENGINE_KWARGS))
