"""`tidal serve`'s uvicorn server and its shutdown (api_server.run_server starts it).

A shutdown is never a crash. The SIGTERM or SIGINT usually reaches the whole process group
(`timeout`, systemd's default KillMode, a terminal's Ctrl-C), so the engine core and its workers
get it at the same moment; they leave it to this process (core/core_proc.py, tidal_pkg/utils/process.py).
This server drains: the engine is told it is shutting down (a core that goes from then on is
not restarted), uvicorn stops accepting and waits for the requests in flight, and at
--shutdown-timeout the ones still running are aborted so that every stream still ends with its
last chunk and `data: [DONE]`; then the lifespan exit stops the core and its workers, and the
process exits 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from types import FrameType

import uvicorn
from tidal.frontend import AsyncLLM
from tidal.frontend.entrypoints.openai.disconnect import CancelOnDisconnect
from tidal.protocol.errors import EngineDeadError

logger = logging.getLogger("tidal.frontend.entrypoints.openai.api_server")

# After --shutdown-timeout aborted what was left, how long its streams get to write their last
# chunk and `data: [DONE]` before uvicorn cancels them anyway (a client that stopped reading):
# uvicorn's timeout_graceful_shutdown is --shutdown-timeout plus this.
ABORT_GRACE_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server with SIGINT/SIGTERM handled on the loop (uvicorn's own handling re-raises
    the signal once serve() returns, which would end the process by the signal instead of a clean
    exit 0 after the engine was shut down), and a shutdown that ends every stream cleanly.

    The signal usually reaches the whole process group -- `timeout`, systemd, a terminal's
    Ctrl-C -- so the engine core and its workers get it too; they leave it to this process
    (core/core_proc.py). At the first signal the engine is told it is shutting down (a core
    that goes from then on is not restarted), uvicorn stops accepting and waits for the
    requests in flight; at --shutdown-timeout those still running are aborted, so each stream
    still ends with its last chunk (finish_reason "abort") and `data: [DONE]`. uvicorn's own
    cancel, which cuts a stream off mid-body, is only a backstop ABORT_GRACE_S later.

    The app is served under CancelOnDisconnect (disconnect.py), outermost: a request whose
    client leaves is cancelled wherever its work is, which aborts it in the core, and one
    whose client is gone before it reaches the engine is never sent there."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout_s: float) -> None:
        if not isinstance(config.app, (str, CancelOnDisconnect)):
            config.app = CancelOnDisconnect(config.app)
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self._ending: asyncio.Task[None] | None = None  # aborts what is left at the timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._ending is None:  # the first signal (a second SIGINT forces uvicorn's exit)
            self.engine.begin_shutdown()  # no core restart from now on
            self._ending = asyncio.get_running_loop().create_task(self._abort_at_timeout(),
                                                                  name="tidal-shutdown-timeout")
        super().handle_exit(sig, frame)

    async def _abort_at_timeout(self) -> None:
        await asyncio.sleep(self.shutdown_timeout_s)
        left = self.engine.get_num_unfinished_requests()
        if left:
            logger.info("--shutdown-timeout (%gs) reached: aborting the %d request(s) still running",
                        self.shutdown_timeout_s, left)
        try:
            # vLLM's pause: aborts every request in flight and waits until their streams ended.
            await self.engine.pause_generation(clear_cache=False)
        except EngineDeadError:
            pass  # nothing left to abort: the engine's end already ended every stream

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            if self._ending is not None:
                self._ending.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)
