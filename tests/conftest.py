"""Shared fixtures: tiny models made on the machine (never the user's ~/.cache/tidal), and
helpers for the process tests (engine-core children, ipc directories)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any, Iterator

import psutil
import pytest

from tidal.utils.network import free_port as free_tcp_port  # noqa: F401 - test_core_proc imports it

# Each test process (one per pytest-xdist worker) gets a temp directory of its own, made here
# before any test runs and inherited by every engine core, worker and Ray daemon it starts, so
# the leak checks (worker ipc dirs left behind, Ray processes left running) see this process's
# work and not another worker's. TMPDIR for tempfile (ipc dirs, sockets), RAY_TMPDIR for Ray's
# session files: every Ray daemon and worker inherits it, which is how the Ray tests tell their
# own cluster's processes apart. Short, as unix socket paths must stay under 108 bytes.
TEST_TMPDIR = os.path.join(tempfile.gettempdir(), f"tt{os.getpid()}")
os.makedirs(TEST_TMPDIR, exist_ok=True)
os.environ["TMPDIR"] = TEST_TMPDIR
tempfile.tempdir = None  # gettempdir() reads TMPDIR again
RAY_TMPDIR = os.environ["RAY_TMPDIR"] = TEST_TMPDIR
atexit.register(shutil.rmtree, TEST_TMPDIR, True)
# Speculation's cost rule (core/spec_cost.py) pauses it wherever verifying costs more time than
# it saves, as it does on these tiny models (a 0.5 ms decode step, a verify step of several):
# the tests that assert proposals were accepted would depend on timing. Off for every engine
# the tests start (and their restarts, which inherit it); tests/test_spec_cost.py turns it on.
os.environ.setdefault("TIDAL_SPEC_COST_RULE", "0")


@pytest.fixture(scope="session")
def tidal_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A session-wide TIDAL_CACHE_DIR (trained tokenizers, the default model) for subprocesses
    and make_model calls: pass it explicitly, it is not put in os.environ."""
    return str(tmp_path_factory.mktemp("tidal-cache"))


def _make(out_dir: str, cache_dir: str, **kwargs: object) -> str:
    from tidal.frontend.entrypoints.make_model import make_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", cache_dir)
        return make_model(out_dir, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> str:
    """A tiny Qwen3 checkpoint with a 512-token byte-level BPE tokenizer (made in ~2 s). Real
    enough for text tests; with model_runner="null" only its config and tokenizer are used."""
    return _make(str(tmp_path_factory.mktemp("tiny-qwen3")), tidal_cache_dir, arch="qwen3",
                 vocab_size=512, hidden_size=64, num_layers=2, max_position_embeddings=2048)


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> str:
    """Like tiny_model_dir but with max_position_embeddings=65536: null-runner requests long
    enough to still be running when a test aborts, cancels or kills something."""
    return _make(str(tmp_path_factory.mktemp("tiny-long")), tidal_cache_dir, arch="qwen3",
                 vocab_size=512, hidden_size=32, num_layers=1, max_position_embeddings=65536)


def core_children() -> list[psutil.Process]:
    """This test process's engine-core children that are still alive."""
    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "tidal.core.core_proc" in " ".join(p.cmdline()):
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def no_leaked_cores() -> Iterator[None]:
    """Fails the test if it leaves an engine-core process behind."""
    before = {p.pid for p in core_children()}
    yield
    left = [p for p in core_children() if p.pid not in before]
    for p in left:
        p.kill()
    assert not left, f"engine-core processes left running: {[p.pid for p in left]}"


def ipc_dir_of(address: str) -> str:
    assert address.startswith("ipc://"), address
    return os.path.dirname(address[len("ipc://"):])


async def count_stream_tokens(engine: Any, rid: str, max_tokens: int, started: Any = None) -> int:
    """Stream one ignore_eos request for prompt "abc" through an AsyncLLM; returns how many
    tokens came. `started` (an asyncio.Event) is set at the first output."""
    from tidal.protocol import RequestOutputKind, SamplingParams

    n = 0
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async for out in engine.generate("abc", params, rid):
        n += len(out.outputs[0].token_ids)
        if started is not None:
            started.set()
    return n
