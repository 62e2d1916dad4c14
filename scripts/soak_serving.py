"""Soak `tidal serve`: many mixed requests, some of them refused or abandoned; does anything leak?

    python scripts/soak_serving.py [--requests 20000] [--concurrency 32] [--model DIR] [engine args]

Starts `tidal serve` on 127.0.0.1 and keeps `--concurrency` requests in flight, drawn from a mix:
streamed and whole completions (ignore_eos: exactly max_tokens each), chat (streamed and not),
n=2, a client that reads the first event of a long stream and hangs up, and requests the server
must refuse (400: a bad field, a prompt past max_model_len; 404: an unknown model). Every answer
is checked (status, usage, the token count). After every 1,000 requests it prints the RSS of the
front-end and of the engine core, the front-end's open file descriptors and threads; at the end,
the growth per 1,000 requests over the last half (as scripts/soak.py) and quarter, the count of each kind,
and what /metrics says is still running or waiting in the core once the last client is done
(every abandoned stream must have been aborted: 0 and 0), and the front-end's descriptors with
nothing in flight before and after. Exit status 1 on any unexpected answer, a request left in
the core, descriptors left open, or a server that does not exit cleanly on SIGTERM.

The core's RSS also grows while KV blocks are used for the first time (the cache's pages are
zero-filled lazily; prefix caching hands out blocks it never used before it evicts): that levels
off once every block was used, sooner with a smaller cache (`--num-gpu-blocks-override 1024`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Awaitable, Callable

import httpx2 as httpx
import msgspec
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import plain_token_ids, start_server, stop_server, wait_healthy  # noqa: E402
from soak import _core_process, _rss_mb, _slope_per_1000  # noqa: E402
from sse_client import Request, send  # noqa: E402

REPORT_EVERY = 1000


class Unexpected(Exception):
    """An answer other than the one the request must get."""


def _gauge(text: str, name: str) -> float | None:
    """The sum of a /metrics gauge over its label sets; None if /metrics has no such gauge."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return sum(values) if values else None


class Soak:
    def __init__(self, base: str, model: str, ids: list[int], max_model_len: int, rng: random.Random) -> None:
        url = httpx.URL(base)
        self.host, self.port = url.host, url.port
        self.model, self.ids, self.max_model_len, self.rng = model, ids, max_model_len, rng
        self.http = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(120.0),
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.kinds: list[tuple[str, Callable[[], Awaitable[None]], int]] = [
            ("stream", self.stream, 30), ("complete", self.complete, 15), ("chat", self.chat, 10),
            ("chat_stream", self.chat_stream, 5), ("n2", self.n2, 10), ("hang_up", self.hang_up, 10),
            ("bad_field", self.bad_field, 10), ("unknown_model", self.unknown_model, 5),
            ("too_long", self.too_long, 5)]

    def prompt(self) -> list[int]:
        return self.rng.choices(self.ids, k=self.rng.randrange(4, 48))

    def pick(self) -> tuple[str, Callable[[], Awaitable[None]]]:
        name, fn, _ = self.rng.choices(self.kinds, weights=[w for *_, w in self.kinds])[0]
        return name, fn

    async def post(self, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
        r = await self.http.post(path, json=body)
        if r.status_code != status:
            raise Unexpected(f"{path}: HTTP {r.status_code}, expected {status}: {r.text[:200]}")
        out = r.json()
        if status != 200 and not isinstance(out.get("error"), dict):
            raise Unexpected(f"{path}: HTTP {status} without an OpenAI error object: {r.text[:200]}")
        return out

    async def stream(self) -> None:
        n = self.rng.randrange(1, 9)
        res = await send(self.host, self.port, "/v1/completions", b"", self.model, Request(self.prompt(), n), 0.0, 120.0)
        if not res.success:
            raise Unexpected(f"stream: {res.error}")

    async def complete(self) -> None:
        n = self.rng.randrange(1, 9)
        out = await self.post("/v1/completions", {"model": self.model, "prompt": self.prompt(), "max_tokens": n,
                                                  "ignore_eos": True, "temperature": self.rng.choice([0.0, 0.8])})
        if out["usage"]["completion_tokens"] != n:
            raise Unexpected(f"complete: {out['usage']} for max_tokens={n}")

    async def n2(self) -> None:
        out = await self.post("/v1/completions", {"model": self.model, "prompt": self.prompt(), "max_tokens": 4,
                                                  "ignore_eos": True, "n": 2, "temperature": 0.8, "seed": 1})
        if sorted(c["index"] for c in out["choices"]) != [0, 1] or out["usage"]["completion_tokens"] != 8:
            raise Unexpected(f"n2: {out['usage']}, choices {[c['index'] for c in out['choices']]}")

    def chat_body(self, stream: bool) -> dict[str, Any]:
        words = " ".join(str(t) for t in self.prompt()[:8])
        return {"model": self.model, "messages": [{"role": "user", "content": words}], "max_tokens": 6,
                "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}

    async def chat(self) -> None:
        out = await self.post("/v1/chat/completions", self.chat_body(False))
        if not 0 < out["usage"]["completion_tokens"] <= 6 or out["choices"][0]["finish_reason"] not in ("stop", "length"):
            raise Unexpected(f"chat: {out['usage']}, {out['choices'][0]['finish_reason']}")

    async def chat_stream(self) -> None:
        async with self.http.stream("POST", "/v1/chat/completions", json=self.chat_body(True)) as r:
            if r.status_code != 200:
                raise Unexpected(f"chat_stream: HTTP {r.status_code}")
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        if lines[-1] != "data: [DONE]" or '"usage"' not in lines[-2]:
            raise Unexpected(f"chat_stream: ends with {lines[-2:]}")

    async def hang_up(self) -> None:
        """A long stream abandoned after its first event: the server must abort it in the core."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            payload = msgspec.json.encode({"model": self.model, "prompt": self.prompt(), "max_tokens": 256,
                                           "ignore_eos": True, "stream": True})
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            seen = b""
            async with asyncio.timeout(60):
                while b"data: " not in seen:
                    chunk = await reader.read(4096)
                    if not chunk:
                        raise Unexpected("hang_up: the server closed first")
                    seen += chunk
                    if b"\r\n\r\n" in seen and not seen.startswith(b"HTTP/1.1 200"):
                        raise Unexpected(f"hang_up: {seen[:120]!r}")
        finally:
            writer.close()

    async def bad_field(self) -> None:
        field = self.rng.choice([{"temperature": -1.0}, {"max_tokens": -3}, {"top_p": 2.0}, {"n": 0},
                                 {"logprobs": 1000}, {"stop": 7}])
        await self.post("/v1/completions", {"model": self.model, "prompt": self.prompt(), **field}, 400)

    async def unknown_model(self) -> None:
        await self.post("/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 2}, 404)

    async def too_long(self) -> None:
        ids = self.rng.choices(self.ids, k=self.max_model_len + 1)
        await self.post("/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 2}, 400)


async def quiet_fds(server: psutil.Process) -> int:
    """The front-end's open descriptors with no request in flight: the fewest seen over a
    second (sockets the clients closed may take a moment to close on the server's side)."""
    fds = server.num_fds()
    for _ in range(10):
        await asyncio.sleep(0.1)
        fds = min(fds, server.num_fds())
    return fds


async def left_in_core(base: str, timeout_s: float = 30.0) -> tuple[float | None, float | None]:
    """(running, waiting) from /metrics once both are 0 (the last hang-ups' aborts have to reach
    the core), or as they are after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        while True:
            text = (await c.get("/metrics")).text
            running, waiting = _gauge(text, "vllm:num_requests_running"), _gauge(text, "vllm:num_requests_waiting")
            if (running == 0 and waiting == 0) or time.monotonic() > deadline:
                return running, waiting
            await asyncio.sleep(0.2)


async def run(args: argparse.Namespace, base: str, server: psutil.Process) -> int:
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        card = (await c.get("/v1/models")).json()["data"][0]
    soak = Soak(base, card["id"], plain_token_ids(args.model), card["max_model_len"], random.Random(args.seed))
    fds0 = await quiet_fds(server)
    counts: Counter[str] = Counter()
    failures: list[str] = []
    samples: list[tuple[int, float, float, int, int]] = []
    sem = asyncio.Semaphore(args.concurrency)
    done, t0 = 0, time.perf_counter()
    print(f"{'requests':>9} {'front MB':>9} {'core MB':>9} {'fds':>5} {'threads':>7} {'s':>7}", flush=True)

    def sample() -> None:
        try:
            samples.append((done, _rss_mb(server), _rss_mb(_core_process(server)), server.num_fds(),
                            server.num_threads()))
        except psutil.Error as e:  # the server is gone: its requests fail and say so
            failures.append(f"sampling the server: {type(e).__name__}: {e}")
            return
        print(f"{done:9d} {samples[-1][1]:9.1f} {samples[-1][2]:9.1f} {samples[-1][3]:5d} "
              f"{samples[-1][4]:7d} {time.perf_counter() - t0:7.1f}", flush=True)

    async def one() -> None:
        nonlocal done
        name, fn = soak.pick()
        try:
            await fn()
            counts[name] += 1
        except Exception as e:  # any answer but the right one counts against the server
            counts[name + " FAILED"] += 1
            if len(failures) < 20:
                failures.append(f"{name}: {type(e).__name__}: {e}")
        finally:
            sem.release()
            done += 1
            if done % REPORT_EVERY == 0:
                sample()

    tasks = []
    try:
        for _ in range(args.requests):
            await sem.acquire()
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
    finally:
        await soak.http.aclose()
    if not samples or samples[-1][0] != done:
        sample()
    running, waiting = await left_in_core(base)
    fds1 = await quiet_fds(server)
    half = [s for s in samples if s[0] >= args.requests // 2] or samples[-1:]
    quarter = [s for s in samples if s[0] >= args.requests * 3 // 4] or samples[-1:]
    for name, part in (("half", half), ("quarter", quarter)):
        print(f"growth per 1,000 requests over the last {name} ({part[0][0]}..{part[-1][0]}): "
              f"front-end {_slope_per_1000([(s[0], s[1]) for s in part]):+.2f} MB, "
              f"core {_slope_per_1000([(s[0], s[2]) for s in part]):+.2f} MB")
    print(f"front-end threads {half[0][4]} -> {half[-1][4]} over the last half; "
          f"open fds with nothing in flight: {fds0} before, {fds1} after")
    print("answers:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"left in the core after the last client: running {running}, waiting {waiting}")
    for f in failures:
        print("  unexpected:", f)
    bad = bool(failures) or running != 0 or waiting != 0 or fds1 > fds0 + 2
    print("soak:", "FAILED" if bad else "ok")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--model", default=None, help="HF model dir (default: the embedded default model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    args, engine_argv = ap.parse_known_args()
    if args.requests < 1 or args.concurrency < 1:
        ap.error("--requests and --concurrency must be >= 1")
    from tidal.frontend.entrypoints.make_model import ensure_default_model
    from tidal.utils.network import free_port

    args.model = args.model or ensure_default_model()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    code = 1
    with tempfile.NamedTemporaryFile(prefix="tidal-soak-", suffix=".log", delete=False) as log:
        proc = start_server(args.model, port, engine_argv, log)
        try:
            asyncio.run(wait_healthy(base, proc, args.ready_timeout))
            code = asyncio.run(run(args, base, psutil.Process(proc.pid)))
        finally:
            stop_server(proc)
            if code or proc.returncode != 0:
                print(f"server exit code {proc.returncode}; its log: {log.name}", file=sys.stderr)
    if code or proc.returncode != 0:
        sys.exit(1)
    os.unlink(log.name)


if __name__ == "__main__":
    main()
