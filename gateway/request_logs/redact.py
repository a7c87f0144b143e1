"""Redaction of a request log entry before it is stored: secrets wherever they appear, and the
fields the operator names.

- Header values of `authorization`, `proxy-authorization`, `x-api-key`, `api-key` and `cookie`.
- The value of any JSON key named like a credential (`api_key`, `authorization`, `password`,
  `secret`, `client_secret`, `access_token`, `refresh_token`, `id_token`, `private_key`), at any
  depth.
- Inside every string: bearer tokens, `sk-...` keys (OpenAI, Anthropic, this gateway's
  `sk-aigw-...`), JWTs and AWS access key ids.
- `redact_fields`: dotted paths from the entry's root (`request.metadata.email`,
  `response.choices.*.message.content`); `*` matches any key or list index.

What is redacted becomes "[REDACTED]".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

REDACTED = "[REDACTED]"
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key",
                            "cookie", "set-cookie"})
SECRET_KEYS = frozenset({"api_key", "apikey", "api-key", "x-api-key", "authorization",
                         "password", "secret", "client_secret", "access_token", "refresh_token",
                         "id_token", "private_key"})
_SECRET_TEXT = re.compile(
    r"(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}"
    r"|\bsk-[A-Za-z0-9_-]{16,}"
    r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"
    r"|\bAKIA[0-9A-Z]{16}\b")


def redact_text(text: str) -> str:
    return _SECRET_TEXT.sub(REDACTED, text) if ("sk-" in text or "eyJ" in text or "AKIA" in text
                                                or "earer" in text) else text


def redact_value(value: Any, mask: Callable[[str], str] | None = None) -> Any:
    """`value` with credential keys and secret-looking strings redacted (a new object); `mask`,
    if given, is applied to every string first (a masking guardrail's rule)."""
    if isinstance(value, str):
        return redact_text(value if mask is None else mask(value))
    if isinstance(value, dict):
        return {key: REDACTED if isinstance(key, str) and key.lower() in SECRET_KEYS
                else redact_value(item, mask) for key, item in value.items()}
    if isinstance(value, list):
        return [redact_value(item, mask) for item in value]
    return value


def redact_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): REDACTED if name.lower() in SECRET_HEADERS else redact_text(value)
            for name, value in headers}


def redact_paths(entry: dict[str, Any], paths: tuple[str, ...]) -> None:
    """Replace each value at one of `paths` in place."""
    for path in paths:
        _redact_path(entry, path.split("."))


def _redact_path(node: Any, steps: list[str]) -> None:
    step, rest = steps[0], steps[1:]
    if isinstance(node, dict):
        keys = list(node) if step == "*" else [step] if step in node else []
    elif isinstance(node, list):
        if step == "*":
            keys = list(range(len(node)))
        elif step.isdigit() and int(step) < len(node):
            keys = [int(step)]
        else:
            keys = []
    else:
        return
    for key in keys:
        if rest:
            _redact_path(node[key], rest)
        else:
            node[key] = REDACTED
