"""Abandoned requests (issue 31): how fast a fresh request is answered after a storm of
requests whose clients gave up, against the same server idle.

    python scripts/bench_abandoned.py [--model DIR] [--num 200] [--give-up 0.5] [--repeats 5]
        [-- serve args]

Starts `tidal serve` on 127.0.0.1 (a tiny model made with `tidal make-model` unless --model is
given), warms it up, and times one fresh chat request (non-streamed, max_tokens 16) on the idle
server (--repeats times, the median is the reference). Then --num chat requests (max_tokens
64..256, streamed and not, alternating) are sent each on its own connection, and every client
closes its connection --give-up seconds after it sent (it reads nothing); as soon as the last
one has closed, the fresh request is timed again, --repeats times in a row. Printed: both
medians and their ratio (after / idle), and what the abandoned requests cost the engine by its
/metrics counters (prompt and generation tokens, requests finished by reason), plus how long
after the storm the core had no request running or waiting. The server is then stopped and
reaped. Timings are comparable only within one run (the machine is shared).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: object | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def metrics(url: str) -> dict[str, float]:
    """/metrics: each sample's value by `name{labels}`, and by bare name summed over its labels."""
    status, body = http("GET", url + "/metrics", timeout=30)
    assert status == 200, status
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def metric(m: dict[str, float], name: str) -> float:
    """A series by its name after the prefix (vllm: as vLLM's, or tidal: as older builds')."""
    return m.get("vllm:" + name, m.get("tidal:" + name, 0.0))


def reason_count(m: dict[str, float], reason: str) -> float:
    return sum(v for k, v in m.items() if k.split(":", 1)[-1].startswith("request_success_total{") and
               f'finished_reason="{reason}"' in k)


def chat_body(model: str, max_tokens: int, stream: bool, text: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True}


def fresh_latency(url: str, model: str) -> float:
    t0 = time.perf_counter()
    status, body = http("POST", url + "/v1/chat/completions", chat_body(model, 16, False, "How are you today?"))
    dt = time.perf_counter() - t0
    assert status == 200, (status, body[:500])
    out = json.loads(body)
    assert out["usage"]["completion_tokens"] == 16, out["usage"]
    return dt


async def abandoned(port: int, body: dict, give_up_s: float) -> None:
    """One request whose client sends it, waits `give_up_s` without reading, and leaves."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    await asyncio.sleep(give_up_s)
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 5)
    except (OSError, asyncio.TimeoutError):
        pass


async def storm(port: int, model: str, num: int, give_up_s: float, seed: int) -> int:
    rng = random.Random(seed)
    bodies = []
    for i in range(num):
        words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "tide", "wave")) for _ in range(rng.randint(8, 40)))
        bodies.append(chat_body(model, rng.randint(64, 256), i % 2 == 0, words))
    await asyncio.gather(*(abandoned(port, b, give_up_s) for b in bodies))
    return sum(b["max_tokens"] for b in bodies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model dir (default: one made by --shape)")
    ap.add_argument("--shape", choices=("tiny", "default"), default="tiny",
                    help="the model made: tiny (the tests' 512-token Qwen3) or tidal's default model's shape")
    ap.add_argument("--num", type=int, default=200)
    ap.add_argument("--give-up", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-script", default=None,
                    help="a Python script to run instead of `-m tidal.frontend.entrypoints.cli` (e.g. one "
                         "that adds timing probes); it gets the same arguments")
    ap.add_argument("--server-log", default=None, help="keep the server's log here")
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench-abandoned-")
    model_dir = args.model
    if model_dir is None:
        model_dir = os.path.join(tmp.name, "model")
        shape = (["--vocab-size", "512", "--hidden-size", "64", "--num-layers", "2",
                  "--max-position-embeddings", "2048"] if args.shape == "tiny" else [])
        code = ("import sys; from tidal.frontend.entrypoints.make_model import make_model, DEFAULT_ARCH, "
                "DEFAULT_MODEL_KWARGS as K; make_model(sys.argv[1], DEFAULT_ARCH, **K)")
        cmd = ([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "make-model", model_dir, *shape]
               if args.shape == "tiny" else [sys.executable, "-c", code, model_dir])
        subprocess.run(cmd, check=True, timeout=300, stdout=subprocess.DEVNULL,
                       env={**os.environ, "TIDAL_CACHE_DIR": os.path.join(tmp.name, "cache")})
    template = os.path.join(tmp.name, "template.jinja")
    with open(template, "w") as f:
        f.write(CHAT_TEMPLATE)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(args.server_log or os.path.join(tmp.name, "server.log"), "wb")
    entry = [args.server_script] if args.server_script else ["-m", "tidal.frontend.entrypoints.cli"]
    cmd = [sys.executable, *entry, "serve", model_dir, "--port", str(port),
           "--chat-template", template, "--disable-uvicorn-access-log", *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TIDAL_CACHE_DIR": os.path.join(tmp.name, "cache")})
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while http("GET", url + "/health", timeout=5)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tidal serve did not come up")
            time.sleep(0.2)
        model = json.loads(http("GET", url + "/v1/models")[1])["data"][0]["id"]
        for _ in range(3):  # warm-up
            fresh_latency(url, model)
        idle = [fresh_latency(url, model) for _ in range(args.repeats)]
        before = metrics(url)
        t0 = time.perf_counter()
        asked = asyncio.run(storm(port, model, args.num, args.give_up, args.seed))
        storm_s = time.perf_counter() - t0
        after = [fresh_latency(url, model) for _ in range(args.repeats)]
        t1 = time.perf_counter()
        while True:  # until the core holds nothing (timed from the storm's end)
            m = metrics(url)
            if metric(m, "num_requests_running") == 0 and metric(m, "num_requests_waiting") == 0:
                break
            if time.perf_counter() - t1 > REQUEST_TIMEOUT_S:
                break
            time.sleep(0.05)
        drained_s = time.perf_counter() - t0 - storm_s
        time.sleep(0.5)
        m = metrics(url)
        d = {k: m.get(k, 0.0) - before.get(k, 0.0) for k in m}
        fresh_tokens = 16 * args.repeats
        idle_med, after_med = statistics.median(idle), statistics.median(after)
        print(f"storm: {args.num} chat requests, clients gone after {args.give_up:g} s "
              f"(sent and closed in {storm_s:.2f} s), max_tokens asked in all: {asked}")
        print(f"engine, during the storm and the {args.repeats} fresh requests after it:")
        print(f"  prompt tokens: {metric(d, 'prompt_tokens_total'):.0f}   generation tokens: "
              f"{metric(d, 'generation_tokens_total'):.0f} (of which the fresh requests': {fresh_tokens})")
        print(f"  finished: abort {reason_count(d, 'abort'):.0f}, length {reason_count(d, 'length'):.0f}, "
              f"stop {reason_count(d, 'stop'):.0f}")
        print(f"  core idle {drained_s:.2f} s after the storm's last client left")
        print(f"fresh request, idle server: median {idle_med * 1000:.1f} ms  "
              f"({', '.join(f'{x * 1000:.0f}' for x in idle)})")
        print(f"fresh request, after storm: median {after_med * 1000:.1f} ms  "
              f"({', '.join(f'{x * 1000:.0f}' for x in after)}); first {after[0] * 1000:.1f} ms")
        print(f"ratio (after / idle): median {after_med / idle_med:.2f}, first {after[0] / idle_med:.2f}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(60)
        log.close()
        tmp.cleanup()


if __name__ == "__main__":
    main()
