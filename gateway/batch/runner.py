"""The batch runner: one background task per gateway that works the active batches, oldest
first, in turns (with other batches waiting, one starts lines for `_TURN_S`, then the next gets
its turn: one project's long batch does not hold another's back), on idle capacity.

    validating   read the input file into a plan (gateway/batch/plan.py); malformed lines are
                 recorded as errors at once -> in_progress (or failed: no file, no line)
    in_progress  settle lines recorded but not metered (a crash's leftovers), then run the
                 lines not yet recorded, in plan order; each: run (line_runner.py) -> record
                 (once per line index) -> settle (once per record id) -> mark metered
    finalizing   write the output and error files from the recorded lines -> completed
                 (cancelled after a cancel, expired after the completion window)

Idle capacity: a line starts only while its model's interactive requests in flight on this
gateway (every endpoint's outstanding count less this runner's own lines) are fewer than
`max_interactive_in_flight`, and at most `max_concurrent_lines` run at once. A batch is worked by
the gateway that holds its lease (renewed while it works; a dead gateway's lapses), so gateways
sharing a Redis store do not run it twice; a restarted gateway resumes where the store says.

A line is never run again once recorded; a line running when the gateway died was not
recorded, so it runs again, under the same record id: the meter keeps one record of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from gateway.batch.file_directory import FileDirectory
from gateway.batch.line_runner import LineOutcome, LineRunner, output_line
from gateway.batch.metrics import BatchCounts
from gateway.batch.plan import Plan, PlannedLine, read_line_body, read_plan
from gateway.batch.records import (
    PURPOSE_BATCH_OUTPUT,
    BatchRecord,
    BatchStatus,
    FileRecord,
    LineResult,
    now_s,
)
from gateway.batch.settings import BatchSettings
from gateway.batch.store import BatchStore
from gateway.fleet.endpoints import Fleet
from gateway.metering.contract import Admission, Meter, UsageRecord
from gateway.request.observer import NULL_OBSERVER, RequestObserver
from infra.event_wait import event_set_within

log = logging.getLogger("aigw.batch")

_TURN_S = 10.0  # with other batches waiting, a batch starts lines for this long, then yields
_STOP_CHECK_S = 1.0  # how often a batch waiting for idle capacity looks for a cancel
_NUM_CRASHES = 3  # a line whose run raises this often is recorded as a 500 error line
_IDLE_CHECK_S = 0.05  # how often a line waiting for idle capacity looks again
_EXPIRED = {"code": "batch_expired",
            "message": "This line could not be run before the batch's completion window ended."}


def derived_file_id(batch_id: str, kind: str) -> str:
    """The output/error file's id: the same on every try of a finalize (so a retry overwrites)."""
    return "file-" + hashlib.blake2b(f"{batch_id}/{kind}".encode(), digest_size=12).hexdigest()


class BatchRunner:
    def __init__(self, store: BatchStore, files: FileDirectory, lines: LineRunner, fleet: Fleet,
                 meter: Meter, settings: BatchSettings, counts: BatchCounts | None = None,
                 observer: RequestObserver = NULL_OBSERVER) -> None:
        self._store = store
        self._observer = observer  # each settled line's usage, for telemetry (`on_usage`)
        self._files = files
        self._lines = lines
        self._fleet = fleet
        self._meter = meter
        self._settings = settings
        self.counts = counts or BatchCounts()  # /metrics (gateway/batch/metrics.py)
        self._owner = os.urandom(8).hex()  # this gateway process, as a lease holder
        self._task: asyncio.Task[None] | None = None
        self._num_crashes: dict[tuple[str, int], int] = {}  # (batch, line) -> failed tries
        self._plans: dict[str, Plan] = {}  # active batches' plans, read once
        self._lease_lost = False  # the batch being worked: its lease went to another gateway
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def wake(self) -> None:
        """A batch was created or cancelled: look now rather than at the next poll."""
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            try:
                active = await self._store.active_batch_ids()
                for batch_id in active:  # each gets a turn of _TURN_S while others wait
                    if await self._store.try_lease(batch_id, self._owner, self._settings.lease_s):
                        await self._work(batch_id)
                for batch_id in set(self._plans) - set(active):  # finished elsewhere
                    del self._plans[batch_id]
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a store outage: try again at the next poll
                log.exception("the batch runner failed; retrying")
            self._wake.clear()
            await event_set_within(self._wake, self._settings.poll_interval_s)

    async def _work(self, batch_id: str) -> None:
        """Work the batch while a task keeps its lease (losing it stops the work)."""
        self._lease_lost = False
        keeper = asyncio.create_task(self._keep_lease(batch_id))
        try:
            await self._work_leased(batch_id)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    async def _keep_lease(self, batch_id: str) -> None:
        while True:
            await asyncio.sleep(self._settings.lease_s / 3)
            try:
                held = await self._store.try_lease(batch_id, self._owner, self._settings.lease_s)
            except Exception:  # noqa: BLE001 - a store outage: try again, the lease may hold
                log.warning("renewing the lease of batch %s failed", batch_id, exc_info=True)
                continue
            if not held:
                log.warning("batch %s: another gateway took its lease; stopping here", batch_id)
                self._lease_lost = True
                return

    async def _work_leased(self, batch_id: str) -> None:
        batch = await self._store.get_batch_any(batch_id)
        if batch is None:
            return
        plan: Plan | None = None
        if batch.status == BatchStatus.VALIDATING:
            plan = await self._validate(batch)
            if plan is None:
                return
        if batch.status == BatchStatus.IN_PROGRESS:
            if plan is None:
                plan = await self._plan(batch)
                if plan is None:
                    return
            await self._run(batch, plan)
        if batch.status == BatchStatus.FINALIZING:
            await self._finalize(batch)
            self._plans.pop(batch.id, None)

    async def _plan(self, batch: BatchRecord) -> Plan | None:
        """The batch's plan (kept while the batch is active here: ~0.5 KiB a line)."""
        if batch.id in self._plans:
            return self._plans[batch.id]
        path = self._files.path_of(batch.input_file_id)
        try:
            plan = await asyncio.to_thread(read_plan, str(path), batch.endpoint,
                                           self._settings.order == "prefix")
        except OSError:
            await self._fail(batch, "file_not_found",
                             f"the input file {batch.input_file_id} cannot be read")
            return None
        self._plans[batch.id] = plan
        return plan

    async def _fail(self, batch: BatchRecord, code: str, message: str) -> None:
        batch.status, batch.failed_at = BatchStatus.FAILED.value, now_s()
        batch.errors = [{"code": code, "message": message, "param": None, "line": None}]
        await self._store.save_batch(batch)

    async def _validate(self, batch: BatchRecord) -> Plan | None:
        plan = await self._plan(batch)
        if plan is None:
            return None
        if plan.num_total == 0:
            await self._fail(batch, "empty_file", "the input file has no lines")
            return None
        if plan.num_total > self._settings.max_lines:
            await self._fail(batch, "too_many_lines", f"the input file has {plan.num_total} "
                             f"lines; a batch holds at most {self._settings.max_lines}")
            return None
        for invalid in plan.invalid:  # the error file's lines for malformed input lines
            error = {"code": invalid.code, "message": invalid.message}
            await self._store.record_line(batch.id, LineResult(
                invalid.index, False, output_line(batch.id, invalid.index, invalid.custom_id,
                                                  None, None, error), None, metered=True))
        batch.status, batch.in_progress_at = BatchStatus.IN_PROGRESS.value, now_s()
        batch.num_total, batch.model = plan.num_total, plan.model
        batch.num_failed = len(plan.invalid)
        await self._store.save_batch(batch)
        return plan

    async def _settle_unmetered(self, batch: BatchRecord) -> dict[int, bool]:
        """Settle what a crash left recorded but unmetered; {index: ok} of the recorded lines."""
        recorded, unmetered = await self._store.recorded_lines(batch.id)
        principal = batch.principal
        for line in unmetered:
            assert line.usage_record is not None
            record = UsageRecord(**line.usage_record)
            try:
                await self._meter.settle(Admission(record.request_id, principal, record.model, 0),
                                         record)
            finally:
                self._observer.on_usage(record)
            await self._store.mark_metered(batch.id, line.index)
        return recorded

    async def _run(self, batch: BatchRecord, plan: Plan) -> None:
        """Run the lines not yet recorded; when its turn ends with other batches waiting, start
        no more and return (the batch stays in_progress for its next turn)."""
        recorded = await self._settle_unmetered(batch)
        batch.num_completed = sum(recorded.values())
        batch.num_failed = len(recorded) - batch.num_completed
        await self._store.save_batch(batch)
        pending = [line for line in plan.lines if line.index not in recorded]
        running: set[asyncio.Task[None]] = set()
        checked = time.monotonic()
        turn_ends = checked + _TURN_S
        try:
            for line in pending:
                while not await self._may_start(line, running):
                    if time.monotonic() - checked > _STOP_CHECK_S:  # (waiting for idle capacity)
                        checked = time.monotonic()
                        if self._lease_lost or await self._stopping(batch):
                            break
                if self._lease_lost:
                    return  # another gateway works it now
                if await self._stopping(batch):
                    break
                if time.monotonic() > turn_ends:
                    if len(await self._store.active_batch_ids()) > 1:
                        if running:
                            await asyncio.wait(set(running))
                        return  # the next batch's turn
                    turn_ends = time.monotonic() + _TURN_S
                self.counts.num_running += 1
                task = asyncio.create_task(self._run_line(batch, line))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.wait(set(running))
        finally:
            for task in running:
                task.cancel()
        if batch.cancelling_at is None and batch.expired_at is None:
            recorded, _ = await self._store.recorded_lines(batch.id)
            if any(line.index not in recorded for line in plan.lines):
                return  # some failed to record: the next pass runs them
        if batch.expired_at is not None:
            await self._expire_rest(batch, plan)
        batch.status, batch.finalizing_at = BatchStatus.FINALIZING.value, now_s()
        await self._store.save_batch(batch)

    async def _may_start(self, line: PlannedLine, running: set[asyncio.Task[None]]) -> bool:
        """Wait a tick for a free slot on idle capacity; True when the line may start now."""
        is_slot_free = len(running) < self._settings.max_concurrent_lines
        if is_slot_free:
            route = self._fleet.get(line.model)
            interactive = 0 if route is None else (
                sum(endpoint.num_outstanding for endpoint in route.endpoints)
                - self._lines.num_held(line.model))
            if interactive < self._settings.max_interactive_in_flight:
                return True
        await asyncio.sleep(_IDLE_CHECK_S)
        if is_slot_free:  # (a slot was free: the wait was for interactive traffic)
            self.counts.idle_wait_s += _IDLE_CHECK_S
        return False

    async def _stopping(self, batch: BatchRecord) -> bool:
        """True once the batch was cancelled or its window ended (then `expired_at` is set)."""
        stored = await self._store.get_batch_any(batch.id)
        if stored is not None and stored.cancelling_at is not None:
            batch.cancelling_at = stored.cancelling_at
            return True
        if now_s() >= batch.expires_at:
            batch.expired_at = now_s()
            return True
        return False

    async def _run_line(self, batch: BatchRecord, line: PlannedLine) -> None:
        """Run, record, settle one line; a failure to record leaves it for the next pass."""
        try:
            await self._run_and_keep(batch, line)
        finally:
            self.counts.num_running -= 1

    async def _run_and_keep(self, batch: BatchRecord, line: PlannedLine) -> None:
        try:
            body = await asyncio.to_thread(read_line_body,
                                           str(self._files.path_of(batch.input_file_id)), line)
        except OSError:  # the input file was deleted under the batch
            error = {"code": "file_not_found", "message": "the input file is gone"}
            outcome = LineOutcome(False, output_line(batch.id, line.index, line.custom_id, None,
                                                     None, error), None)
        else:
            try:
                outcome = await self._lines.run_line(batch.id, line.index, line.custom_id,
                                                     batch.endpoint, body, batch.principal)
            except Exception:  # noqa: BLE001 - e.g. a meter outage at admission: try again
                key = (batch.id, line.index)
                self._num_crashes[key] = self._num_crashes.get(key, 0) + 1
                log.exception("batch line %s/%d failed (%d of %d)", batch.id, line.index,
                              self._num_crashes[key], _NUM_CRASHES)
                if self._num_crashes[key] < _NUM_CRASHES:
                    return  # not recorded: the next pass runs it again
                del self._num_crashes[key]
                outcome = LineOutcome(False, output_line(
                    batch.id, line.index, line.custom_id, 500,
                    {"error": {"message": "the gateway failed on this line", "type": "server_error",
                               "param": None, "code": "internal_error"}}), None)
        try:
            await asyncio.shield(self._keep(batch, line.index, outcome))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a store outage: the line runs again on the next pass
            log.exception("recording batch line %s/%d failed", batch.id, line.index)

    async def _keep(self, batch: BatchRecord, index: int, outcome: LineOutcome) -> None:
        """Record the line, then settle it: never the other way round (see the module doc)."""
        record = outcome.record
        await self._store.record_line(batch.id, LineResult(
            index, outcome.ok, outcome.output,
            None if record is None else dict(record.__dict__), metered=record is None))
        if outcome.ok:
            batch.num_completed += 1
            self.counts.num_completed += 1
        else:
            batch.num_failed += 1
            self.counts.num_failed += 1
        if record is not None:
            _add_usage(batch.usage, record.__dict__)
            admission = outcome.admission or Admission(record.request_id, batch.principal,
                                                       record.model, 0)
            try:
                await self._meter.settle(admission, record)
            except Exception:  # noqa: BLE001 - recorded unmetered: settled at the finalize
                log.exception("settling batch line %s failed", record.request_id)
                return
            finally:
                self._observer.on_usage(record)
            await self._store.mark_metered(batch.id, index)
        await self._store.save_batch(batch)

    async def _expire_rest(self, batch: BatchRecord, plan: Plan) -> None:
        recorded, _ = await self._store.recorded_lines(batch.id)
        for line in plan.lines:
            if line.index not in recorded:
                await self._store.record_line(batch.id, LineResult(
                    line.index, False, output_line(batch.id, line.index, line.custom_id, None,
                                                   None, _EXPIRED), None, metered=True))

    async def _finalize(self, batch: BatchRecord) -> None:
        await self._settle_unmetered(batch)
        self._num_crashes = {k: n for k, n in self._num_crashes.items() if k[0] != batch.id}
        usage = {key: 0 for key in batch.usage}
        counts = {True: 0, False: 0}
        async for ok, _, record in self._store.line_outputs(batch.id):
            counts[ok] += 1
            if record is not None:
                _add_usage(usage, record)
        batch.usage, batch.num_completed, batch.num_failed = usage, counts[True], counts[False]
        if batch.cancelling_at is None:
            stored = await self._store.get_batch_any(batch.id)
            batch.cancelling_at = None if stored is None else stored.cancelling_at
        for ok, kind in ((True, "output"), (False, "error")):
            if not counts[ok]:
                continue
            file_id = derived_file_id(batch.id, kind)
            num_bytes = await self._files.write_lines(file_id, self._outputs(batch.id, ok))
            await self._store.add_file(FileRecord(file_id, batch.project, PURPOSE_BATCH_OUTPUT,
                                                  f"{batch.id}_{kind}.jsonl", num_bytes, now_s()))
            if ok:
                batch.output_file_id = file_id
            else:
                batch.error_file_id = file_id
        if batch.expired_at is not None:
            batch.status = BatchStatus.EXPIRED.value
        elif batch.cancelling_at is not None:
            batch.status, batch.cancelled_at = BatchStatus.CANCELLED.value, now_s()
        else:
            batch.status, batch.completed_at = BatchStatus.COMPLETED.value, now_s()
        await self._store.save_batch(batch)
        await self._store.drop_lines(batch.id)
        log.info("batch %s %s: %d completed, %d failed", batch.id, batch.status,
                 batch.num_completed, batch.num_failed)

    async def _outputs(self, batch_id: str, ok: bool) -> AsyncIterator[bytes]:
        async for line_ok, output, _ in self._store.line_outputs(batch_id):
            if line_ok is ok:
                yield output


def _add_usage(usage: dict[str, int], record: dict[str, Any]) -> None:
    usage["input_tokens"] += int(record["prompt_tokens"])
    usage["cached_tokens"] += int(record["cached_tokens"])
    usage["output_tokens"] += int(record["completion_tokens"])
    usage["reasoning_tokens"] += int(record.get("reasoning_tokens", 0))
