"""Tensor parallelism on CPU (gloo): one worker process per rank behind MultiprocExecutor.

- TP=2 is token-identical to TP=1 (logprobs within 1e-4) for a Llama and a Qwen3 shape (the
  Qwen3 one with a single KV head, fewer than ranks), with chunked prefill, prefix-cache hits
  and preemption all happening in the same run.
- Two TP=2 engines on one host, created in threads that end, generate side by side.
- Failures name the rank: a forward exception, a SIGKILLed rank mid-generation, a rank that
  hangs past worker_step_timeout_s, a bad model dir or a rank killed during start-up. Nothing
  survives: no worker process, no ipc directory. Workers die with their core, even while
  blocked inside a collective.
- Through the front-ends (AsyncLLM, LLM) when they are there.
"""
from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

import numpy as np
import psutil
import pytest

from engine_utils import step_outputs
from fault_injection import use_faulty_workers, worker_entry
from tidal.core.engine_core import EngineCore
from tidal.core.multiproc_executor import MultiprocExecutor, WorkerFailure
from tidal.protocol import EngineConfig, SamplingParams
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, SchedulerOutput

LOGPROB_ATOL = 1e-4
KILL_DEADLINE_S = 10.0

# name -> make_model kwargs
MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  vocab_size=512, seed=3),
    # one KV head for two ranks: replicated on both
    "qwen3-kv1": dict(arch="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1,
                      vocab_size=512, seed=4),
}

# Small budget (chunked prefill), block_size 4 and a pool that cannot hold every request at
# once (preemption), prefix caching on.
ENGINE_KWARGS = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=96,
                     max_num_batched_tokens=24, max_num_seqs=6, enable_prefix_caching=True,
                     engine_start_timeout_s=90.0, worker_step_timeout_s=60.0, device="cpu")

PREFIX = [(7 * i + 11) % 480 + 20 for i in range(16)]  # 4 full blocks shared by every prompt
PROMPTS = [PREFIX + [(13 * j + 5 * k) % 480 + 20 for k in range(n)]
           for j, n in enumerate([5, 30, 9, 17, 2, 23])]
MAX_TOKENS = [20, 14, 24, 18, 22, 16]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> dict[str, str]:
    from tidal.frontend.entrypoints.make_model import make_model

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        for name, kw in MODELS.items():
            kw = dict(kw)
            out[name] = make_model(str(tmp_path_factory.mktemp(f"tp-{name}")), kw.pop("arch"), **kw)
    return out


def make_core(model: str, tp: int, **overrides: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=model, tensor_parallel_size=tp, **{**ENGINE_KWARGS, **overrides}))


def request(rid: str, prompt: list[int], max_tokens: int, logprobs: int | None = 3) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(prompt), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True))


def run_workload(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, np.ndarray], dict[str, np.ndarray], Any]:
    """Request 0 first (its prefix blocks get cached), then the rest at once: prefix hits,
    chunked prefills and preemptions. Returns tokens, logprob ids/values per request, stats."""
    tokens: dict[str, list[int]] = {}
    lp_ids: dict[str, list[np.ndarray]] = {}
    lp_vals: dict[str, list[np.ndarray]] = {}

    def collect(outs: list[EngineCoreOutput]) -> None:
        for o in outs:
            assert o.error is None, o.error
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.new_logprobs is not None:
                lp_ids.setdefault(o.request_id, []).append(o.new_logprobs.token_ids)
                lp_vals.setdefault(o.request_id, []).append(o.new_logprobs.logprobs)

    assert core.add_request(request("r0", PROMPTS[0], MAX_TOKENS[0])) is None
    while not tokens.get("r0"):
        collect(step_outputs(core))
    for i in range(1, len(PROMPTS)):
        assert core.add_request(request(f"r{i}", PROMPTS[i], MAX_TOKENS[i])) is None
    for _ in range(1000):
        if not core.has_unfinished_requests():
            break
        collect(step_outputs(core))
    assert not core.has_unfinished_requests()
    stats = core.scheduler.make_stats()
    return (tokens, {k: np.concatenate(v) for k, v in lp_ids.items()},
            {k: np.concatenate(v) for k, v in lp_vals.items()}, stats)


@pytest.fixture(scope="module")
def tp1_reference(model_dirs: dict[str, str]) -> dict[str, Any]:
    ref = {}
    for name, path in model_dirs.items():
        core = make_core(path, 1)
        try:
            ref[name] = run_workload(core)
        finally:
            core.shutdown()
    return ref


_PROCESS_MARKERS = ("tidal.worker.worker_proc", "tidal.core.core_proc", "fault_injection.py")


def worker_procs(marker: str | None = None) -> list[psutil.Process]:
    """Live worker and core processes that are children of this process (or, with `marker`,
    any on the machine whose command line holds it, e.g. a test-unique model path); workers
    started by tests/fault_injection.py count too."""
    if marker is None:
        candidates = psutil.Process().children(recursive=True)
    else:
        candidates = list(psutil.process_iter())
    alive = []
    for p in candidates:
        try:
            cmd = " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and any(m in cmd for m in _PROCESS_MARKERS) and (
                    marker is None or marker in cmd):
                alive.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return alive


def rank_proc(core: EngineCore, rank: int) -> psutil.Process:
    executor = core.executor
    assert isinstance(executor, MultiprocExecutor)
    return psutil.Process(executor.procs[rank].pid)


def ipc_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "tidal-workers-*")))


@pytest.fixture
def no_leaks() -> Any:
    """Fails the test if it leaves a worker process or a worker ipc directory behind."""
    dirs_before = ipc_dirs()
    yield
    left = worker_procs()
    for p in left:
        p.kill()
    assert not left, f"processes left running: {[' '.join(p.cmdline())[:120] for p in left]}"
    assert not (ipc_dirs() - dirs_before), f"ipc dirs left: {ipc_dirs() - dirs_before}"


def step_until_error(core: EngineCore, deadline_s: float) -> tuple[BaseException, float]:
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        while time.monotonic() - t0 < deadline_s:
            core.step()
    return info.value, time.monotonic() - t0


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_matches_tp1(name: str, model_dirs: dict[str, str], tp1_reference: dict[str, Any],
                         no_leaks: None) -> None:
    ref_tokens, ref_ids, ref_vals, ref_stats = tp1_reference[name]
    core = make_core(model_dirs[name], 2)
    executor = core.executor
    try:
        assert isinstance(executor, MultiprocExecutor) and len(executor.procs) == 2
        ipc = executor.ipc_path
        assert ipc is not None and os.path.isdir(ipc) and (os.stat(ipc).st_mode & 0o777) == 0o700
        tokens, ids, vals, stats = run_workload(core)
    finally:
        core.shutdown()
    # shutdown: idempotent, every worker exited cleanly (not killed) and was reaped, no ipc dir
    core.shutdown()
    assert not os.path.exists(ipc)
    assert [p.returncode for p in executor.procs] == [0, 0]
    assert not worker_procs()
    with pytest.raises(EngineDeadError):
        executor.execute_model(SchedulerOutput())
    # Everything the test claims to cover actually happened, in both runs.
    for s in (ref_stats, stats):
        assert s.num_preemptions > 0, s
        assert s.prefix_cache_hits >= len(PREFIX), s
    assert max(len(p) for p in PROMPTS) > ENGINE_KWARGS["max_num_batched_tokens"]  # chunked
    assert tokens == ref_tokens
    assert all(len(tokens[f"r{i}"]) == n for i, n in enumerate(MAX_TOKENS))
    for rid in ref_ids:
        np.testing.assert_array_equal(ids[rid], ref_ids[rid])
        np.testing.assert_allclose(vals[rid], ref_vals[rid], atol=LOGPROB_ATOL, rtol=0)


def test_two_engines_side_by_side(model_dirs: dict[str, str], tp1_reference: dict[str, Any],
                                  no_leaks: None) -> None:
    """Two TP=2 engines on one host, each created and driven in its own thread (which then
    ends: the workers must outlive the thread that spawned them)."""
    path = model_dirs["llama"]
    cores: list[EngineCore | None] = [None, None]
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            cores[i] = core = make_core(path, 2)
            results[i] = run_workload(core)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
        assert not errors, errors
        ref_tokens = tp1_reference["llama"][0]
        assert results[0][0] == ref_tokens and results[1][0] == ref_tokens
        pids = [{p.pid for p in c.executor.procs} for c in cores]  # type: ignore[union-attr]
        assert not pids[0] & pids[1] and all(len(p) == 2 for p in pids)
        # The spawning threads are gone; the workers still serve.
        for core in cores:
            assert core is not None
            core.add_request(request("again", PROMPTS[2], 4))
            out: list[int] = []
            while core.has_unfinished_requests():
                out += [t for o in step_outputs(core) for t in o.new_token_ids]
            assert out == ref_tokens["r2"][:4]
    finally:
        for core in cores:
            if core is not None:
                core.shutdown()


# ------------------------------------------------------------------------------ failures


def test_killed_worker_mid_generation(model_dirs: dict[str, str], no_leaks: None) -> None:
    core = make_core(model_dirs["llama"], 2)
    try:
        ipc = core.executor.ipc_path  # type: ignore[attr-defined]
        for i in range(4):
            core.add_request(request(f"k{i}", PROMPTS[i], 60, logprobs=None))
        for _ in range(5):
            core.step()
        victim = rank_proc(core, 1)
        victim.send_signal(signal.SIGKILL)
        err, took = step_until_error(core, KILL_DEADLINE_S)
        assert isinstance(err, WorkerFailure)
        assert "rank 1" in str(err) and "SIGKILL" in str(err), str(err)
        assert took < KILL_DEADLINE_S
        # Every other worker was stopped with the failure, not at shutdown.
        assert not worker_procs()
        with pytest.raises(EngineDeadError, match="rank 1"):
            core.step()
    finally:
        core.shutdown()
    core.shutdown()  # idempotent
    assert ipc is not None and not os.path.exists(ipc)


def test_injected_forward_exception(model_dirs: dict[str, str], no_leaks: None,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    use_faulty_workers(monkeypatch, "1:3")
    core = make_core(model_dirs["qwen3-kv1"], 2)
    try:
        for i in range(2):
            core.add_request(request(f"x{i}", PROMPTS[i], 30))
        err, took = step_until_error(core, KILL_DEADLINE_S)
        msg = str(err)
        assert "worker rank 1 failed in step 3" in msg, msg
        assert "RuntimeError: injected failure at step 3" in msg, msg
        assert not worker_procs()
    finally:
        core.shutdown()


def test_step_timeout_names_the_stuck_rank(model_dirs: dict[str, str], no_leaks: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    use_faulty_workers(monkeypatch, "1:2:hang")
    core = make_core(model_dirs["llama"], 2, worker_step_timeout_s=2.0)
    try:
        core.add_request(request("t0", PROMPTS[0], 10))
        err, took = step_until_error(core, 30.0)
        msg = str(err)
        assert "rank 1" in msg and "worker_step_timeout_s=2.0" in msg, msg
        assert took < 2.0 + KILL_DEADLINE_S
        assert not worker_procs()
    finally:
        core.shutdown()


def test_bad_model_dir_reports_the_workers_error(tmp_path: Any, no_leaks: None) -> None:
    bad = str(tmp_path / "no-such-model")
    with pytest.raises(WorkerFailure) as info:
        make_core(bad, 2, model_runner="torch")
    msg = str(info.value)
    assert "during start-up" in msg and "does not exist" in msg and bad in msg, msg


def test_rank_killed_during_startup(model_dirs: dict[str, str], no_leaks: None) -> None:
    killed: list[int] = []
    stop = threading.Event()

    def killer() -> None:  # SIGKILL rank 1 one second into its start-up (importing, loading)
        while not stop.is_set():
            for p in worker_procs():
                try:
                    if "--rank 1" in " ".join(p.cmdline()) and time.time() - p.create_time() > 1.0:
                        p.kill()
                        killed.append(p.pid)
                        return
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.01)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerFailure) as info:
            make_core(model_dirs["llama"], 2)
    finally:
        stop.set()
        t.join()
    assert killed
    msg = str(info.value)
    assert "worker rank 1 died during start-up" in msg and "SIGKILL" in msg, msg
    assert time.monotonic() - t0 < 60


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # a zombie is dead, just not reaped yet
    except psutil.NoSuchProcess:
        return False


_CORE_SCRIPT = textwrap.dedent("""
    import sys, time
    from tidal.core.engine_core import EngineCore
    from tidal.core.multiproc_executor import MultiprocExecutor
    from tidal.protocol import EngineConfig, SamplingParams
    MultiprocExecutor.worker_entry = tuple(sys.argv[2:])  # tests/fault_injection.py
    from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, SchedulerOutput
    core = EngineCore(EngineConfig(model=sys.argv[1], tensor_parallel_size=2, dtype="float32",
                                   num_kv_blocks=40, max_model_len=96, device="cpu",
                                   engine_start_timeout_s=90, worker_step_timeout_s=600))
    print("PIDS", *[p.pid for p in core.executor.procs], flush=True)
    core.add_request(EngineCoreRequest("a", [5, 6, 7], SamplingParams(max_tokens=50)))
    while True:
        print("STEP", flush=True)
        core.step()
""")


def test_workers_die_with_the_core_even_inside_a_collective(model_dirs: dict[str, str]) -> None:
    """Rank 1 hangs at step 2, so rank 0 sits inside a gloo collective; SIGKILL the core:
    PR_SET_PDEATHSIG must take both workers down at once."""
    core = subprocess.Popen([sys.executable, "-c", _CORE_SCRIPT, model_dirs["llama"], *worker_entry("1:2:hang")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert core.stdout is not None
        line = core.stdout.readline()
        assert line.startswith("PIDS"), line
        workers = [psutil.Process(int(p)) for p in line.split()[1:]]
        steps = 0
        while steps < 2:
            steps += core.stdout.readline().startswith("STEP")
        time.sleep(1.0)  # rank 0 is now blocked in the all-reduce rank 1 never joins
        assert all(_running(w) for w in workers)
        core.kill()
        core.wait(10)
        deadline = time.monotonic() + 5.0
        alive = workers
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [w for w in alive if _running(w)]
        assert not alive, f"workers outlived their core: {[p.pid for p in alive]}"
    finally:
        if core.poll() is None:
            core.kill()
            core.wait()


# ---------------------------------------------------------------------------- front-ends


def _frontend(name: str) -> Any:
    try:
        mod = __import__(f"tidal.frontend.{name}", fromlist=["x"])
    except ImportError as e:
        pytest.skip(f"tidal.frontend.{name} is not available: {e}")
    return mod


def test_llm_and_cli_tp2_match_tp1(model_dirs: dict[str, str]) -> None:
    """tensor_parallel_size through LLM(...) and `tidal generate -tp 2`: the same greedy text."""
    LLM = _frontend("llm").LLM
    model = model_dirs["qwen3-kv1"]
    prompts = ["hello world", "the quick brown fox", "tensor parallel"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine_args = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "96", "--num-kv-blocks", "64"]
    cli = subprocess.Popen([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "generate", "--model", model,
                            "--prompt", prompts[0], "--max-tokens", "12", "--temperature", "0",
                            "--ignore-eos", "-tp", "2", *engine_args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    texts = {}
    try:
        for tp in (1, 2):
            llm = LLM(model, tensor_parallel_size=tp, dtype="float32", device="cpu",
                      max_model_len=96, num_kv_blocks=64)
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
                texts[tp] = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
            finally:
                llm.shutdown()
        out, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert texts[1] == texts[2]
    assert all(len(ids) == 12 for ids, _ in texts[2])
    assert cli.returncode == 0, err
    assert out == texts[1][0][1] + "\n"
    assert not worker_procs(model), "tidal processes left on the machine"


def test_async_llm_killed_rank_fails_every_stream(model_dirs: dict[str, str]) -> None:
    async_llm = _frontend("async_llm")
    model = model_dirs["llama"]

    async def main() -> None:
        engine = async_llm.AsyncLLM(model, tensor_parallel_size=2, dtype="float32", device="cpu",
                                    max_model_len=96, num_kv_blocks=64, max_core_restarts=0)
        try:
            started = asyncio.Event()
            counts = [0] * 4

            async def stream(i: int) -> BaseException | None:
                params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
                try:
                    async for _ in engine.generate({"prompt_token_ids": PROMPTS[i][:10]}, params, f"s{i}"):
                        counts[i] += 1
                        if all(counts):
                            started.set()
                except BaseException as e:  # noqa: BLE001
                    return e
                return None

            tasks = [asyncio.create_task(stream(i)) for i in range(4)]
            await asyncio.wait_for(started.wait(), 60)
            core = psutil.Process(engine.engine_core.process.pid)
            ranks = [p for p in core.children(recursive=True)
                     if "worker_proc" in " ".join(p.cmdline()) and "--rank 1" in " ".join(p.cmdline())]
            assert len(ranks) == 1
            t0 = time.monotonic()
            ranks[0].kill()
            results = await asyncio.wait_for(asyncio.gather(*tasks), KILL_DEADLINE_S)
            assert time.monotonic() - t0 < KILL_DEADLINE_S
            for r in results:
                assert isinstance(r, EngineDeadError), repr(r)
            assert "rank 1" in str(results[0]), str(results[0])
        finally:
            engine.shutdown()

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while worker_procs(model) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not worker_procs(model), "tidal processes left on the machine"
