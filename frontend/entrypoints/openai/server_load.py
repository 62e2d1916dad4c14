"""vLLM's server load (--enable-server-load-tracking; vllm/entrypoints/serve/utils/api_utils.py's
load_aware_call and the basic router's `GET /load`): the number of generation requests in
flight, from their arrival until their response (a whole stream too) has been sent or has
failed. `GET /load` answers `{"server_load": N}` always; without the flag N stays 0.

Counted, as in vLLM: /v1/chat/completions, /v1/chat/completions/batch and /v1/completions (and
so /invocations, which hands a request to one of them). Not counted: tokenize, models, probes.
"""
from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class LoadReport(msgspec.Struct):
    server_load: int


class ServerLoad:
    """The in-flight count of one app, and the wrapper that keeps it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight = 0

    def tracked(self, handler: Any) -> Any:
        """`handler` (request body, Request -> Response), counted while it runs and while its
        response is sent; unchanged when tracking is off."""
        if not self.enabled:
            return handler

        async def run(req: Any, request: Request) -> Any:
            self.in_flight += 1
            try:
                response = await handler(req, request)
            except BaseException:
                self.in_flight -= 1
                raise
            return _Counted(response, self)

        return run

    async def endpoint(self, request: Request) -> Response:
        """GET /load."""
        return Response(msgspec.json.encode(LoadReport(self.in_flight)), media_type="application/json")


class _Counted:
    """A response that leaves the count when it has been sent (or its sending failed, or the
    client left mid-stream)."""

    def __init__(self, response: Any, load: ServerLoad) -> None:
        self.response, self.load = response, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.load.in_flight -= 1
