"""vLLM's server flags beyond the basic ones (frontend/entrypoints/openai/server_flags.py), on real sockets:
CORS, X-Request-Id, --middleware, --response-role, the chat content format and default template
kwargs, forced usage chunks, HTTPS, a Unix socket; refused and malformed flags fail before the
engine starts, with one line naming the flag."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import httpx2 as httpx  # the HTTP library the openai client is built on
import openai
import pytest

from tests.server_utils import Server, http_request, post_json

ENGINE_FLAGS = ["--max-model-len", "256", "--num-kv-blocks", "128", "--max-num-seqs", "8"]
KEY = "sekret"
ORIGIN = "https://ui.example"
# Iterates content parts (needs --chat-template-content-format openai) and reads a template kwarg.
PARTS_TEMPLATE = ("{{ greeting }}|{% for m in messages %}{{ m['role'] }}:"
                  "{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %};{% endfor %}")
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = str(tmp_path_factory.mktemp("tpl") / "parts.jinja")
    with open(template, "w") as f:
        f.write(PARTS_TEMPLATE)
    srv = Server(tiny_model_dir, [
        *ENGINE_FLAGS, "--api-key", KEY, "--chat-template", template, "--allowed-origins", json.dumps([ORIGIN]),
        "--enable-request-id-headers", "--response-role", "bot", "--enable-force-include-usage",
        "--chat-template-content-format", "openai", "--default-chat-template-kwargs", '{"greeting": "hi"}',
        "--middleware", "tests.server_middleware.add_function_header",
        "--middleware", "tests.server_middleware.AddClassHeader",
        "--disable-fastapi-docs", "--h11-max-header-count", "64",  # accepted, change nothing
        "--disable-frontend-multiprocessing"],
        tidal_cache_dir)
    yield srv
    srv.stop()


def _raw(server: Server, method: str, path: str, headers: dict[str, str], body: bytes | None = None
         ) -> httpx.Response:
    return httpx.request(method, server.url + path, headers=headers, content=body, timeout=60)


def test_cors_preflight_and_origin_headers(server: Server) -> None:
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = _raw(server, "OPTIONS", "/v1/chat/completions", pre)  # no API key: browsers send none on preflight
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    bad = _raw(server, "OPTIONS", "/v1/chat/completions", {**pre, "Origin": "https://other.example"})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    got = _raw(server, "GET", "/v1/models", {"Origin": ORIGIN, **AUTH})
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in _raw(server, "GET", "/v1/models", AUTH).headers


def test_request_id_headers_middleware_and_api_key(server: Server) -> None:
    own = _raw(server, "GET", "/v1/models", {**AUTH, "X-Request-Id": "my-id-1"})
    assert own.status_code == 200 and own.headers["x-request-id"] == "my-id-1"
    new = _raw(server, "GET", "/v1/models", AUTH)
    assert len(new.headers["x-request-id"]) == 32 and new.headers["x-request-id"] != "my-id-1"
    assert new.headers["x-from-function"] == "1" and new.headers["x-from-class"] == "1"
    denied = _raw(server, "GET", "/v1/models", {})  # the key is still required; headers still added
    assert denied.status_code == 401 and "x-request-id" in denied.headers and denied.headers["x-from-class"] == "1"
    # only a CORS preflight (OPTIONS with Access-Control-Request-Method) skips the key check
    assert _raw(server, "OPTIONS", "/v1/models", {"Origin": ORIGIN}).status_code == 401


def test_response_role_content_format_and_template_kwargs(server: Server, tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"},
                                                                           {"type": "text", "text": "c"}]}]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for kwargs, greeting in ((None, "hi"), ({"greeting": "yo"}, "yo")):  # a request's kwargs win
        body = {"model": "", "messages": msgs, "add_generation_prompt": False}
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        status, out = post_json(server.url + "/tokenize", body, AUTH)
        assert status == 200, out
        assert out["tokens"] == tok.encode(f"{greeting}|user:[a];user:[b][c];", add_special_tokens=False)
    status, out = post_json(server.url + "/v1/chat/completions",
                            {"messages": msgs, "max_tokens": 3, "temperature": 0}, AUTH)
    assert status == 200 and out["choices"][0]["message"]["role"] == "bot", out
    status, out = post_json(server.url + "/v1/chat/completions",  # continuing the last message: its role
                            {"messages": msgs, "max_tokens": 3, "add_generation_prompt": False}, AUTH)
    assert status == 200 and out["choices"][0]["message"]["role"] == "user", out
    client = server.client(api_key=KEY)
    chunks = list(client.chat.completions.create(model="", messages=msgs, max_tokens=3, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "bot"
    # --enable-force-include-usage: a usage chunk ends the stream though stream_options was not sent
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    plain = list(client.completions.create(model="", prompt="x", max_tokens=2, temperature=0, stream=True))
    assert plain[-1].usage.completion_tokens == 2


def test_vllm_report_flags_off(server: Server) -> None:
    """Without --enable-prompt-tokens-details, --enable-server-load-tracking and
    --enable-tokenizer-info-endpoint, as vLLM renders it: usage.prompt_tokens_details null in a
    whole response and absent from a stream's usage chunk; GET /load 0; no /tokenizer_info. The
    ORCA report needs no flag (tests/test_server_vllm_routes.py has the flags on)."""
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": "x"}]})):
        status, out = post_json(server.url + path, {**body, "max_tokens": 2}, AUTH)
        assert status == 200 and "prompt_tokens_details" in out["usage"], out
        assert out["usage"]["prompt_tokens_details"] is None
        streamed = _raw(server, "POST", path, {**AUTH, "Content-Type": "application/json"},
                        json.dumps({**body, "max_tokens": 2, "stream": True}).encode())
        events = [line[6:] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
        closing = json.loads(events[-2])  # --enable-force-include-usage: the usage chunk before [DONE]
        assert closing["choices"] == [] and closing["usage"]["completion_tokens"] == 2
        assert "prompt_tokens_details" not in closing["usage"]
    loaded = _raw(server, "GET", "/load", {})  # open, as /health: load balancers poll it
    assert loaded.status_code == 200 and loaded.json() == {"server_load": 0}
    assert _raw(server, "GET", "/tokenizer_info", AUTH).status_code == 404
    orca = _raw(server, "POST", "/v1/completions", {**AUTH, "Content-Type": "application/json",
                                                    "endpoint-load-metrics-format": "JSON"},
                json.dumps({"prompt": "x", "max_tokens": 1}).encode())
    assert orca.status_code == 200 and orca.headers["endpoint-load-metrics"].startswith("JSON {\"named_metrics\": ")


def test_access_log_filter_drops_only_the_listed_paths() -> None:
    from tidal.frontend.entrypoints.openai.server_flags import filter_access_log

    log = logging.getLogger("uvicorn.access")
    kept: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: kept.append(record.getMessage())  # type: ignore[method-assign]
    log.addHandler(handler)
    saved = log.filters[:], log.level, log.propagate
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        filter_access_log(argparse.Namespace(disable_access_log_for_endpoints=" /health, /metrics",
                                             root_path="/api/"))
        # uvicorn's own record shape; its path includes the root path
        for path in ("/api/health", "/api/metrics?x=1", "/api/v1/models", "/api/healthz"):
            log.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", path, "1.1", 200)
    finally:
        log.removeHandler(handler)
        log.filters[:], log.level, log.propagate = saved[0], saved[1], saved[2]
    assert [m.split(" ")[3] for m in kept] == ["/api/v1/models", "/api/healthz"]


def test_logging_config_file_applies_in_every_tidal_process(tmp_path: os.PathLike[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """setup_logging (every tidal process runs it) applies TIDAL_LOGGING_CONFIG_PATH, which
    --log-config-file sets for the engine processes, and keeps the loggers it does not name."""
    from tidal.utils.logging_utils import setup_logging

    out = os.path.join(tmp_path, "log.txt")
    config = os.path.join(tmp_path, "log.json")
    with open(config, "w") as f:
        json.dump({"version": 1, "handlers": {"f": {"class": "logging.FileHandler", "filename": out}},
                   "loggers": {"tidal.flagtest": {"handlers": ["f"], "level": "INFO", "propagate": False}}}, f)
    before = logging.getLogger("tidal.flagtest.before")
    monkeypatch.setenv("TIDAL_LOGGING_CONFIG_PATH", config)
    try:
        setup_logging("test")
        logging.getLogger("tidal.flagtest").info("configured %d", 1)
        assert not before.disabled  # dictConfig's default would have disabled it
    finally:
        for h in logging.getLogger("tidal.flagtest").handlers:
            h.close()
        logging.getLogger("tidal.flagtest").handlers.clear()
    with open(out) as f:
        assert f.read() == "configured 1\n"


@pytest.mark.parametrize("flags,expected", [
    (["--lora-modules", "a=/tmp/a"], "--lora-modules: tidal does not support LoRA adapters"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "invalid tool call parser: nope (chose from"),
    (["--enable-log-outputs"], "--enable-log-outputs: tidal does not support logging generated outputs"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "7"], "--ssl-cert-reqs 7"),
    (["--middleware", "tests.server_middleware.missing"], "--middleware 'tests.server_middleware.missing'"),
    (["--middleware", "tests.server_middleware.not_middleware"], "expected an ASGI middleware class"),
    (["--log-config-file", "/nonexistent/log.json"], "--log-config-file: logging config '/nonexistent/log.json'"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"], "--ssl-ca-certs must name"),
    (["--default-chat-template-kwargs", '{"tokenize": true}'], "['tokenize'] are apply_chat_template's own"),
    (["--tool-parser-plugin", "my.plugin"], "--tool-parser-plugin: tidal does not support tool parser plugins"),
])
def test_refused_and_malformed_server_flags(flags: list[str], expected: str) -> None:
    from tidal.frontend.entrypoints.cli import build_parser
    from tidal.frontend.entrypoints.openai.server_flags import check_server_flags

    with pytest.raises(ValueError, match=re.escape(expected)):
        check_server_flags(build_parser().parse_args(["serve", "m", *flags]))


def test_a_refused_flag_stops_tidal_serve_before_the_engine(tiny_model_dir: str, tidal_cache_dir: str) -> None:
    env = {**os.environ, "TIDAL_CACHE_DIR": tidal_cache_dir}
    proc = subprocess.run([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "serve", tiny_model_dir, "--port", "1",
                           "--lora-modules", "a=/tmp/a"], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "tidal serve: error: ValueError: --lora-modules: tidal does not support LoRA adapters"], proc.stderr
    bad = subprocess.run([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "serve", tiny_model_dir,
                          "--allowed-origins", "*"], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert bad.returncode == 2 and "argument --allowed-origins: not a JSON list" in bad.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https(tiny_model_dir: str, tidal_cache_dir: str, tmp_path: os.PathLike[str]) -> None:
    key, cert = os.path.join(tmp_path, "key.pem"), os.path.join(tmp_path, "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    trust = ssl.create_default_context(cafile=cert)

    def healthy(srv: Server) -> bool:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{srv.port}/health", context=trust, timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    srv = Server(tiny_model_dir, [*ENGINE_FLAGS, "--ssl-keyfile", key, "--ssl-certfile", cert], tidal_cache_dir,
                 healthy=healthy)
    try:
        url = f"https://127.0.0.1:{srv.port}/v1"
        with httpx.Client(verify=trust) as http:
            client = openai.OpenAI(base_url=url, api_key="none", http_client=http, max_retries=0)
            res = client.completions.create(model="", prompt="x", max_tokens=4, temperature=0)
            assert res.usage.completion_tokens == 4
        assert http_request("GET", f"http://127.0.0.1:{srv.port}/health")[0] != 200  # no plain HTTP there
    finally:
        srv.stop()


def test_unix_domain_socket(tiny_model_dir: str, tidal_cache_dir: str, tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "tidal.sock")

    def healthy(srv: Server) -> bool:
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=5) as c:
                return c.get("http://localhost/health").status_code == 200
        except httpx.HTTPError:
            return False

    srv = Server(tiny_model_dir, [*ENGINE_FLAGS, "--uds", path], tidal_cache_dir, healthy=healthy)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=path)) as http:
            client = openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=http, max_retries=0)
            out = client.completions.create(model="", prompt="x", max_tokens=3, temperature=0)
            assert out.usage.completion_tokens == 3
        assert http_request("GET", f"http://127.0.0.1:{srv.port}/health")[0] == 0  # nothing on the TCP port
    finally:
        srv.stop()
    assert srv.proc.returncode == 0 and not os.path.exists(path)  # the socket file goes with the server


def test_root_path_serves_the_prefixed_and_the_plain_paths(tiny_model_dir: str, tidal_cache_dir: str) -> None:
    """--root-path behind either kind of proxy (vLLM's behaviour): one that forwards the prefix
    and one that strips it; the key check and the open paths hold under both."""
    srv = Server(tiny_model_dir, [*ENGINE_FLAGS, "--model-runner", "null", "--root-path", "/llm", "--api-key", KEY,
                                  "--served-model-name", "m"], tidal_cache_dir)
    try:
        for prefix in ("/llm", ""):
            client = openai.OpenAI(base_url=f"{srv.url}{prefix}/v1", api_key=KEY, max_retries=0, timeout=60)
            out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
            assert out.usage.completion_tokens == 2, prefix
            assert [m.id for m in client.models.list()] == ["m"], prefix
            assert _raw(srv, "GET", f"{prefix}/v1/models", {}).status_code == 401, prefix
            assert _raw(srv, "GET", f"{prefix}/health", {}).status_code == 200, prefix
        assert _raw(srv, "GET", "/other/v1/models", AUTH).status_code == 404
    finally:
        srv.stop()
