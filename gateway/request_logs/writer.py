"""`RequestLog`: which requests are logged (per project, sampled), and the bounded queue that
writes them off the request path.

    if request_log.sample(project):                      # at admission: one dict lookup, a random()
        ... request_log.submit(capture)                  # once settled: never blocks, never raises

`submit` appends to a queue bounded in bytes (`queue_max_bytes`, by each capture's weight); when
it is full the capture is dropped and counted (`aigw_request_logs_dropped_total{reason=
"queue_full"}`), the request is not slowed or failed. One background task takes what is queued,
builds the entries (redaction, rendering, the byte cap) in a worker thread and appends them to the
store in one batch; a batch the store refuses is dropped and counted (`reason="store_error"`).
It also re-reads the projects' settings set through the admin API every `settings_refresh_s`,
and trims past the retention every minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from typing import Any

from gateway.request_logs.entry import Capture, LogEntry, build_entry
from gateway.request_logs.settings import ProjectLogSettings, RequestLogSettings
from gateway.request_logs.store import RequestLogStore
from infra.event_wait import event_set_within

log = logging.getLogger("aigw.request_logs")
TRIM_INTERVAL_S = 60.0


class RequestLog:
    def __init__(self, settings: RequestLogSettings, store: RequestLogStore) -> None:
        self.settings = settings
        self.store = store
        self._by_project: dict[str, ProjectLogSettings] = dict(settings.projects)
        self._queue: deque[Capture] = deque()
        self.queued_bytes = 0
        self.num_written = 0
        self.num_dropped: dict[str, int] = {"queue_full": 0, "store_error": 0,
                                                "build_error": 0}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._random = random.random

    # -- the request path ------------------------------------------------------------------
    def sample(self, project: str | None) -> bool:
        """Log this request of `project`? (Its settings from the admin API, else the config.)"""
        if project is None:
            return False
        chosen = self._by_project.get(project)
        return chosen is not None and chosen.enabled and (
            chosen.sample_rate >= 1.0 or self._random() < chosen.sample_rate)

    def submit(self, capture: Capture) -> None:
        if self.queued_bytes + capture.weight_bytes > self.settings.queue_max_bytes:
            self.num_dropped["queue_full"] += 1
            return
        self._queue.append(capture)
        self.queued_bytes += capture.weight_bytes
        self._wake.set()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh_settings()
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Write what is queued, then stop (the store is closed by its owner)."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def flush(self) -> None:
        """Write everything queued now (tests, shutdown)."""
        await self._write_queued()

    async def refresh_settings(self) -> None:
        try:
            stored = await self.store.project_settings()
        except Exception:  # noqa: BLE001 - keep the last known settings
            log.warning("cannot read the request log settings", exc_info=True)
            return
        merged = dict(self.settings.projects)
        for project, values in stored.items():
            try:
                merged[project] = ProjectLogSettings(**values)
            except ValueError:
                log.warning("bad request log settings for project %r: %r", project, values)
        self._by_project = merged

    def project_view(self, project: str) -> dict[str, Any]:
        chosen = self._by_project.get(project)
        return {"project": project, "enabled": chosen is not None and chosen.enabled,
                "sample_rate": chosen.sample_rate if chosen is not None else 0.0}

    async def _run(self) -> None:
        refresh_s = self.settings.settings_refresh_s
        next_refresh = time.monotonic() + refresh_s
        next_trim = time.monotonic()
        while True:
            await event_set_within(self._wake, max(0.0, next_refresh - time.monotonic()))
            self._wake.clear()
            await self._write_queued()
            if self._closing:
                return
            now = time.monotonic()
            if now >= next_refresh:
                await self.refresh_settings()
                next_refresh = now + refresh_s
            if now >= next_trim:
                try:
                    await self.store.trim(time.time())
                except Exception:  # noqa: BLE001
                    log.warning("request log trim failed", exc_info=True)
                next_trim = now + TRIM_INTERVAL_S

    async def _write_queued(self) -> None:
        while self._queue:
            batch = list(self._queue)
            self._queue.clear()
            weight = sum(capture.weight_bytes for capture in batch)
            try:
                entries = await asyncio.to_thread(self._build, batch)
                await self.store.append(entries, time.time())
                self.num_written += len(entries)
            except Exception:  # noqa: BLE001 - a store outage drops logs, never requests
                self.num_dropped["store_error"] += len(batch)
                log.warning("request log write failed; %d entries dropped", len(batch),
                            exc_info=True)
            finally:
                self.queued_bytes -= weight

    def _build(self, batch: list[Capture]) -> list[LogEntry]:
        settings = self.settings
        entries = []
        for capture in batch:
            try:
                entries.append(build_entry(capture, settings.max_entry_bytes,
                                           settings.redact_fields))
            except Exception:  # noqa: BLE001 - one bad entry does not drop its batch
                self.num_dropped["build_error"] += 1
                log.exception("cannot build the request log entry of %s",
                              capture.record.request_id)
        return entries
