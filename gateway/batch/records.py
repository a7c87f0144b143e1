"""What the Batch API keeps: a file's metadata, a batch's state, one line's result; and the
OpenAI objects the API answers with.

    validating -> in_progress -> finalizing -> completed
         |             |  \\
         v             v   `-> (24h window passed) -> finalizing -> expired
       failed     cancelling -> finalizing -> cancelled

A batch is the runner's to change (`status`, counts, usage); a cancel only sets `cancelling_at`,
which the store keeps apart so the runner's writes never undo it.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from auth.principal import Principal

COMPLETION_WINDOW_S = {"24h": 24 * 3600}
PURPOSE_BATCH = "batch"
PURPOSE_BATCH_OUTPUT = "batch_output"


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_active(self) -> bool:
        """Still the runner's to work on."""
        return self in _ACTIVE


_ACTIVE = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING,
                     BatchStatus.CANCELLING})


def new_id(prefix: str) -> str:
    """Creation time, then randomness: ids of one second sort in the order they were made
    (the stores page by (created_at, id))."""
    return f"{prefix}{time.time_ns() // 1000:014x}{os.urandom(8).hex()}"


def now_s() -> int:
    return int(time.time())


@dataclass
class FileRecord:
    id: str
    project: str
    purpose: str
    filename: str
    num_bytes: int
    created_at: int

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.num_bytes,
                "created_at": self.created_at, "filename": self.filename, "purpose": self.purpose,
                "status": "processed", "expires_at": None, "status_details": None}


@dataclass
class BatchRecord:
    """One batch. `principal_*`: the caller who created it, whose rights each line runs with."""

    id: str
    project: str
    key_id: str
    scopes: list[str]
    allowed_models: list[str] | None
    via: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = BatchStatus.VALIDATING.value
    metadata: dict[str, str] | None = None
    model: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None  # kept apart by the store: a cancel's only write
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # validation errors of a failed batch
    num_total: int = 0
    num_completed: int = 0
    num_failed: int = 0
    usage: dict[str, int] = field(default_factory=lambda: {
        "input_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "reasoning_tokens": 0})

    @property
    def principal(self) -> Principal:
        return Principal(project=self.project, key_id=self.key_id, scopes=frozenset(self.scopes),
                         allowed_models=(None if self.allowed_models is None
                                         else frozenset(self.allowed_models)),
                         via=self.via)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchRecord:
        return cls(**data)

    @property
    def shown_status(self) -> str:
        """A cancel asked for and not yet acted on reads as `cancelling`."""
        if self.cancelling_at is not None and self.status in (BatchStatus.VALIDATING,
                                                              BatchStatus.IN_PROGRESS):
            return BatchStatus.CANCELLING.value
        return self.status

    def to_openai(self) -> dict[str, Any]:
        usage = self.usage
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model,
            "errors": (None if not self.errors else {"object": "list", "data": self.errors}),
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.shown_status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at,
            "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at,
            "failed_at": self.failed_at, "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.num_total, "completed": self.num_completed,
                               "failed": self.num_failed},
            "metadata": self.metadata,
            "usage": {"input_tokens": usage["input_tokens"],
                      "input_tokens_details": {"cached_tokens": usage["cached_tokens"]},
                      "output_tokens": usage["output_tokens"],
                      "output_tokens_details": {"reasoning_tokens": usage["reasoning_tokens"]},
                      "total_tokens": usage["input_tokens"] + usage["output_tokens"]},
        }


@dataclass(frozen=True)
class LineResult:
    """One line's outcome, recorded once (the store ignores a second record of the same index).
    `output`: the output or error file's line; `usage_record`: the UsageRecord's fields to
    settle with (None for a line that reached no model); `metered`: settled."""

    index: int
    ok: bool
    output: bytes
    usage_record: dict[str, Any] | None
    metered: bool = False
