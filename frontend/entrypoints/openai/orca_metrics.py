"""ORCA load reports (vLLM's vllm/entrypoints/serve/utils/orca_metrics.py): a request that sends
`endpoint-load-metrics-format: TEXT` or `JSON` (any case) gets an `endpoint-load-metrics` header
on its whole (non-streamed) chat or completions response, for load balancers such as Envoy
(https://github.com/cncf/xds/blob/main/xds/data/orca/v3/orca_load_report.proto):

    endpoint-load-metrics: TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.0
    endpoint-load-metrics: JSON {"named_metrics": {"num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}}

The named metrics are vLLM's two, read from the engine's Prometheus gauges (first sample, in the
registry's order); with stats off there are none (the report is then empty). Another format
(vLLM names BIN but does not make it) gets no header. As in vLLM, no flag turns this on or off.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

logger = logging.getLogger(__name__)

FORMAT_HEADER = "endpoint-load-metrics-format"
REPORT_HEADER = "endpoint-load-metrics"
ORCA_METRICS = ("kv_cache_usage_perc", "num_requests_waiting")  # vLLM's names, without its "vllm:"


def named_metrics(metrics: Any) -> list[tuple[str, float]]:
    """(name, value) of the ORCA metrics the engine's registry has (`metrics`: AsyncLLM.metrics,
    None with stats off)."""
    if metrics is None:
        return []
    wanted = {metrics.prefix + name: name for name in ORCA_METRICS}
    out = []
    for family in metrics.registry.collect():
        name = wanted.get(family.name)
        if name is not None and family.samples:
            out.append((name, float(family.samples[0].value)))
    return out


def orca_header(metrics_format: str, named: list[tuple[str, float]]) -> str | None:
    """The `endpoint-load-metrics` value in `metrics_format` (TEXT or JSON, any case), or None."""
    kind = metrics_format.lower()
    if kind == "text":
        return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in named)
    if kind == "json":
        return "JSON " + json.dumps({"named_metrics": dict(named)})
    logger.debug("`%s` format is not supported in the ORCA response header", metrics_format)
    return None


def with_orca_header(handler: Any, engine: Any) -> Any:
    """`handler` (request body, Request -> Response) whose whole responses carry the report the
    request asks for."""

    async def run(req: Any, request: Request) -> Response:
        response = await handler(req, request)
        metrics_format = request.headers.get(FORMAT_HEADER)
        if metrics_format and not isinstance(response, StreamingResponse):
            value = orca_header(metrics_format, named_metrics(engine.metrics))
            if value is not None:
                response.headers[REPORT_HEADER] = value
        return response

    return run
