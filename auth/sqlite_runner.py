"""One SQLite connection driven from one worker thread, so the event loop never blocks on disk.

Every call runs in the same thread (a single-worker executor), so the connection needs no lock and
statements from one process are serialized; other processes (the CLI) share the file through WAL.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class SqliteRunner:
    def __init__(self, path: Path) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aigw-sqlite")
        self._path = path
        self._conn: sqlite3.Connection | None = None

    def _connect(self) -> None:
        # (data_dir: key hashes, the pepper, usage and prompts; readable by this user only)
        self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        conn = sqlite3.connect(self._path, timeout=10.0, check_same_thread=False,
                               isolation_level=None)  # autocommit; explicit BEGIN where needed
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=10000")
        self._conn = conn

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run fn(connection) on the worker thread and return its result."""
        def call() -> T:
            if self._conn is None:
                self._connect()
            assert self._conn is not None
            return fn(self._conn)

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def close(self) -> None:
        def close_conn() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._executor, close_conn)
        self._executor.shutdown(wait=True)
