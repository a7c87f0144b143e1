"""The Batch API's settings (`[batch]` in the gateway's config, `AIGW_BATCH__*` in the
environment)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class BatchSettings(BaseModel):
    """Bounds, price and pacing of `/v1/files` and `/v1/batches`.

    A line starts only while the model's interactive requests in flight on this gateway are fewer
    than `max_interactive_in_flight` (default 1: only when none is), at most
    `max_concurrent_lines` at a time; it is metered at (1 - `price_discount`) of the model's
    prices."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # a misspelt key is an error
    enabled: bool = True
    max_file_bytes: int = Field(default=100 * 1024 * 1024, gt=0)  # one upload (413 above it)
    max_lines: int = Field(default=50_000, gt=0)  # lines of one batch input file (400 above it)
    max_project_bytes: int = Field(default=10 * 1024 * 1024 * 1024, gt=0)  # all files of a project
    # a project's batches not yet finished (a create past it: 429 too_many_active_batches)
    max_active_batches: int = Field(default=100, gt=0)
    # batch lines cost (1 - this) x the price
    price_discount: float = Field(default=0.5, ge=0.0, le=1.0)
    max_concurrent_lines: int = Field(default=4, gt=0)
    max_interactive_in_flight: int = Field(default=1, gt=0)
    # how often the runner looks for work and for load
    poll_interval_s: float = Field(default=1.0, gt=0)
    lease_s: float = Field(default=30.0, gt=0)  # a batch is run by the gateway holding its lease
    files_dir: Path | None = None  # file contents; default <data_dir>/batch-files
    # "prefix": lines sharing a prompt prefix run together (the prompt cache serves the shared
    # part once); "file": in the input file's order
    order: Literal["prefix", "file"] = "prefix"
