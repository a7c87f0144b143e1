"""ReplicaServerSettings: how the replica's HTTP server behaves (not how the engine runs)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SECRET_ENV = "AIGW_REPLICA_SECRET"  # the credential itself (the gateway reads the same variable)
SECRET_FILE_ENV = "AIGW_REPLICA_SECRET_FILE"  # or a file holding it (a mounted k8s Secret)


@dataclass(frozen=True)
class ReplicaServerSettings:
    """`secret` is the credential the gateway presents (`Authorization: Bearer <secret>`) on every
    route but GET /health and GET /metrics (engine/server/middlewares.py). None serves every route
    to anyone (`aigw replica --no-auth`, tests), except POST /kv/reset: loopback clients only.

    `served_model_aliases` are extra names accepted in the `model` field besides the engine's
    `model_id`. `tool_parser` names a format in `engine.tool_parsers` (None: by model family).
    """

    secret: str | None = field(default=None, repr=False)
    client_max_size_bytes: int = 32 * 1024 * 1024
    served_model_aliases: tuple[str, ...] = ()
    tool_parser: str | None = None
    handler_cancellation: bool = True  # a client that hangs up cancels its handler (aborts work)

    def __post_init__(self) -> None:
        if self.client_max_size_bytes <= 0:
            raise ValueError("client_max_size_bytes must be positive")
        if self.secret is not None and not self.secret:
            raise ValueError("secret must be None or non-empty")

    @classmethod
    def from_env(cls, **overrides: object) -> ReplicaServerSettings:
        """Settings with `secret` from the environment (`read_secret`) unless overridden."""
        values: dict[str, object] = {"secret": read_secret(os.environ)}
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
