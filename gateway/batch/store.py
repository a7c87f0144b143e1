"""Where files' metadata, batches and line results live: the `BatchStore` contract.

Two stores keep it: SQLite (`sqlite_store.py`, embedded, one file under `data_dir`) and Redis
(`redis_store.py`, shared by every gateway). File contents live apart, in a directory
(`file_directory.py`). Every read and write is per project: an id of another project reads as
absent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from gateway.batch.records import BatchRecord, FileRecord, LineResult


class BatchStore(ABC):
    # files
    @abstractmethod
    async def add_file(self, record: FileRecord) -> None: ...

    @abstractmethod
    async def get_file(self, project: str, file_id: str) -> FileRecord | None: ...

    @abstractmethod
    async def list_files(self, project: str, purpose: str | None, after: str | None,
                         limit: int, newest_first: bool) -> tuple[list[FileRecord], bool]:
        """Up to `limit` files after the one with id `after` (in the order asked), and whether
        more follow."""

    @abstractmethod
    async def delete_file(self, project: str, file_id: str) -> bool: ...

    @abstractmethod
    async def project_bytes(self, project: str) -> int:
        """The bytes of every file the project holds (its quota's use)."""

    # batches
    @abstractmethod
    async def add_batch(self, record: BatchRecord) -> None: ...

    @abstractmethod
    async def get_batch(self, project: str, batch_id: str) -> BatchRecord | None: ...

    @abstractmethod
    async def get_batch_any(self, batch_id: str) -> BatchRecord | None:
        """The runner's read (it knows the id from `active_batch_ids`)."""

    @abstractmethod
    async def list_batches(self, project: str, after: str | None, limit: int
                           ) -> tuple[list[BatchRecord], bool]:
        """Newest first, as OpenAI lists them."""

    @abstractmethod
    async def save_batch(self, record: BatchRecord) -> None:
        """The runner's write: everything but `cancelling_at`."""

    @abstractmethod
    async def request_cancel(self, project: str, batch_id: str, at: int) -> BatchRecord | None:
        """Set `cancelling_at` (once) on an active batch; the batch as it is then, or None."""

    @abstractmethod
    async def active_batch_ids(self) -> list[str]:
        """Batches the runner still has work on, oldest first."""

    @abstractmethod
    async def num_active_batches(self, project: str) -> int:
        """How many of the project's batches the runner still has work on."""

    @abstractmethod
    async def try_lease(self, batch_id: str, owner: str, lease_s: float) -> bool:
        """Take or renew the batch's lease for `owner`; False while another owner holds it."""

    # lines
    @abstractmethod
    async def record_line(self, batch_id: str, result: LineResult) -> bool:
        """Keep the line's result unless one is kept already; True when this call kept it."""

    @abstractmethod
    async def mark_metered(self, batch_id: str, index: int) -> None: ...

    @abstractmethod
    async def recorded_lines(self, batch_id: str) -> tuple[dict[int, bool], list[LineResult]]:
        """{index: ok} of every recorded line, and the recorded lines not yet metered."""

    @abstractmethod
    def line_outputs(self, batch_id: str
                     ) -> AsyncIterator[tuple[bool, bytes, dict[str, Any] | None]]:
        """(ok, output line, usage record) of every recorded line, in index order."""

    @abstractmethod
    async def drop_lines(self, batch_id: str) -> None:
        """Forget a finished batch's line results (its output files hold them now)."""

    @abstractmethod
    async def close(self) -> None: ...
