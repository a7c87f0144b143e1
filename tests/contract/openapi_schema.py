"""OpenAI's published OpenAPI description (vendored next to this file) as JSON Schema validators.

OpenAPI 3.1 schemas are JSON Schema 2020-12 except for OpenAPI's `nullable: true`, which is read
here as "null is allowed too". `$ref`s resolve inside the one document; `discriminator` is ignored
(every `anyOf`/`oneOf` variant is tried), formats are not asserted. See SOURCE.md for the commit.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).with_name("openai") / "openapi.json.gz"
SPEC_URI = "urn:openai:openapi"


def _null_allowed(node: Any) -> Any:
    """A copy of `node` with every `nullable: true` turned into an explicit null alternative."""
    if isinstance(node, list):
        return [_null_allowed(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _null_allowed(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is not True:
        return out
    if ("type" in out and "enum" not in out
        and not any(k in out for k in ("anyOf", "oneOf", "$ref"))):
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"] if "null" not in types else types
        return out
    return {"anyOf": [out, {"type": "null"}]}


@functools.cache
def spec() -> dict[str, Any]:
    with gzip.open(SPEC_PATH) as file:
        document: dict[str, Any] = _null_allowed(json.load(file))
    return document


@functools.cache
def _registry() -> Registry[Any]:
    resource: Resource[Any] = Resource(contents=spec(), specification=DRAFT202012)
    return Registry().with_resource(SPEC_URI, resource)


@functools.cache
def validator(schema_name: str) -> Draft202012Validator:
    """A validator for `#/components/schemas/<schema_name>` (KeyError if the spec has no such
    schema)."""
    spec()["components"]["schemas"][schema_name]  # noqa: B018 -- fail early on a misspelt name
    ref = {"$ref": f"{SPEC_URI}#/components/schemas/{schema_name}"}
    return Draft202012Validator(ref, registry=_registry())


def schema_errors(schema_name: str, body: Any) -> list[str]:
    """Every place `body` deviates from the schema, as `path: message` lines ([] when it conforms).
    For an anyOf/oneOf mismatch the closest variant's own errors are listed as well."""
    lines = []
    for error in validator(schema_name).iter_errors(body):
        where = "/".join(str(p) for p in error.absolute_path) or "<root>"
        lines.append(f"{where}: {error.message[:300]}")
        # the variants that failed on more than their `type` tag are the ones meant
        meant = [sub for sub in error.context or ()
                 if not (list(sub.relative_path)[-1:] == ["type"] and sub.validator == "enum")]
        for sub in sorted(meant, key=lambda e: -len(e.absolute_path))[:6]:
            sub_where = "/".join(str(p) for p in sub.absolute_path) or "<root>"
            lines.append(f"    variant {list(sub.relative_schema_path)[:1]} {sub_where}: "
                         f"{sub.message[:200]}")
    return lines
