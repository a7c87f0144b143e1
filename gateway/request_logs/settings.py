"""Request log settings (`[request_logs]` in the gateway config).

    [request_logs]
    retention_s = 604800                        # entries older than this are deleted (7 days)
    redact_fields = ["request.metadata.email", "request.messages.*.content"]
    [request_logs.projects.acme]                # opted in from the config; the admin API can
    sample_rate = 0.1                           # opt a project in or out at run time too
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ProjectLogSettings(BaseModel):
    """One project's logging: on or off, and the share of its requests logged."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    enabled: bool = True
    sample_rate: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0


class RequestLogSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    projects: dict[str, ProjectLogSettings] = {}  # opted in (no project is logged by default)
    store: Literal["auto", "sqlite", "redis"] = "auto"  # auto: Redis when redis_url is set
    retention_s: Annotated[float, Field(gt=0)] = 7 * 86400.0
    # one entry's JSON; bodies cut to fit
    max_entry_bytes: Annotated[int, Field(ge=4096)] = 64 * 1024
    max_project_bytes: Annotated[int, Field(gt=0)] = 256 * 1024 * 1024  # a project's entries in all
    # waiting to be written; past it, dropped
    queue_max_bytes: Annotated[int, Field(gt=0)] = 16 * 1024 * 1024
    redact_fields: tuple[str, ...] = ()  # dotted JSON paths from the entry's root; `*`: any key
    settings_refresh_s: Annotated[float, Field(gt=0)] = 1.0  # how soon an admin API change is seen

    @field_validator("redact_fields")
    @classmethod
    def _check_paths(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        for path in paths:
            if not path or any(not step for step in path.split(".")):
                raise ValueError(f"redact_fields: {path!r} is not a dotted path (a.b.*.c)")
        return paths
