"""`tidal serve --api-server-count N`: N API server processes on one port in front of the same
engine cores (vLLM's design for front-ends that one Python process cannot keep up with).

This process (the parent) starts the engine cores headless (core/dp_node.py's CoreFleet: one
per data-parallel rank, on private ipc paths, each restarted on its path if it dies), binds the
listening socket once, and starts N `tidal serve` children that inherit it (uvicorn serves the
inherited fd: the kernel hands each connection to one of them). Every child's front-end reaches
every engine (a client per core, as a headless core's front-end), so any child routes any
request to the least loaded engine. `/metrics` is aggregated across the children:
prometheus_client's multiprocess mode, over a private directory (counters and histograms
summed, the engine gauges the most recent value). SIGTERM/SIGINT reach the children, which
drain, then the engines stop; a child that dies takes the server down (nothing would take its
connections' place).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from tidal.frontend.engine_args import config_from_args
from tidal.utils.network import listen_socket
from tidal.utils.zmq_utils import IpcDir

logger = logging.getLogger(__name__)

CHILD_ENV = "TIDAL_API_SERVER_CHILD"  # JSON {"fd": listening fd, "engines": [address, ...]}


def child_settings() -> dict[str, Any] | None:
    """In an API server started by run_api_servers: its listening fd and the engines."""
    raw = os.environ.get(CHILD_ENV)
    return None if raw is None else dict(json.loads(raw))


def apply_child_settings(args: Any, settings: dict[str, Any]) -> None:
    """Point this child's engine args at the running engines."""
    engines = settings["engines"]
    if len(engines) == 1:
        args.core_address = engines[0]
    else:
        args.engine_core_addresses = list(engines)


def _child_argv(argv: list[str]) -> list[str]:
    """The parent's `serve ...` arguments without --api-server-count (and its value)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--api-server-count", "-asc"):
            skip = True
            continue
        if arg.startswith("--api-server-count="):
            continue
        out.append(arg)
    return out


def run_api_servers(args: Any, argv: list[str]) -> int:
    from tidal.core.dp_node import CoreFleet

    count = args.api_server_count
    model = args.model or args.model_flag
    if model is None:
        from tidal.frontend.entrypoints.make_model import ensure_default_model

        model = ensure_default_model()
    config = config_from_args(args, model=model)
    if config.core_address is not None or config.data_parallel_backend != "mp" or config.dp_local_size != \
            config.data_parallel_size:
        raise ValueError("--api-server-count > 1 starts the engines on this host itself: it cannot be combined "
                         "with --core-address, engines on other hosts or --data-parallel-backend ray")
    if args.uds:
        raise ValueError("--api-server-count > 1 listens on TCP (--host/--port), not on --uds")
    ipc = IpcDir("tidal-engines-")
    metrics_dir = tempfile.mkdtemp(prefix="tidal-metrics-")
    addresses = [ipc.address(f"engine-{rank}") for rank in range(config.data_parallel_size)]
    fleet = CoreFleet(config, range(config.data_parallel_size), addresses)
    listener = listen_socket(args.host, port=args.port)
    listener.set_inheritable(True)
    stop = threading.Event()
    children: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        fleet.start()
        settings = json.dumps({"fd": listener.fileno(), "engines": addresses})
        env = {**os.environ, CHILD_ENV: settings, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        cmd = [sys.executable, "-m", "tidal.frontend.entrypoints.cli", *_child_argv(argv)]
        for i in range(count):
            children.append(subprocess.Popen(cmd, env={**env, "TIDAL_API_SERVER_INDEX": str(i)},
                                             pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL))
        logger.info("tidal serve: %d API servers on %s:%d in front of %d engine(s)", count, args.host, args.port,
                    len(addresses))
        while not stop.wait(0.2):
            fleet.keep_running()
            if (dead := [c for c in children if c.poll() is not None]):
                logger.error("API server (pid %d) exited with code %s: stopping the others", dead[0].pid,
                             dead[0].returncode)
                break
        return 0
    finally:
        listener.close()
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(args.shutdown_timeout + 20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
        fleet.stop()
        ipc.cleanup()
        shutil.rmtree(metrics_dir, ignore_errors=True)
