"""The README's commands and snippets run as written, in order, as on a fresh machine (issue 29).

What runs: every fenced ```bash and ```python block of README.md, top to bottom, in one temp dir
(its cwd), with a TIDAL_CACHE_DIR of this test session (no default model, no compiled kernels
until a command makes them). A bash block is split into commands (one a line, `\\`
continuations joined), each run by `bash -ec`; a python block is one script, run by this
interpreter. Each must exit 0 within its timeout.

What does not: a block right after a `<!-- readme-test: skip: REASON -->` line. That is the rule
for the blocks that install packages (the test runs in the environment tidal is installed in;
this project's machines have no network), run the test suite itself, or run for minutes
(benchmarks). `test_readme_marks_what_it_skips` holds the README to it: an unmarked block that
installs packages or reaches beyond loopback fails there, naming its line.

Long-running commands, `tidal serve` and `tidal core`, are started in the background (a session
of their own, as from a terminal) and waited on until healthy (GET /health answers 200; a core:
its TCP port accepts); the commands after them are the README's "in another shell". A service
started on a port an earlier one holds stops that one first, as the README tells its reader to;
the rest are stopped at the end. Stopping is SIGTERM to the service's whole process group (what
`timeout`, systemd and Ctrl-C send): it must exit 0 and leave no process behind.

The only rewrites, so that runs on a shared machine do not collide: `/tmp/` becomes the temp
dir, and the README's ports (8000, 5557) become free ones, a `tidal serve` without `--port`
getting `--port` with the one that stands for its default 8000.
"""
from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tidal.utils.network import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
SKIP_MARK = re.compile(r"^<!--\s*readme-test:\s*skip:\s*(?P<reason>\S.*?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
RUN_LANGS = ("bash", "python")
README_PORTS = (8000, 5557)  # the ports the README's commands use, rewritten to free ones
SERVICE = re.compile(r"^tidal (serve|core)\b")
COMMAND_TIMEOUT_S = 300.0  # hang guards only: nothing here measures a duration
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 120.0
# What a block must not do unless it is marked skipped (see the module's docstring).
INSTALLS = re.compile(r"\b(pip|pip3|uv|conda|apt|apt-get)\s+install\b")
REMOTE_URL = re.compile(r"\b(?:https?|tcp)://(?!127\.0\.0\.1[:/]|localhost[:/])[^\s'\"]+")


@dataclass
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    skip_reason: str | None


def readme_blocks() -> list[Block]:
    """Every fenced block of the README in order, with the skip marker right above it if any."""
    blocks: list[Block] = []
    lines = README.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        above = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        mark = SKIP_MARK.match(above)
        blocks.append(Block(m["lang"], "\n".join(lines[start + 1:j]) + "\n", start + 1,
                            mark["reason"] if mark else None))
        i = j + 1
    return blocks


def shell_commands(text: str) -> list[str]:
    """A bash block's commands: one a line, `\\` continuations joined, comment lines dropped."""
    commands: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = pending + raw
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    assert not pending, f"a bash block ends in a continuation: {pending!r}"
    return commands


def test_readme_marks_what_it_skips() -> None:
    """Every block that installs packages or reaches beyond loopback carries a skip marker with
    its reason; what is left still covers the quick start (a server, a request, Python)."""
    blocks = readme_blocks()
    runnable = [b for b in blocks if b.lang in RUN_LANGS and b.skip_reason is None]
    for b in runnable:
        assert not INSTALLS.search(b.text), (
            f"README.md:{b.line}: this block installs packages; mark it "
            f"'<!-- readme-test: skip: REASON -->' or move the install out of it:\n{b.text}")
        assert not REMOTE_URL.search(b.text), f"README.md:{b.line}: reaches beyond loopback:\n{b.text}"
    commands = [c for b in runnable if b.lang == "bash" for c in shell_commands(b.text)]
    assert any(c.startswith("tidal serve") for c in commands), commands
    assert any(c.startswith("curl") for c in commands), commands
    assert any(b.lang == "python" for b in runnable)
    assert all(b.lang in RUN_LANGS or b.lang == "" for b in blocks), [b.lang for b in blocks]


class Readme:
    """The README's commands run in `workdir`; the services they start, by port."""

    def __init__(self, workdir: Path, cache_dir: str) -> None:
        self.workdir = workdir
        self.ports = {port: free_port() for port in README_PORTS}
        self.services: dict[int, tuple[subprocess.Popen[bytes], Path, str]] = {}
        bindir = os.path.dirname(sys.executable)  # this environment's `tidal` and `python` first
        self.env = {k: v for k, v in os.environ.items() if k not in ("TIDAL_API_KEY", "VLLM_API_KEY")}
        self.env.update(TIDAL_CACHE_DIR=cache_dir, PATH=bindir + os.pathsep + self.env.get("PATH", ""),
                        HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.num_logs = 0

    def rewrite(self, text: str) -> str:
        text = text.replace("/tmp/", f"{self.workdir}/")
        for old, new in self.ports.items():
            text = re.sub(rf"(?<=127\.0\.0\.1:){old}\b", str(new), text)
            text = re.sub(rf"(?<=--port ){old}\b", str(new), text)
        return text

    def _log_path(self, what: str) -> Path:
        self.num_logs += 1
        return self.workdir / f"readme-{self.num_logs:02d}-{what}.log"

    def run_block(self, block: Block) -> None:
        if block.lang == "python":
            script = self.workdir / f"readme_line_{block.line}.py"
            script.write_text(self.rewrite(block.text))
            self._run([sys.executable, str(script)], f"README.md:{block.line} (python)")
            return
        for command in shell_commands(block.text):
            command = self.rewrite(command)
            if SERVICE.match(command):
                self.start_service(command)
            else:
                self._run(["bash", "-ec", command], f"README.md:{block.line}: {command}")

    def _run(self, argv: list[str], what: str) -> None:
        log = self._log_path("command")
        with open(log, "wb") as out:
            try:
                code = subprocess.run(argv, cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                                      stdout=out, stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT_S,
                                      start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                code = None
        assert code == 0, f"{what} exited with {code} (None: timed out):\n{log.read_text(errors='replace')}"

    def start_service(self, command: str) -> None:
        if command.startswith("tidal serve") and not re.search(r"--(port|uds)\b", command):
            command = command.replace("tidal serve", f"tidal serve --port {self.ports[8000]}", 1)
        if command.startswith("tidal serve"):
            port_m = re.search(r"--port (\d+)", command)
        else:
            port_m = re.search(r"--address tcp://[\d.]+:(\d+)", command)
        assert port_m, f"cannot tell where this service listens: {command}"
        port = int(port_m[1])
        if port in self.services:
            self.stop_service(port)
        log = self._log_path("service")
        with open(log, "wb") as out:  # the child holds its own descriptor
            proc = subprocess.Popen(["bash", "-c", "exec " + command], cwd=self.workdir, env=self.env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.services[port] = (proc, log, command)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._ready(command, port):
            assert proc.poll() is None, f"{command} exited with {proc.returncode}:\n{log.read_text(errors='replace')}"
            assert time.monotonic() < deadline, f"{command} not ready in {STARTUP_TIMEOUT_S} s:\n{log.read_text()}"
            time.sleep(0.2)

    @staticmethod
    def _ready(command: str, port: int) -> bool:
        try:
            if command.startswith("tidal core"):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                return True
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            finally:
                conn.close()
        except OSError:
            return False

    def stop_service(self, port: int) -> None:
        """SIGTERM to its process group; it must exit 0, and the group must be gone."""
        proc, log, command = self.services.pop(port)
        pgid = proc.pid  # a session leader leads its own group
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            code = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        left = _wait_group_gone(pgid)
        text = log.read_text(errors="replace")
        assert code == 0, f"{command} exited with {code} (None: still running) at SIGTERM:\n{text}"
        assert not left, f"{command}: left running after it exited: {left}\n{text}"

    def close(self) -> None:
        """Whatever happened: no service or process of theirs is left, each leader reaped."""
        for proc, _, _ in self.services.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(STOP_TIMEOUT_S)
        self.services.clear()


def _group(pgid: int) -> list[int]:
    found: list[int] = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


def _wait_group_gone(pgid: int, timeout_s: float = STOP_TIMEOUT_S) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.timeout(1800)
def test_readme_runs_as_written(tmp_path: Path, tidal_cache_dir: str) -> None:
    test_readme_marks_what_it_skips()  # never run an unmarked install
    readme = Readme(tmp_path, tidal_cache_dir)
    try:
        for block in readme_blocks():
            if block.lang in RUN_LANGS and block.skip_reason is None:
                readme.run_block(block)
        for port in list(readme.services):
            readme.stop_service(port)
    finally:
        readme.close()
