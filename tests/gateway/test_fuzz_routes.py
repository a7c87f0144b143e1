"""Fuzzing every gateway route from our own OpenAPI description (docs/reference/openapi.yaml):
requests generated from each route's body schema (hypothesis, with `_from_schema` below for the
JSON Schema subset the description uses: hypothesis-jsonschema 0.23 does not run on current
hypothesis) and from arbitrary JSON,
sent to `aigw serve`'s real app (SQLite auth and metering, a mock replica) with an admin key.
Every answer is below 500, in the route's own error envelope when it is an error, and nothing
is logged with a traceback. Bounded: a fixed number of examples per route (~20 s in all)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.settings import GatewaySettings
from gateway.web.services import create_served_app
from tests.gateway.conftest import MODEL, LoopThread, start_app

SPEC = yaml.safe_load((Path(__file__).parents[2] / "docs/reference/openapi.yaml").read_text())
NUM_EXAMPLES = 30  # per route with a body (a GET route: 5, its body is ignored)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)


def _resolved(node: Any) -> Any:
    """The schema with every local $ref replaced by what it names (the spec has no cycles)."""
    if isinstance(node, dict):
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            return _resolved(SPEC["components"]["schemas"][name])
        return {key: _resolved(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolved(value) for value in node]
    return node


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid against `schema` (type, properties, required, items, enum, const, oneOf,
    allOf of objects), often with the optional properties left out."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        return st.one_of([from_schema(s) for s in schema["oneOf"]])
    if "allOf" in schema:
        merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
        for part in schema["allOf"]:
            merged["properties"].update(part.get("properties", {}))
            merged["required"] += part.get("required", [])
        return from_schema(merged)
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        if not properties:
            return st.dictionaries(st.text(max_size=8), JSON, max_size=3)
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in properties.items() if k in required},
            optional={k: from_schema(v) for k, v in properties.items() if k not in required})
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})), max_size=3)
    return {"string": st.text(max_size=40), "integer": st.integers(),
            "number": st.floats(allow_nan=False) | st.integers(), "boolean": st.booleans(),
            }.get(kind, JSON)


def _operations() -> list[tuple[str, str, dict[str, Any] | None, str]]:
    """(method, path, body schema or None, envelope) of every operation."""
    operations = []
    for path, item in SPEC["paths"].items():
        for method, operation in item.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            operations.append((method.upper(), path, _resolved(body["schema"]) if body else None,
                               operation["x-envelope"]))
    return operations


OPERATIONS = _operations()


@pytest.fixture(scope="module")
def served(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, str]]:
    """(the gateway's URL, an admin key): `aigw serve`'s app on a mock replica."""
    from bench.mock_upstream import MockState, create_mock_app

    tmp_path = tmp_path_factory.mktemp("fuzz")
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(MockState())))
    app = loop_thread.run(create_served_app(GatewaySettings(
        data_dir=tmp_path, limits={"tokens_per_minute": 10_000_000},
        models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url]}])))
    runner, url = loop_thread.run(start_app(app))
    admin_key = loop_thread.run(_admin_key(app))
    yield url, admin_key
    loop_thread.run(runner.cleanup())
    loop_thread.run(upstream.cleanup())


async def _admin_key(app: Any) -> str:
    """A new admin key of the served app's store (the app has made the `default` project)."""
    from auth import AuthSettings, open_auth
    from gateway.web.keys import SETTINGS

    services = await open_auth(AuthSettings(data_dir=app[SETTINGS].data_dir))
    try:
        _, key = await services.admin.create_key("default", ["ai_gateway:admin"])
        return key
    finally:
        await services.close()


def _check(envelope: str, path: str, answer: httpx.Response) -> None:
    assert answer.status_code < 500, (path, answer.status_code, answer.text[:500])
    if answer.status_code < 400 or envelope == "none":
        return
    payload = orjson.loads(answer.content)
    if envelope == "anthropic":
        assert payload["type"] == "error" and payload["error"]["type"], payload
    elif envelope == "openai":
        assert payload["error"]["type"] and payload["error"]["message"], payload
    else:  # admin, dashboard
        assert payload["error"]["code"] and payload["error"]["message"], payload


def _encoded(body: Any) -> bytes:
    """JSON as Python writes it: ints of any size, and NaN/Infinity (not JSON: hostile too)."""
    return json.dumps(body).encode()


def _with_model(body: Any) -> Any:
    """Half the generated bodies name the served model (else nearly all are 404s)."""
    return {**body, "model": MODEL} if isinstance(body, dict) else body


@pytest.mark.parametrize(("method", "path", "schema", "envelope"), OPERATIONS,
                         ids=[f"{m} {p}" for m, p, _, _ in OPERATIONS])
def test_no_route_answers_a_5xx_or_outside_its_envelope(
        served: tuple[str, str], caplog: pytest.LogCaptureFixture, method: str, path: str,
        schema: dict[str, Any] | None, envelope: str) -> None:
    url, admin_key = served
    headers = {"authorization": f"Bearer {admin_key}"}
    bodies = JSON if schema is None else st.one_of(
        from_schema(schema), from_schema(schema).map(_with_model), JSON)
    concrete = path.replace("{project}", "default").replace("{key_id}", "0123456789ab")
    caplog.set_level(logging.WARNING)

    @settings(max_examples=NUM_EXAMPLES if schema is not None else 5, deadline=None,
              database=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def one_request(body: Any) -> None:
        answer = client.request(method, url + concrete, headers=headers,
                                content=None if method == "GET" else _encoded(body))
        _check(envelope, path, answer)

    with httpx.Client(timeout=10) as client:
        one_request()
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
