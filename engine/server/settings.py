"""ReplicaServerSettings: how the replica's HTTP server behaves (not how the engine runs)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SECRET_ENV = "AIGW_REPLICA_SECRET"  # the credential itself (the gateway reads the same variable)
SECRET_FILE_ENV = "AIGW_REPLICA_SECRET_FILE"  # or a file holding it (a mounted k8s Secret)
TIMEOUT_ENV = {"client_header_timeout_s": "AIGW_CLIENT_HEADER_TIMEOUT_S",
               "client_body_timeout_s": "AIGW_CLIENT_BODY_TIMEOUT_S",
               "keepalive_timeout_s": "AIGW_KEEPALIVE_TIMEOUT_S"}


@dataclass(frozen=True)
class ReplicaServerSettings:
    """`secret` is the credential the gateway presents (`Authorization: Bearer <secret>`) on every
    route but GET /health and GET /metrics (engine/server/middlewares.py). None serves every route
    to anyone (`aigw replica --no-auth`, tests), except POST /kv/reset: loopback clients only.

    Slow clients, with the gateway's setting names and meanings: a request's headers must all
    arrive within `client_header_timeout_s` of its first byte (else 408 and the connection closes),
    its body within `client_body_timeout_s` (else 408 in the envelope, connection closed); an idle
    keep-alive connection closes after `keepalive_timeout_s`.

    `served_model_aliases` are extra names accepted in the `model` field besides the engine's
    `model_id`. `tool_parser` names a format in `engine.tool_parsers` (None: by model family).
    """

    secret: str | None = field(default=None, repr=False)
    client_max_size_bytes: int = 32 * 1024 * 1024
    served_model_aliases: tuple[str, ...] = ()
    tool_parser: str | None = None
    handler_cancellation: bool = True  # a client that hangs up cancels its handler (aborts work)
    client_header_timeout_s: float = 10.0
    client_body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0

    def __post_init__(self) -> None:
        if self.client_max_size_bytes <= 0:
            raise ValueError("client_max_size_bytes must be positive")
        for name in ("client_header_timeout_s", "client_body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")
        if self.secret is not None and not self.secret:
            raise ValueError("secret must be None or non-empty")

    @classmethod
    def from_env(cls, **overrides: object) -> ReplicaServerSettings:
        """Settings with `secret` from the environment (`read_secret`) and the timeouts from
        AIGW_CLIENT_HEADER_TIMEOUT_S, AIGW_CLIENT_BODY_TIMEOUT_S, AIGW_KEEPALIVE_TIMEOUT_S (the
        gateway's variables; ValueError for one that is not a number) unless overridden."""
        values: dict[str, object] = {"secret": read_secret(os.environ)}
        for name, variable in TIMEOUT_ENV.items():
            if raw := os.environ.get(variable):
                try:
                    values[name] = float(raw)
                except ValueError:
                    raise ValueError(f"{variable}={raw!r} is not a number of seconds") from None
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def read_secret(environ: Mapping[str, str]) -> str | None:
    """AIGW_REPLICA_SECRET, else the content of the file AIGW_REPLICA_SECRET_FILE names (one
    trailing newline dropped), else None; empty counts as unset. OSError for an unreadable file,
    ValueError for an empty one (a mounted Secret that lost its key must not mean "no auth")."""
    if value := environ.get(SECRET_ENV):
        return value
    path = environ.get(SECRET_FILE_ENV)
    if not path:
        return None
    value = Path(path).read_text(encoding="utf-8").removesuffix("\n").removesuffix("\r")
    if not value:
        raise ValueError(f"{SECRET_FILE_ENV}={path}: the file is empty")
    return value
