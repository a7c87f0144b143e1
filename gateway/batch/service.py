"""The Batch API's parts, opened and closed with the app (`batch_ctx`, a cleanup_ctx entry).

The store is Redis when the gateway has a `redis_url` (shared by every gateway; the file
directory must then be shared too), else SQLite under `data_dir`. File contents live in
`batch.files_dir` (default `<data_dir>/batch-files`).

Embedded, nothing is written until the API is first used: at start the store is opened (and the
runner resumes) only if its file exists; else the first `/v1/files` or `/v1/batches` call
opens it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from gateway.batch.file_directory import FileDirectory
from gateway.batch.line_runner import LineRunner, batch_dialects
from gateway.batch.metrics import BatchCounts
from gateway.batch.runner import BatchRunner
from gateway.batch.settings import BatchSettings
from gateway.batch.store import BatchStore
from gateway.batch.upload_quota import UploadQuota
from gateway.fleet.endpoints import Fleet
from gateway.request.pipeline import Pipeline
from gateway.settings import GatewaySettings


class BatchService:
    """`store`, `files` and `runner` exist between `open` and `close`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.gateway_settings = settings
        self.settings: BatchSettings = settings.batch
        self.endpoints = tuple(batch_dialects())
        self._store: BatchStore | None = None
        self._files: FileDirectory | None = None
        self._runner: BatchRunner | None = None
        self._parts: tuple[Pipeline, Fleet] | None = None  # set while the app runs
        self._opening = asyncio.Lock()
        self.counts = BatchCounts()  # the runner's, for /metrics (also before it opens)
        self.uploads = UploadQuota()  # uploads in flight, against max_project_bytes

    @property
    def store(self) -> BatchStore:
        assert self._store is not None, "the batch service is not open"
        return self._store

    @property
    def files(self) -> FileDirectory:
        assert self._files is not None, "the batch service is not open"
        return self._files

    @property
    def runner(self) -> BatchRunner:
        assert self._runner is not None, "the batch service is not open"
        return self._runner

    @property
    def is_open(self) -> bool:
        return self._runner is not None

    @property
    def _sqlite_path(self) -> Path:
        return Path(self.gateway_settings.data_dir) / "batch.sqlite3"

    async def start(self, pipeline: Pipeline, fleet: Fleet) -> None:
        """With the app: open now if there is a store to resume from, else on first use."""
        self._parts = (pipeline, fleet)
        if self.gateway_settings.redis_url or self._sqlite_path.exists():
            await self.ensure_open()

    async def ensure_open(self) -> bool:
        """Open the store and start the runner, once; False when the API is off (or the app is
        not running)."""
        if self._runner is not None:
            return True
        if self._parts is None:
            return False
        async with self._opening:
            if self._runner is None:
                await self._open(*self._parts)
        return True

    async def _open(self, pipeline: Pipeline, fleet: Fleet) -> None:
        settings = self.gateway_settings
        data_dir = Path(settings.data_dir)
        if settings.redis_url:
            from gateway.batch.redis_store import RedisBatchStore
            from infra.redis_client import connect_redis

            self._store = RedisBatchStore(connect_redis(settings.redis_url))
        else:
            from gateway.batch.sqlite_store import SqliteBatchStore

            self._store = await SqliteBatchStore.open(self._sqlite_path)
        self._files = FileDirectory(self.settings.files_dir or data_dir / "batch-files")
        self._runner = BatchRunner(self._store, self._files,
                                   LineRunner(pipeline, self.settings.price_discount), fleet,
                                   pipeline.meter, self.settings, self.counts,
                                   pipeline.background_observer)
        self._runner.start()

    async def close(self) -> None:
        self._parts = None
        if self._runner is not None:
            await self._runner.close()
        if self._store is not None:
            await self._store.close()
        self._runner = self._store = None


async def run_batch_service(service: BatchService, pipeline: Pipeline, fleet: Fleet
                            ) -> AsyncIterator[None]:
    """The cleanup_ctx body: open (unless disabled), serve, close."""
    if not service.settings.enabled:
        yield
        return
    await service.start(pipeline, fleet)
    try:
        yield
    finally:
        await service.close()
