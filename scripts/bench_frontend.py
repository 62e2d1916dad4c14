"""Front-end throughput: AsyncLLM + engine-core process with the null model runner.

    python scripts/bench_frontend.py [--streams 256] [--max-tokens 256] [--repeats 5]

Measures tokens/s delivered to `--streams` concurrent DELTA consumers (ignore_eos, max_tokens)
and the CPU microseconds per token of the front-end process (and of the core process). The
reference, measured in the same run against an identical core process, is a raw client: the
same requests over the same socket, outputs only msgpack-decoded and counted (no detokenizing,
no RequestOutputs, no asyncio streams) -- the ceiling set by the core and the transport. The
ratio says how much of it the full front-end keeps.

The null runner answers at once, so the model costs nothing and the two processes each want a
whole core. On a shared machine they often get less: the "cores used" column, (front-end CPU +
core CPU) / wall time, shows it (2.0 = both had a core to themselves). Figures are the best of
--repeats rounds, with the median beside them.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import psutil

from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.core_client import SyncMPClient
from tidal.protocol import EngineConfig, RequestOutputKind, SamplingParams
from tidal.protocol.messages import EngineCoreRequest

PROMPT = "The quick brown fox jumps over the lazy dog; 素早い茶色の狐 🦊"
TARGET_TOK_S = 150_000


@dataclass
class Round:
    tokens: int
    wall_s: float
    fe_cpu_s: float
    core_cpu_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


class _Meter:
    """Wall time, this process's CPU time and the core process's CPU time over one round."""

    def __init__(self, core_pid: int) -> None:
        self.core = psutil.Process(core_pid)

    def __enter__(self) -> "_Meter":
        self.t0, self.c0, self.k0 = time.perf_counter(), time.process_time(), self._core_cpu()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0
        self.core_cpu = self._core_cpu() - self.k0

    def _core_cpu(self) -> float:
        t = self.core.cpu_times()
        return t.user + t.system

    def round(self, tokens: int) -> Round:
        return Round(tokens, self.wall, self.cpu, self.core_cpu)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=0,
                          output_kind=RequestOutputKind.DELTA)


async def _async_round(engine: AsyncLLM, streams: int, max_tokens: int, tag: str) -> Round:
    params = _params(max_tokens)

    async def consume(i: int) -> int:
        n = 0
        async for out in engine.generate(PROMPT, params, f"{tag}-{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    assert engine.engine_core.process is not None
    with _Meter(engine.engine_core.process.pid) as m:
        counts = await asyncio.gather(*(consume(i) for i in range(streams)))
    total = sum(counts)
    assert total == streams * max_tokens, (total, streams * max_tokens)
    return m.round(total)


def bench_async_llm(cfg: EngineConfig, args: argparse.Namespace) -> list[Round]:
    async def run() -> list[Round]:
        engine = AsyncLLM.from_config(cfg)
        try:
            await _async_round(engine, args.streams, 16, "warmup")
            return [await _async_round(engine, args.streams, args.max_tokens, f"r{k}")
                    for k in range(args.repeats)]
        finally:
            engine.shutdown()

    runner: Callable[[Any], Any] = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        runner = uvloop.run
    return runner(run())


def bench_raw_client(cfg: EngineConfig, args: argparse.Namespace) -> list[Round]:
    client = SyncMPClient(cfg)
    rounds = []
    try:
        info = client.wait_ready()
        assert client.process is not None
        prompt_ids = [1 + i % (info.vocab_size - 1) for i in range(20)]
        for k in range(args.repeats):
            with _Meter(client.process.pid) as m:
                for i in range(args.streams):
                    client.add_request(EngineCoreRequest(f"raw{k}-{i}", prompt_ids, _params(args.max_tokens)))
                total, finished = 0, 0
                while finished < args.streams:
                    outs = client.get_output(10.0)
                    if outs is None:
                        raise TimeoutError("the core stopped answering")
                    for o in outs.outputs:
                        total += len(o.new_token_ids)
                        finished += o.finish_reason is not None
            rounds.append(m.round(total))
    finally:
        client.shutdown()
    return rounds


def _report(name: str, rounds: list[Round]) -> float:
    best = max(rounds, key=lambda r: r.tok_s)
    med = statistics.median(r.tok_s for r in rounds)
    fe_us = min(r.fe_cpu_s / r.tokens * 1e6 for r in rounds)
    core_us = min(r.core_cpu_s / r.tokens * 1e6 for r in rounds)
    cores = (best.fe_cpu_s + best.core_cpu_s) / best.wall_s
    print(f"{name:<36} best {best.tok_s:>9,.0f} tok/s  median {med:>9,.0f}  | CPU us/token: "
          f"front-end {fe_us:.2f}, core {core_us:.2f} | cores used (best round) {cores:.2f}")
    return best.tok_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir (default: the embedded default model)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--no-reference", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from tidal.frontend.entrypoints.make_model import ensure_default_model

        args.model = ensure_default_model()
    cfg = EngineConfig(model=args.model, model_runner="null", max_num_seqs=args.streams,
                       max_num_batched_tokens=max(256, args.streams * 32),
                       max_model_len=args.max_tokens + 64)
    print(f"{args.streams} concurrent DELTA streams x {args.max_tokens} tokens, null runner, "
          f"{args.loop} loop, {psutil.cpu_count()} CPUs, load average {psutil.getloadavg()[0]:.1f}, "
          f"best of {args.repeats}", flush=True)
    best = _report("AsyncLLM (detokenized DELTA streams)", bench_async_llm(cfg, args))
    if not args.no_reference:
        ref = _report("reference: raw client (decode only)", bench_raw_client(cfg, args))
        print(f"AsyncLLM / raw client = {best / ref:.2f}")
    print(f"target {TARGET_TOK_S:,} tok/s: {'met' if best >= TARGET_TOK_S else 'NOT met'}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
