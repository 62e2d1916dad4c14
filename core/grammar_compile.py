"""Grammar compiles in child processes that can be stopped: the time limit and the aborts of
structured-output requests (core/structured_output.py submits, this module runs).

xgrammar's compile is one C++ call that nothing interrupts in-thread (a JSON schema of arrays
nested 1000 deep compiles for minutes), so a thread that outlived its time limit or its request
would burn a core until it ended. Here every compile runs in a child process that is killed
instead. Measured with xgrammar 0.2.9 on 4k-32k-token vocabularies: a typical schema compiles
in 4-15 ms; its compiled grammar serialises to 0.1-1.3 MB and deserialises in under 15 ms
(xgrammar releases the GIL for both, so the busy loop runs on); a child starts in ~2 s (it
imports xgrammar, which imports torch), which slots pay ahead of their first job.

Invariants:
- `NUM_SLOTS` slots, each one thread here and at most one child running one compile at a time:
  a slow compile holds one slot while the others go on; jobs wait in one FIFO queue.
- Every job's future gets exactly one outcome: the CompiledGrammar; InvalidGrammarError (the
  spec), GrammarCompileTimeout (past `timeout_s`, counted from when its child got the job),
  another ValueError (no tokenizer), RuntimeError (the child failed) or CancelledError (`cancel`).
- A job past its limit, or cancelled while it runs, has its child killed and reaped at once by
  its slot thread; the slot then starts a fresh child for the next job.
- Children are forked by the pool's SpawnerThread and arm PR_SET_PDEATHSIG: they die with the
  process that owns the pool; `shutdown` kills and reaps them.
- Between processes: typed msgspec messages over a socketpair, never pickle.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

import msgspec

from tidal.utils.deadline import Deadline
from tidal.utils.process import SpawnerThread, exit_with_parent

logger = logging.getLogger(__name__)

NUM_SLOTS = 2  # compiles at a time (each child also parallelises one compile over its threads)
_START_TIMEOUT_S = 120.0  # a child's start: Python, importing xgrammar (torch), the vocabulary
_REAP_TIMEOUT_S = 10.0  # waiting for a killed child to be reaped
_IDLE_POLL_S = 1.0  # an idle slot thread checks for shutdown this often
_HELLO, _READY = b"hello", b"ready"


def _expect(conn: Connection, message: bytes, deadline: Deadline) -> None:
    """Receive `message` before `deadline`: TimeoutError, or EOFError for a child that died
    (or sent anything else)."""
    if not conn.poll(deadline.remaining_s()):
        raise TimeoutError
    if conn.recv_bytes() != message:
        raise EOFError


class WorkerInit(msgspec.Struct, array_like=True):
    tokenizer_info: str  # xgrammar.TokenizerInfo.serialize_json()
    max_threads: int


class CompileTask(msgspec.Struct, array_like=True):
    # json | json_object | regex | grammar (choices arrive as their EBNF) | structural_tag
    kind: str
    spec: str
    any_whitespace: bool = True
    max_whitespace_cnt: int | None = None


class CompileReply(msgspec.Struct, array_like=True):
    grammar: str = ""  # CompiledGrammar.serialize_json(), when error is empty
    error: str = ""  # xgrammar's message for an invalid spec


class CompileJob:
    """One compile: its task, its future, and whether it was cancelled (set under its slot's
    lock, so a cancel that races the start of the job is never lost)."""

    def __init__(self, task: CompileTask, timeout_s: float) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self.future: cf.Future[Any] = cf.Future()
        self.cancel_requested = False
        self.sent = False  # its child has it (from here its time limit runs)


class InvalidGrammarError(ValueError):
    """xgrammar refused the spec (its message, without its source-location prefix)."""


class GrammarCompileTimeout(ValueError):
    """The compile ran past the engine's limit: the request's (too complex) spec, HTTP 400."""


class CompilePool:
    """Compiles in `NUM_SLOTS` child processes. `init_payload` gives the children the model's
    vocabulary (called on a slot thread: it may load the tokenizer, seconds); `deserialize`
    turns a child's reply into a CompiledGrammar against the parent's own TokenizerInfo."""

    def __init__(self, init_payload: Callable[[], WorkerInit], deserialize: Callable[[str], Any],
                 num_slots: int = NUM_SLOTS) -> None:
        self.init_payload = init_payload
        self.deserialize = deserialize
        self.closed = False
        self._queue: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._spawner = SpawnerThread("tidal-grammar-spawner")
        self._slots = [_Slot(self, i) for i in range(num_slots)]

    def submit(self, task: CompileTask, timeout_s: float) -> CompileJob:
        if self.closed:
            raise RuntimeError("the grammar compile pool is shut down")
        job = CompileJob(task, timeout_s)
        self._queue.put(job)
        return job

    def cancel(self, job: CompileJob) -> None:
        """Stop `job`: a queued one never starts; a running one has its child killed (its slot
        reaps it and starts another). Returns at once; a finished job is left as it is."""
        if job.future.cancel():
            return
        for slot in self._slots:
            slot.cancel(job)

    def running_pid(self, job: CompileJob) -> int | None:
        """The pid of the child compiling `job` now, if one is (tests: a stopped compile stopped)."""
        for slot in self._slots:
            with slot.lock:
                if slot.job is job and slot.proc is not None and job.sent:
                    return slot.proc.pid
        return None

    def num_ready(self) -> int:
        """How many slots have a started child waiting for (or running) a job."""
        return sum(slot.ready for slot in self._slots)

    def shutdown(self) -> None:
        """Kill every child, reap them, end the slot threads; queued jobs are cancelled."""
        self.closed = True
        for _ in self._slots:
            self._queue.put(None)
        for slot in self._slots:
            slot.kill()
        for slot in self._slots:
            slot.join()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.cancel()
        self._spawner.release()


class _Slot:
    """One compile at a time, in a child process of its own (see the module invariants)."""

    def __init__(self, pool: CompilePool, index: int) -> None:
        self.pool = pool
        self.lock = threading.Lock()  # guards proc/conn/job against cancel() and kill()
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.job: CompileJob | None = None
        self.ready = False  # its child is started and has its compiler built
        self.thread = threading.Thread(target=self._run, name=f"tidal-grammar-{index}", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ from other threads
    def cancel(self, job: CompileJob) -> None:
        with self.lock:
            if self.job is job:
                job.cancel_requested = True
                self._kill_locked()

    def kill(self) -> None:
        with self.lock:
            self._kill_locked()

    def _kill_locked(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.kill()  # the slot thread, blocked on the child, sees EOF and reaps it
            except OSError:
                pass

    def join(self) -> None:
        self.thread.join(timeout=_REAP_TIMEOUT_S)
        self._reap()

    # ------------------------------------------------------------------ slot thread
    def _run(self) -> None:
        pool = self.pool
        while not pool.closed:
            try:
                self._ensure_child()  # warm ahead of the next job (a failure is retried by it)
            except Exception:
                pass
            job = self._next_job()
            if job is None or pool.closed:
                if job is not None:
                    job.future.cancel()
                break
            with self.lock:
                self.job = job  # from here a cancel kills the child; before, the future says it
            if not job.future.set_running_or_notify_cancel():
                with self.lock:
                    self.job = None
                continue
            try:
                grammar = self._compile(job)
            except BaseException as e:  # noqa: BLE001 - the job's outcome
                job.future.set_exception(cf.CancelledError() if job.cancel_requested else e)
            else:
                job.future.set_result(grammar)
            finally:
                with self.lock:
                    self.job = None
        self.kill()
        self._reap()

    def _next_job(self) -> CompileJob | None:
        """The next job, or None once the pool is shut down (its sentinel, or `closed`)."""
        while not self.pool.closed:
            try:
                return self.pool._queue.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                continue
        return None

    def _compile(self, job: CompileJob) -> Any:
        conn = self._ensure_child()
        with self.lock:
            if job.cancel_requested:  # cancelled while its child started (which the cancel killed)
                raise cf.CancelledError()
        try:
            conn.send_bytes(msgspec.msgpack.encode(job.task))
            job.sent = True
            if not conn.poll(job.timeout_s):
                self.kill()
                self._reap()
                raise GrammarCompileTimeout(
                    f"compiling the {job.task.kind} grammar took longer than the engine's limit of "
                    f"{job.timeout_s:g} s (grammar_compile_timeout_s) and was stopped; simplify it, "
                    "or raise --grammar-compile-timeout-s")
            data = conn.recv_bytes()
        except (EOFError, OSError):
            self.kill()
            code = self._reap()
            if job.cancel_requested:
                raise cf.CancelledError() from None
            raise RuntimeError(f"the grammar compiler process died (exit code {code})") from None
        reply = msgspec.msgpack.decode(data, type=CompileReply)
        if reply.error:
            raise InvalidGrammarError(reply.error)
        return self.pool.deserialize(reply.grammar)

    def _ensure_child(self) -> Connection:
        """This slot's live child, started (and waited for) if there is none."""
        with self.lock:
            if self.proc is not None and self.proc.poll() is None and self.conn is not None:
                return self.conn
        self._reap()
        parent_sock, child_sock = socket.socketpair()
        try:
            fd = child_sock.fileno()
            proc = self.pool._spawner.call(lambda: subprocess.Popen(
                [sys.executable, "-m", "tidal.core.grammar_compile", str(fd)], pass_fds=(fd,),
                stdin=subprocess.DEVNULL, close_fds=True), timeout_s=_START_TIMEOUT_S)
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        conn = Connection(parent_sock.detach())
        with self.lock:
            self.proc, self.conn = proc, conn
            if self.pool.closed:
                self._kill_locked()
        deadline = Deadline(_START_TIMEOUT_S)
        try:
            # The child imports xgrammar while this thread loads the vocabulary (seconds each).
            init = msgspec.msgpack.encode(self.pool.init_payload())
            # Its hello says it is reading, so sending the (MBs of) vocabulary cannot block
            # on a child that never reads; READY says its compiler is built.
            _expect(conn, _HELLO, deadline)
            conn.send_bytes(init)
            _expect(conn, _READY, deadline)
            with self.lock:
                self.ready = self.proc is proc
        except BaseException as e:
            self.kill()
            code = self._reap()
            if isinstance(e, TimeoutError):
                raise RuntimeError(f"the grammar compiler process did not start within "
                                   f"{_START_TIMEOUT_S:g} s") from None
            if isinstance(e, (EOFError, OSError)):
                raise RuntimeError(f"the grammar compiler process exited at start (exit code {code})") from None
            raise  # no vocabulary (the tokenizer did not load): the jobs' error
        return conn

    def _reap(self) -> int | None:
        """Wait for this slot's (killed or exited) child and drop it; its exit code."""
        with self.lock:
            proc, conn = self.proc, self.conn
            self.proc = self.conn = None
            self.ready = False
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        try:
            return proc.wait(timeout=_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # killed but not gone: leave it to the kernel
            logger.error("grammar compiler process %d did not exit after SIGKILL", proc.pid)
            return None


# ---------------------------------------------------------------------- child process
def compile_task(compiler: Any, task: CompileTask) -> Any:
    """The CompiledGrammar of `task` (exceptions: xgrammar's, for an invalid spec)."""
    import xgrammar as xgr

    if task.kind in ("json", "json_object"):
        schema = task.spec if task.kind == "json" else '{"type": "object"}'
        bound = task.max_whitespace_cnt if task.any_whitespace else None  # unused without free whitespace
        return compiler.compile_json_schema(schema, any_whitespace=task.any_whitespace, max_whitespace_cnt=bound)
    if task.kind == "regex":
        return compiler.compile_regex(task.spec)
    if task.kind == "grammar":
        return compiler.compile_grammar(task.spec)
    if task.kind == "structural_tag":
        tag = json.loads(task.spec)
        if "structures" in tag:  # vLLM's original format: begin/schema/end items and triggers
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return compiler.compile_structural_tag(items, tag["triggers"])
        return compiler.compile_structural_tag(task.spec)
    raise ValueError(f"unknown grammar kind {task.kind!r}")


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without its '[time] file.cc:line:' prefix."""
    text = str(e).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
        head, sep, rest = text.partition(": ")
        if sep and (".cc:" in head or ".h:" in head):
            text = rest
    return text.splitlines()[0] if text else type(e).__name__


def _child_main(fd: int) -> None:
    exit_with_parent()  # SIGKILL when the engine core dies, even mid-compile
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    conn = Connection(fd)
    try:
        import xgrammar as xgr  # seconds (it imports torch): meanwhile the parent loads the vocabulary

        conn.send_bytes(_HELLO)
        init = msgspec.msgpack.decode(conn.recv_bytes(), type=WorkerInit)
        info = xgr.TokenizerInfo.deserialize_json(init.tokenizer_info)
        # xgrammar's compiler cache (bounded in bytes: vLLM's VLLM_XGRAMMAR_CACHE_MB default).
        compiler = xgr.GrammarCompiler(info, max_threads=init.max_threads, cache_limit_bytes=512 << 20)
        conn.send_bytes(_READY)
        while True:
            task = msgspec.msgpack.decode(conn.recv_bytes(), type=CompileTask)
            try:
                reply = CompileReply(grammar=compile_task(compiler, task).serialize_json())
            except Exception as e:  # an invalid spec: the request's error, the child serves on
                reply = CompileReply(error=xgrammar_message(e))
            conn.send_bytes(msgspec.msgpack.encode(reply))
    except (EOFError, OSError):  # the parent closed the socket (or is gone): done
        pass


def max_compile_threads() -> int:
    """xgrammar threads per child: the cores shared among the slots (at most 8 each)."""
    return max(1, min(8, (os.cpu_count() or 1) // NUM_SLOTS))


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
