"""Start-up breakdown: `LLM()` on the default model, and `tidal generate`'s first token.

Each sample runs in a fresh Python process (warm disk, cold interpreter), as a user's script
would. Phases, in the front-end: importing tidal.frontend, loading the tokenizer, the whole
`LLM()`, the first 1-token generate; in the engine core (its worker logs them with
TIDAL_LOG_STARTUP=1): core spawn (LLM() called -> core process started), python + imports,
config, model load, KV allocation, warm-up, then the handshake until `LLM()` returns.
`tidal generate`: time to the first byte of generated text on stdout, and to exit.

Warm disk, as a user's second run: one untimed sample first, and the children keep Python's
bytecode cache on (PYTHONDONTWRITEBYTECODE dropped; --no-bytecode-cache keeps it as set) --
without .pyc files each process compiles tidal's sources again, ~0.1 s per process.

    python scripts/bench_startup.py [--repeats 3] [--model DIR] [--no-bytecode-cache]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

_CORE_LINE = re.compile(r"tidal start-up rank 0: (?P<phases>.*) \(process start (?P<start>[\d.]+), "
                        r"ready (?P<ready>[\d.]+)\)")
_TIMEOUT_S = 300


def child(model: str | None) -> None:
    """One sample, printed as a JSON line."""
    t_start = time.time()
    from tidal.frontend import LLM, engine_setup
    from tidal.protocol import SamplingParams

    t_imported = time.time()
    tokenizer_s: list[float] = []
    load = engine_setup.load_tokenizer

    def timed_load(config):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return load(config)
        finally:
            tokenizer_s.append(time.perf_counter() - t)

    engine_setup.load_tokenizer = timed_load
    if model is None:
        from tidal.frontend.entrypoints.make_model import ensure_default_model

        model = ensure_default_model()
    t_llm = time.time()
    llm = LLM(model=model)
    t_ready = time.time()
    llm.generate(["Hello"], SamplingParams(max_tokens=1), use_tqdm=False)
    t_first = time.time()
    llm.shutdown()
    print(json.dumps({"imports": t_imported - t_start, "tokenizer": tokenizer_s[0] if tokenizer_s else 0.0,
                      "llm_called": t_llm, "llm": t_ready - t_llm, "first_token": t_first - t_ready,
                      "torch_in_front_end": "torch" in sys.modules}), flush=True)


def child_env(bytecode_cache: bool) -> dict[str, str]:
    env = {**os.environ, "TIDAL_LOG_STARTUP": "1"}
    if bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def sample_llm(model: str | None, env: dict[str, str]) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child"] + (["--model", model] if model else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"sample failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(lines[-1])
    core = _CORE_LINE.search(proc.stderr)
    if core is not None:
        for part in core["phases"].split(", "):
            name, seconds, _ = part.rsplit(" ", 2)
            out[f"core: {name}"] = float(seconds)
        out["core: spawn (LLM() called -> process start)"] = float(core["start"]) - out["llm_called"]
        out["core: ready -> LLM() returns (handshake)"] = out["llm_called"] + out["llm"] - float(core["ready"])
    del out["llm_called"]
    return out


def sample_torch_import(env: dict[str, str]) -> float:
    """Seconds from launching `python -c "import torch"` to torch imported (its exit not
    counted): the floor under the core's start-up."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", "import torch, time; print(time.time())"], check=True,
                         timeout=_TIMEOUT_S, env=env, capture_output=True, text=True).stdout
    return float(out.split()[-1]) - t0


def sample_generate(model: str | None, env: dict[str, str]) -> tuple[float, float]:
    """(seconds to the first stdout byte, seconds to exit) of `tidal generate`."""
    cmd = [sys.executable, "-m", "tidal.frontend.entrypoints.cli", "generate", "--max-tokens", "8"]
    cmd += ["--model", model] if model else []
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        assert proc.stdout is not None
        proc.stdout.read(1)
        first = time.time() - t0
        proc.stdout.read()
        proc.wait(timeout=_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return first, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="default: tidal's embedded default model")
    ap.add_argument("--no-bytecode-cache", action="store_true",
                    help="leave PYTHONDONTWRITEBYTECODE as the environment sets it")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model)
        return
    env = child_env(not args.no_bytecode_cache)
    sample_llm(args.model, env)  # untimed: warms the disk cache (and writes .pyc files)
    samples = [sample_llm(args.model, env) for _ in range(args.repeats)]
    print(f"LLM() start-up, median of {args.repeats} fresh processes (seconds):")
    for key in samples[0]:
        values = [s[key] for s in samples if key in s]
        if isinstance(values[0], bool):
            print(f"  {key:48s} {values[0]}")
            continue
        print(f"  {key:48s} {statistics.median(values):7.3f}   ({', '.join(f'{v:.3f}' for v in values)})")
    floor = [sample_torch_import(env) for _ in range(args.repeats)]
    llm_s = statistics.median(s["llm"] for s in samples)
    print(f"reference: python -c 'import torch' {statistics.median(floor):.3f} s "
          f"({', '.join(f'{v:.3f}' for v in floor)}); LLM() beyond it: {llm_s - statistics.median(floor):+.3f} s")
    gens = [sample_generate(args.model, env) for _ in range(args.repeats)]
    firsts, totals = zip(*gens)
    print(f"tidal generate: first token {statistics.median(firsts):.2f} s ({', '.join(f'{v:.2f}' for v in firsts)}), "
          f"exit {statistics.median(totals):.2f} s ({', '.join(f'{v:.2f}' for v in totals)})")


if __name__ == "__main__":
    main()
