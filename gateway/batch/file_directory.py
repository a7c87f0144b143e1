"""File contents on disk: `<files_dir>/<file id>`, written whole before they are named.

An upload streams into `<id>.part` (never more than the cap: the writer stops at it), is
fsynced, then renamed into place; a file is listed in the store only after that, so a crash
leaves at most a `.part` file, which the next start removes. With Redis, every gateway must see
the same directory (a shared volume).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import BinaryIO

_WRITE_CHUNK_BYTES = 1024 * 1024  # chunks are gathered to this before each write


class TooLarge(Exception):
    """The content went over the cap (nothing is kept)."""


class FileDirectory:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob("*.part"):
            leftover.unlink(missing_ok=True)

    def path_of(self, file_id: str) -> Path:
        if not file_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id

    async def write_stream(self, file_id: str, chunks: AsyncIterator[bytes], max_bytes: int
                           ) -> tuple[int, int]:
        """Write the chunks as the file's content; (bytes, newlines). TooLarge past `max_bytes`."""
        part = self.path_of(file_id).with_suffix(".part")
        handle: BinaryIO = await asyncio.to_thread(open, part, "wb")
        num_bytes = num_newlines = 0
        pending: list[bytes] = []
        pending_bytes = 0
        try:
            async for chunk in chunks:
                num_bytes += len(chunk)
                if num_bytes > max_bytes:
                    raise TooLarge(f"the file is over {max_bytes} bytes")
                num_newlines += chunk.count(b"\n")
                pending.append(chunk)
                pending_bytes += len(chunk)
                if pending_bytes >= _WRITE_CHUNK_BYTES:
                    await asyncio.to_thread(handle.write, b"".join(pending))
                    pending, pending_bytes = [], 0
            await asyncio.to_thread(_finish, handle, b"".join(pending))
        except BaseException:
            await asyncio.to_thread(handle.close)
            part.unlink(missing_ok=True)
            raise
        await asyncio.to_thread(os.replace, part, self.path_of(file_id))
        return num_bytes, num_newlines

    async def write_lines(self, file_id: str, lines: AsyncIterator[bytes]) -> int:
        """Write the lines (each ending in a newline) as the file's content; its bytes."""
        async def chunks() -> AsyncIterator[bytes]:
            async for line in lines:
                yield line

        num_bytes, _ = await self.write_stream(file_id, chunks(), 2**62)
        return num_bytes

    def read_lines(self, file_id: str) -> Iterable[bytes]:
        """The content's lines (blocking: call from a worker thread)."""
        with open(self.path_of(file_id), "rb") as handle:
            yield from handle

    async def delete(self, file_id: str) -> None:
        await asyncio.to_thread(self.path_of(file_id).unlink, True)


def _finish(handle: BinaryIO, tail: bytes) -> None:
    handle.write(tail)
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()
