"""The bytes of uploads in flight on this gateway, per project, counted against the project's
`max_project_bytes` while they stream (gateway/batch/handlers.py).

    with uploads.reserving(project) as reservation:
        reservation.add(len(chunk))          # per chunk written
        used = stored_bytes + uploads.in_flight(project)   # this upload's bytes included

Without it, only a finished upload was checked against the bound, each alone: any number of
concurrent uploads of one project streamed to disk (up to `max_file_bytes` each) before any was
checked, and two that finished together could both pass a bound either passes alone. A
reservation is released only after its file is in the store (or refused), so a finished upload is
never missing from both counts. Per process: gateways sharing a store each count their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class Reservation:
    """One upload's bytes so far (`add` as chunks arrive)."""

    def __init__(self, owner: UploadQuota, project: str) -> None:
        self._owner, self._project = owner, project
        self.num_bytes = 0

    def add(self, num_bytes: int) -> None:
        self.num_bytes += num_bytes
        self._owner._add(self._project, num_bytes)


class UploadQuota:
    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}  # project -> bytes of its uploads in flight

    def in_flight(self, project: str) -> int:
        """The bytes of `project`'s uploads in flight on this gateway."""
        return self._in_flight.get(project, 0)

    @contextmanager
    def reserving(self, project: str) -> Iterator[Reservation]:
        """A reservation for one upload, released (its bytes no longer counted) on exit."""
        reservation = Reservation(self, project)
        try:
            yield reservation
        finally:
            self._add(project, -reservation.num_bytes)

    def _add(self, project: str, num_bytes: int) -> None:
        total = self._in_flight.get(project, 0) + num_bytes
        if total:
            self._in_flight[project] = total
        else:
            self._in_flight.pop(project, None)
