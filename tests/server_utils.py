"""Helpers for the `tidal serve` tests: a server in a subprocess on a free loopback port, the
official `openai` client pointed at it, and /metrics readings."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import openai
import psutil
from tidal.utils.network import free_port

STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
# A chat template for the tiny test models (whose tokenizers may have none).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Server:
    """`python -m tidal.frontend.entrypoints.cli serve MODEL ARGS` on 127.0.0.1; `stop()` always reaps it."""

    def __init__(self, model: str, args: list[str], cache_dir: str, env: dict[str, str] | None = None,
                 healthy: Callable[[Server], bool] | None = None) -> None:
        """`healthy(server)`: whether it is up, for a server not on plain HTTP at server.url
        (default: GET /health answers 200 there)."""
        self.port = free_port()
        self._healthy = healthy or (lambda srv: http_get(srv.url + "/health")[0] == 200)
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tidal.frontend.entrypoints.cli", "serve", model, "--port", str(self.port),
               "--disable-uvicorn-access-log", *args]
        full_env = {k: v for k, v in os.environ.items() if k not in ("TIDAL_API_KEY", "VLLM_API_KEY")}
        full_env.update(TIDAL_CACHE_DIR=cache_dir, **(env or {}))
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tidal serve exited with {self.proc.returncode}:\n{self.output()}")
            if self._healthy(self):
                return
            time.sleep(0.2)
        raise TimeoutError(f"tidal serve not healthy after {STARTUP_TIMEOUT_S} s")

    def output(self) -> str:
        """The server's log (once it has exited)."""
        if self.proc.stdout is None or self.proc.poll() is None:
            return ""
        return self.proc.stdout.read().decode(errors="replace")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        kids = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        for p in kids:  # a crash must not leave an engine core behind
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def client(self, api_key: str = "none", timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def async_client(self, api_key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        status, body = http_get(self.url + "/metrics")
        assert status == 200, body
        return parse_metrics(body.decode())


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return http_request("GET", url, None, headers)


def http_request(method: str, url: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, bytes]:
    """(status, body) of one request; (0, b"") when nothing answers."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def post_json(url: str, obj: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, body = http_request("POST", url, json.dumps(obj).encode(), headers)
    return status, json.loads(body) if body else None


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for the vllm: and tidal: series, and bare `name` -> the sum over its labels."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(("vllm:", "tidal:")):
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
        name = key.split("{", 1)[0]
        if name != key:
            values[name] = values.get(name, 0.0) + float(value)
    return values


def assert_openai_error(status: int, body: Any, expected_status: int) -> None:
    assert status == expected_status, (status, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == expected_status and isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]


def model_without_chat_template(src: str, dst: str) -> str:
    """A copy of the model dir whose tokenizer has no chat template."""
    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(dst, name)):
            os.remove(os.path.join(dst, name))
    return dst


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
