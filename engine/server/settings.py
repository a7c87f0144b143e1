"""ReplicaServerSettings: how the replica's HTTP server behaves (not how the engine runs)."""

from __future__ import annotations

import os
from dataclasses import dataclass

ADMIN_TOKEN_ENV = "AIGW_REPLICA_ADMIN_TOKEN"


@dataclass(frozen=True)
class ReplicaServerSettings:
    """`admin_token` guards POST /kv/reset; without one, only loopback clients may call it.

    `served_model_aliases` are extra names accepted in the `model` field besides the engine's
    `model_id`. `tool_parser` names a format in `engine.tool_parsers` (None: by model family).
    """

    admin_token: str | None = None
    client_max_size_bytes: int = 32 * 1024 * 1024
    served_model_aliases: tuple[str, ...] = ()
    tool_parser: str | None = None
    handler_cancellation: bool = True  # a client that hangs up cancels its handler (aborts work)

    def __post_init__(self) -> None:
        if self.client_max_size_bytes <= 0:
            raise ValueError("client_max_size_bytes must be positive")
        if self.admin_token is not None and not self.admin_token:
            raise ValueError("admin_token must be None or non-empty")

    @classmethod
    def from_env(cls, **overrides: object) -> ReplicaServerSettings:
        """Settings with `admin_token` read from AIGW_REPLICA_ADMIN_TOKEN unless overridden."""
        values: dict[str, object] = {"admin_token": os.environ.get(ADMIN_TOKEN_ENV) or None}
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
