"""Online serving benchmark in the manner of `vllm bench serve`, with an offline reference.

    python scripts/bench_serving.py [--model DIR] [--num-prompts 64] [--request-rate inf]
        [--random-input-len 256] [--random-output-len 64] [--random-range-ratio 0.0] [engine args]

Starts `tidal serve DIR [engine args]` on 127.0.0.1 (a free port), waits for /health, sends a
warm-up request and `--num-warmups` untimed workloads (default 1; LLM.generate gets the same),
then `--num-prompts` streamed /v1/completions requests (random token-id
prompts, ignore_eos) arriving as a Poisson process at `--request-rate` (inf: all at once), and
prints vLLM's figures. An `LLM` with the same engine args (warmed up the same way) lives beside
the server, and each timed workload also runs through `LLM.generate`, right before or after its
server run (alternating): this machine's speed drifts too much for one side's runs to be
compared with the other's taken minutes apart. The last lines: server tok/s / LLM.generate's
(medians), the ratio per workload, and the CPU-work ratio per workload: LLM.generate's CPU
seconds over the server run's (engine, front-end and client). On a saturated machine wall time
follows CPU seconds, so where the two ratios agree the server's loss is CPU it spends, its
engine's own included (that grows beside the front-end: fork-join waits, shared caches), not
cores left idle. The server and the LLM are then stopped and reaped.
As vLLM: TTFT = first chunk - send; ITL = gaps between chunks; TPOT = (latency - TTFT) /
(output tokens - 1); output tokens = usage.completion_tokens. Defaults suit a small CPU box
(vLLM's: 1000 x 1024 -> 128). CPU seconds are printed for each side: the client (its timed
requests), the server's front-end and its engine core; LLM.generate's front-end and core. On 2
cores they compete, and the engine's two threads lose more than the others take: a parallel
region waits for a thread that is off its core.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx2 as httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sse_client import Request, Result, send  # noqa: E402

PERCENTILES = (50.0, 90.0, 99.0)


def sample_requests(n: int, input_len: int, output_len: int, ratio: float, vocab: list[int],
                    seed: int) -> list[Request]:
    """vLLM's random dataset: lengths uniform in [len*(1-r), len*(1+r)], ids uniform over `vocab`."""
    rng = np.random.default_rng(seed)

    def lens(mean: int) -> np.ndarray:
        lo, hi = max(1, int(np.floor(mean * (1 - ratio)))), max(1, int(np.ceil(mean * (1 + ratio))))
        return rng.integers(lo, hi + 1, size=n)

    ins, outs = lens(input_len), lens(output_len)
    ids = np.asarray(vocab)
    return [Request(rng.choice(ids, size=int(i)).tolist(), int(o)) for i, o in zip(ins, outs, strict=True)]


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offsets (s): gamma-distributed gaps (burstiness 1 = Poisson), scaled so the last
    arrives at n / rate exactly (as vLLM does); all 0 at rate inf."""
    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    t = np.cumsum(gaps)
    return (t * (n / rate) / t[-1]).tolist()


def percentile_line(name: str, values_s: list[float]) -> list[tuple[str, float]]:
    """(label, ms) for mean and each percentile; np.percentile's linear interpolation, as vLLM."""
    v = np.asarray(values_s or [0.0]) * 1000.0
    return [(f"Mean {name} (ms):", float(v.mean()))] + [
        (f"P{p:g} {name} (ms):", float(np.percentile(v, p))) for p in PERCENTILES]


def compute_metrics(results: list[Result], requests: list[Request], duration_s: float) -> dict[str, Any]:
    ok = [(r, q) for r, q in zip(results, requests, strict=True) if r.success]
    out_tokens = sum(r.output_tokens for r, _ in ok)
    in_tokens = sum(len(q.prompt_token_ids) for _, q in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r, _ in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration_s,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s, "output_throughput": out_tokens / duration_s,
        "total_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft": [r.ttft for r, _ in ok], "tpot": tpots, "itl": [x for r, _ in ok for x in r.itl],
    }


async def run_client(base: str, requests: list[Request], args: argparse.Namespace, server_pid: int
                     ) -> tuple[list[Result], float, tuple[float, float, float]]:
    """(results, seconds, CPU seconds of the client, the server's front-end and its core) over
    the timed requests (not the set-up before them: /v1/models, the warm-up request)."""
    key = os.environ.get("TIDAL_API_KEY")  # the server inherits it, so it would demand it
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    url = httpx.URL(base)
    host, port = url.host, url.port or 80
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(args.request_timeout), headers=headers) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
    # Its prompt shares no cached block with a timed one (4 tokens fill none at the default
    # block size; one id repeated starts no random prompt): the first timed request would
    # otherwise find its prefix cached, a head start LLM.generate's twin does not get.
    warm_prompt = [requests[0].prompt_token_ids[0]] * 4
    warm = await send(host, port, "/v1/completions", auth, model, Request(warm_prompt, 4),
                      args.temperature, args.request_timeout)
    if not warm.success:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    offsets = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)

    async def one(req: Request, at: float) -> Result:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        return await send(host, port, "/v1/completions", auth, model, req, args.temperature, args.request_timeout)

    server0 = server_cpu_s(server_pid)
    t0, cpu0 = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets, strict=True)))
    duration, client = time.perf_counter() - t0, time.process_time() - cpu0
    server1 = server_cpu_s(server_pid)
    return list(results), duration, (client, server1[0] - server0[0], server1[1] - server0[1])


def print_metrics(m: dict[str, Any], args: argparse.Namespace, cpu_s: tuple[float, float, float]) -> None:
    """vLLM's "Serving Benchmark Result" block (P50/P90/P99 in place of its median/P99)."""
    rows: list[tuple[str, Any]] = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"])]
    if args.request_rate != float("inf"):
        rows.append(("Request rate configured (RPS):", f"{args.request_rate:.2f}"))
    rows += [("Benchmark duration (s):", f"{m['duration']:.2f}"), ("Total input tokens:", m["input_tokens"]),
             ("Total generated tokens:", m["output_tokens"]),
             ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
             ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
             ("Total Token throughput (tok/s):", f"{m['total_throughput']:.2f}"),
             ("Client CPU (s):", f"{cpu_s[0]:.2f}"), ("Server front-end CPU (s):", f"{cpu_s[1]:.2f}"),
             ("Engine core CPU (s):", f"{cpu_s[2]:.2f}")]
    print(f"{' Serving Benchmark Result ':=^50}")
    print("\n".join(f"{k:<40} {v:<10}" for k, v in rows))
    for key, name, header in (("ttft", "TTFT", "Time to First Token"),
                              ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                              ("itl", "ITL", "Inter-token Latency")):
        print(f"{header:-^50}")
        print("\n".join(f"{k:<40} {v:<10.2f}" for k, v in percentile_line(name, m[key])))
    print("=" * 50, flush=True)


def _cpu_s(p: "psutil.Process") -> float:
    import psutil

    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def server_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by the server's front-end process and by its
    children (the engine core, its workers): where the 2 cores' time goes."""
    import psutil

    front = psutil.Process(pid)
    return _cpu_s(front), sum(_cpu_s(c) for c in front.children(recursive=True))


def offline_core_cpu_s(server_pid: int) -> float:
    """CPU seconds used so far by this process's children other than the server's process tree:
    the offline LLM's engine core (and its workers)."""
    import psutil

    server = psutil.Process(server_pid)
    skip = {server_pid} | {c.pid for c in server.children(recursive=True)}
    return sum(_cpu_s(c) for c in psutil.Process().children(recursive=True) if c.pid not in skip)


def server_steps(base: str) -> int:
    """Engine steps the server's core has run so far (its iteration-tokens histogram count)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:iteration_tokens_total_count")))


def start_server(model: str, port: int, engine_argv: list[str], log: Any,
                 env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`tidal serve` on 127.0.0.1:port; `env`: variables set for it on top of this process's."""
    cmd = [sys.executable, "-m", "tidal.frontend.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), *engine_argv]
    print("server:", *(f"{k}={v}" for k, v in (env or {}).items()), *cmd, flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=None if env is None else {**os.environ, **env})


async def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base, timeout=2.0) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
            try:
                if (await c.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            print("server ignored SIGTERM; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()


class OfflineRunner:
    """LLM.generate on the server's workloads, one LLM, alive beside the server so that each
    timed server run has its offline twin right before or after it (same machine state: this
    2-core machine's speed drifts by tens of percent over a minute). Warmed up like the server:
    a request for 4 tokens, then the untimed `warmups` (none of it shares a prompt with a timed
    workload)."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any], temperature: float,
                 warmups: list[list[Request]], server_pid: int) -> None:
        from tidal.frontend import LLM

        self.temperature, self.server_pid = temperature, server_pid
        self.llm = LLM(model, **engine_kwargs)
        try:
            self.run(warmups[0][:1] if warmups else [], quiet=True, max_tokens=4)
            for requests in warmups:
                self.run(requests, quiet=True)
        except BaseException:
            self.llm.shutdown()
            raise

    def run(self, requests: list[Request], quiet: bool = False, max_tokens: int | None = None
            ) -> tuple[float, float]:
        """(output tok/s, CPU s of the front-end and the engine core) of one LLM.generate over
        `requests`."""
        from tidal.protocol import SamplingParams

        if not requests:
            return 0.0, 0.0
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [SamplingParams(max_tokens=max_tokens or r.max_tokens, ignore_eos=True, temperature=self.temperature)
                  for r in requests]
        steps0 = self.llm.llm_engine.call_utility("get_timing")[2]
        cpu0, core0 = time.process_time(), offline_core_cpu_s(self.server_pid)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        cpu, core = time.process_time() - cpu0, offline_core_cpu_s(self.server_pid) - core0
        steps = self.llm.llm_engine.call_utility("get_timing")[2] - steps0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == sum(p.max_tokens for p in params), tokens
        if not quiet:
            print(f"LLM.generate: {len(outs)} requests, {tokens} tokens in {dt:.2f} s = {tokens / dt:.2f} output tok/s, "
                  f"{steps} engine steps; CPU s: front-end {cpu:.2f}, engine core {core:.2f}")
        return tokens / dt, cpu + core

    def close(self) -> None:
        self.llm.shutdown()


def add_workload_args(p: argparse.ArgumentParser, repeats: int, repeats_help: str) -> None:
    """The workload's and the client's flags (this script's and bench_serving_ab.py's)."""
    p.add_argument("--model", default=None, help="HF model dir (default: the embedded default model)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--random-input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--random-output-len", type=int, default=64, help="max_tokens per request (ignore_eos)")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="workload seed (lengths, token ids, arrivals)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request, whole stream")
    p.add_argument("--num-warmups", type=int, default=1,
                   help="untimed workloads of the same shape run first on each side (cold costs paid alike)")
    p.add_argument("--repeats", type=int, default=repeats, help=repeats_help)


def check_workload_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0.0 <= args.random_range_ratio < 1.0 or args.num_prompts < 1 or args.request_rate <= 0 or args.repeats < 1 \
            or args.num_warmups < 0:
        p.error("need 0 <= --random-range-ratio < 1, --num-prompts >= 1, --request-rate > 0, --repeats >= 1, "
                "--num-warmups >= 0")


def parse_args() -> tuple[argparse.Namespace, list[str], dict[str, Any]]:
    from tidal.frontend.engine_args import EngineArgs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False, epilog="Every other flag is an engine arg (vLLM's "
                                "EngineArgs), passed to both `tidal serve` and LLM, e.g. --max-model-len, -tp.")
    add_workload_args(p, repeats=3, repeats_help="workloads (seeds seed..seed+R-1) run on each side; "
                      "the ratio is of the medians")
    p.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    p.add_argument("--no-offline", action="store_true", help="skip the LLM.generate reference")
    args, engine_argv = p.parse_known_args()
    check_workload_args(p, args)
    ep = argparse.ArgumentParser(prog="bench_serving.py: engine args", add_help=False, allow_abbrev=False)
    EngineArgs.add_cli_args(ep, exclude=frozenset({"model", "seed"}))
    engine_kwargs = vars(ep.parse_args(engine_argv))  # SUPPRESS defaults: only the flags given
    return args, engine_argv, engine_kwargs


def plain_token_ids(model: str) -> list[int]:
    """The ids of the model's tokenizer without its special tokens (random prompts of these
    never hold an EOS or a chat-template marker)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    special = set(tok.all_special_ids)
    return [i for i in range(len(tok)) if i not in special]


def make_workloads(args: argparse.Namespace) -> tuple[list[list[Request]], list[list[Request]]]:
    """(the warm-up workloads, the timed ones): random token-id prompts over the model's
    vocabulary without its special tokens, a distinct workload per warm-up and repeat (a
    repeated one would hit the prefix cache)."""
    vocab = plain_token_ids(args.model)
    workloads = [sample_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, vocab, args.seed + i)
                 for i in range(args.repeats + args.num_warmups)]
    return workloads[args.repeats:], workloads[:args.repeats]


def run_server_phase(args: argparse.Namespace, engine_argv: list[str], engine_kwargs: dict[str, Any]
                     ) -> tuple[list[tuple[list[Request], list[Result], float, tuple[float, float, float]]],
                                list[tuple[float, float]]]:
    """Start the server, build the workloads while it loads, run them (warm-ups first, untimed),
    each timed one next to its LLM.generate twin (unless --no-offline): (the timed server runs,
    the offline (output tok/s, CPU s) in the same order). The server and the offline engine are stopped
    and reaped on every path (the server's log is kept and its tail printed unless all went well)."""
    from tidal.utils.network import free_port

    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    offline: OfflineRunner | None = None
    offline_rates: list[tuple[float, float]] = []
    with tempfile.NamedTemporaryFile(prefix="tidal-serve-", suffix=".log", delete=False) as log:
        proc = start_server(args.model, port, engine_argv, log)
        try:
            warmups, workloads = make_workloads(args)
            asyncio.run(wait_healthy(base, proc, args.ready_timeout))
            for requests in warmups:
                asyncio.run(run_client(base, requests, args, proc.pid))
            if not args.no_offline:
                offline = OfflineRunner(args.model, engine_kwargs, args.temperature, warmups, proc.pid)
            runs = []
            for i, requests in enumerate(workloads):
                if offline is not None and i % 2:  # ABBA order: a drift favours neither side
                    offline_rates.append(offline.run(requests))
                steps0 = server_steps(base)
                results, duration, cpu_s = asyncio.run(run_client(base, requests, args, proc.pid))
                print(f"server: {len(requests)} requests in {duration:.2f} s, "
                      f"{server_steps(base) - steps0} engine steps (4 of them the client's 4-token warm-up request)")
                runs.append((requests, results, duration, cpu_s))
                if offline is not None and not i % 2:
                    offline_rates.append(offline.run(requests))
        except BaseException as e:
            if offline is not None:
                offline.close()
            stop_server(proc)
            log.flush()
            with open(log.name, errors="replace") as f:
                tail = "".join(f.readlines()[-30:])
            print(f"--- server log ({log.name}), last lines ---\n{tail}", file=sys.stderr)
            if isinstance(e, (RuntimeError, TimeoutError, httpx.HTTPError)):
                sys.exit(f"error: {type(e).__name__}: {e}")
            raise
        if offline is not None:
            offline.close()
        stop_server(proc)
    if proc.returncode != 0:
        print(f"note: the server exited with code {proc.returncode} on SIGTERM (log: {log.name})", file=sys.stderr)
    else:
        os.unlink(log.name)
    return runs, offline_rates


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwind as Ctrl-C does, so the server is always stopped and reaped


def prepare(args: argparse.Namespace) -> None:
    """The client's event loop (uvloop's costs the client, which shares the CPUs, less), SIGTERM
    unwinding as Ctrl-C, and the default model when --model is not given."""
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    signal.signal(signal.SIGTERM, _sigterm)
    if args.model is None:
        from tidal.frontend.entrypoints.make_model import ensure_default_model

        args.model = ensure_default_model()


def main() -> None:
    args, engine_argv, engine_kwargs = parse_args()
    prepare(args)
    runs, offline_runs = run_server_phase(args, engine_argv, engine_kwargs)
    offline = [rate for rate, _ in offline_runs]
    served = []
    for requests, results, duration, cpu_s in runs:
        metrics = compute_metrics(results, requests, duration)
        if errors := [r.error for r in results if not r.success]:
            print(f"{len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
        print_metrics(metrics, args, cpu_s)
        served.append(metrics["output_throughput"])
    if args.no_offline:
        return
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s"
    server_tp, offline_tp = float(np.median(served)), float(np.median(offline))
    pairs = [a / b for a, b in zip(served, offline)]
    print(f"server / LLM.generate output tok/s (rate {rate}, median of {len(runs)}): "
          f"{server_tp:.2f} / {offline_tp:.2f} = {server_tp / offline_tp:.3f}")
    print(f"  per workload (each server run beside its LLM.generate twin): "
          f"{', '.join(f'{r:.3f}' for r in pairs)}; median {float(np.median(pairs)):.3f}")
    # On a saturated machine wall time follows CPU seconds: the same tokens cost the server run
    # its engine (whose CPU grows beside the front-end), its front-end and the client.
    work = [cpu / sum(cpu_s) for (_, cpu), (_, _, _, cpu_s) in zip(offline_runs, runs)]
    print(f"  CPU-work ratio (LLM.generate CPU s / server CPU s, client included, per workload): "
          f"{', '.join(f'{r:.3f}' for r in work)}; median {float(np.median(work)):.3f}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
