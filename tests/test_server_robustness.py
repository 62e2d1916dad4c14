"""`tidal serve` against hostile inputs: a JSON schema nested past the limit is a 400 naming it
(not a 500 traceback from the grammar compiler), and the engine stays healthy."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server_utils import Server, assert_openai_error, post_json
from tidal.frontend.entrypoints.openai.request_params import MAX_SCHEMA_DEPTH

FLAGS = ["--model-runner", "null", "--max-model-len", "256", "--num-kv-blocks", "128", "--served-model-name", "m"]


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str) -> Iterator[Server]:
    srv = Server(tiny_model_dir, FLAGS, tidal_cache_dir)
    yield srv
    srv.stop()


def nested_schema(depth: int) -> dict[str, Any]:
    """An object schema `depth` levels of {"type", "properties"} deep (built without recursion)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "structured_outputs_text"])
def test_deeply_nested_schema_is_400(server: Server, field: str) -> None:
    deep = nested_schema(300)  # 600 levels of JSON: past the schema limit, within the body's
    body: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 2}
    if field == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
    elif field == "structured_outputs":
        body["structured_outputs"] = {"json": deep}
    else:
        body["structured_outputs"] = {"json": json.dumps(deep)}
    status, reply = post_json(server.url + "/v1/completions", body)
    assert_openai_error(status, reply, 400)
    assert str(MAX_SCHEMA_DEPTH) in reply["error"]["message"]
    assert "nested" in reply["error"]["message"]
    # A schema within the limit is still accepted, and the engine still serves.
    body = {"model": "m", "prompt": "hi", "max_tokens": 2,
            "structured_outputs": {"json": nested_schema(3)}}
    assert post_json(server.url + "/v1/completions", body)[0] == 200

