"""The BatchStore contract on each store (SQLite, Redis, Redis Cluster), the runner's crash
window (a line recorded but not metered is settled once), and the plan's order."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from auth.principal import ANONYMOUS
from gateway.batch.plan import read_plan
from gateway.batch.records import BatchRecord, BatchStatus, FileRecord, LineResult
from gateway.batch.store import BatchStore
from gateway.metering.contract import Admission, UsageRecord


@pytest.fixture(params=["sqlite", "redis", "redis-cluster"])
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    async def open_store() -> BatchStore:
        if request.param == "sqlite":
            from gateway.batch.sqlite_store import SqliteBatchStore

            return await SqliteBatchStore.open(tmp_path / "batch.sqlite3")
        from gateway.batch.redis_store import RedisBatchStore
        from infra.redis_client import connect_redis

        fixture = ("own_redis_database_url" if request.param == "redis"
                   else "clean_redis_cluster_url")
        return RedisBatchStore(connect_redis(request.getfixturevalue(fixture)))

    yield open_store


def batch(batch_id: str, project: str, created_at: int) -> BatchRecord:
    return BatchRecord(id=batch_id, project=project, key_id="k", scopes=["ai_gateway:invoke"],
                       allowed_models=None, via="api_key", endpoint="/v1/chat/completions",
                       input_file_id="file-in", completion_window="24h", created_at=created_at,
                       expires_at=created_at + 86400)


def test_the_store_contract(store_factory: Any) -> None:
    async def check() -> None:
        store: BatchStore = await store_factory()
        try:
            for i in range(3):
                await store.add_file(FileRecord(f"file-{i}", "p", "batch", f"{i}.jsonl", 10 + i,
                                                100 + i))
            await store.add_file(FileRecord("file-x", "q", "batch", "x.jsonl", 99, 100))
            page, more = await store.list_files("p", None, None, 2, True)
            assert [f.id for f in page] == ["file-2", "file-1"] and more
            page, more = await store.list_files("p", "batch", "file-1", 2, True)
            assert [f.id for f in page] == ["file-0"] and not more
            assert [f.id for f in (await store.list_files("p", None, None, 5, False))[0]] == [
                "file-0", "file-1", "file-2"]
            assert (await store.list_files("p", "batch_output", None, 5, True))[0] == []
            assert await store.get_file("q", "file-0") is None  # another project's
            assert await store.project_bytes("p") == 33
            assert not await store.delete_file("q", "file-0")
            assert await store.delete_file("p", "file-0") and await store.project_bytes("p") == 23

            for i, created_at in enumerate((5, 6, 6)):
                await store.add_batch(batch(f"batch_{i}", "p", created_at))
            await store.add_batch(batch("batch_q", "q", 7))
            page_ids = [b.id for b in (await store.list_batches("p", None, 2))[0]]
            assert page_ids == ["batch_2", "batch_1"]
            assert [b.id for b in (await store.list_batches("p", "batch_1", 5))[0]] == ["batch_0"]
            assert await store.get_batch("q", "batch_0") is None
            assert await store.request_cancel("q", "batch_0", 9) is None
            cancelled = await store.request_cancel("p", "batch_0", 9)
            assert cancelled is not None and cancelled.shown_status == "cancelling"
            record = await store.get_batch_any("batch_0")
            assert record is not None
            record.num_completed = 4
            record.cancelling_at = None  # the runner's stale copy: its save keeps the cancel
            await store.save_batch(record)
            reread = await store.get_batch("p", "batch_0")
            assert reread is not None and reread.cancelling_at == 9 and reread.num_completed == 4
            reread.status = BatchStatus.CANCELLED.value
            await store.save_batch(reread)
            assert await store.active_batch_ids() == ["batch_1", "batch_2", "batch_q"]
            assert [await store.num_active_batches(p) for p in ("p", "q", "r")] == [2, 1, 0]

            assert await store.try_lease("batch_1", "a", 30)
            assert not await store.try_lease("batch_1", "b", 30)
            assert await store.try_lease("batch_1", "a", 30)  # renewed
            assert await store.try_lease("batch_2", "b", 0.05)
            await asyncio.sleep(0.1)
            assert await store.try_lease("batch_2", "a", 30)  # lapsed

            usage = {"request_id": "batch_1/1", "prompt_tokens": 3}
            assert await store.record_line("batch_1", LineResult(1, True, b"one\n", usage))
            assert not await store.record_line("batch_1", LineResult(1, False, b"again\n", None))
            assert await store.record_line("batch_1", LineResult(0, False, b"zero\n", None,
                                                                 metered=True))
            recorded, unmetered = await store.recorded_lines("batch_1")
            assert recorded == {0: False, 1: True}
            assert [(u.index, u.usage_record) for u in unmetered] == [(1, usage)]
            await store.mark_metered("batch_1", 1)
            assert (await store.recorded_lines("batch_1"))[1] == []
            record = await store.get_batch_any("batch_1")
            assert record is not None
            record.num_total = 2
            await store.save_batch(record)
            outputs = [(ok, out) async for ok, out, _ in store.line_outputs("batch_1")]
            assert outputs == [(False, b"zero\n"), (True, b"one\n")]
            await store.drop_lines("batch_1")
            assert await store.recorded_lines("batch_1") == ({}, [])
        finally:
            await store.close()

    asyncio.run(check())


class CountingMeter:
    """Settles once per record id, as the meters do; counts the calls."""

    def __init__(self) -> None:
        self.records: dict[str, UsageRecord] = {}
        self.num_calls = 0

    async def admit(self, *args: Any) -> Admission:
        raise AssertionError("the crash leftovers are settled, not admitted")

    async def settle(self, admission: Admission, record: UsageRecord) -> None:
        self.num_calls += 1
        self.records.setdefault(record.request_id, record)


def test_a_line_recorded_but_not_metered_before_a_crash_is_settled_once(tmp_path: Path) -> None:
    from gateway.batch.file_directory import FileDirectory
    from gateway.batch.runner import BatchRunner
    from gateway.batch.settings import BatchSettings
    from gateway.batch.sqlite_store import SqliteBatchStore

    async def check() -> None:
        store = await SqliteBatchStore.open(tmp_path / "batch.sqlite3")
        meter = CountingMeter()
        record = UsageRecord("batch_z/0", ANONYMOUS.project, ANONYMOUS.key_id, "m", "r", 5, 0, 2,
                             0.5, 1.0, 200, 0.0)
        try:
            await store.add_batch(batch("batch_z", ANONYMOUS.project, 1))
            await store.record_line("batch_z", LineResult(0, True, b"{}\n", dict(record.__dict__)))
            runner = BatchRunner(store, FileDirectory(tmp_path / "files"), None, None,  # type: ignore[arg-type]
                                 meter, BatchSettings())  # type: ignore[arg-type]
            stored = await store.get_batch_any("batch_z")
            assert stored is not None
            for _ in range(2):  # a restart, then another
                await runner._settle_unmetered(stored)
            assert meter.num_calls == 1 and meter.records == {"batch_z/0": record}
        finally:
            await store.close()

    asyncio.run(check())


def test_the_plan_runs_lines_sharing_a_prefix_together_and_sets_malformed_ones_apart(
        tmp_path: Path) -> None:
    systems = ["A long system prompt. " * 40, "Another long system prompt. " * 40]
    lines = []
    for i in range(6):
        body = {"model": "m", "messages": [{"role": "system", "content": systems[i % 2]},
                                           {"role": "user", "content": f"question {i}"}]}
        lines.append(orjson.dumps({"custom_id": f"l{i}", "method": "POST",
                                   "url": "/v1/chat/completions", "body": body}))
    lines.insert(3, b"[1, 2]")
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n\n")
    plan = read_plan(str(path), "/v1/chat/completions")
    assert plan.num_total == 7 and plan.model == "m"
    assert [(i.index, i.code) for i in plan.invalid] == [(3, "invalid_json_line")]
    groups = [int(line.custom_id[1:]) % 2 for line in plan.lines]
    assert groups in ([0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0])  # each group in one run
    assert sorted(line.custom_id for line in plan.lines) == [f"l{i}" for i in range(6)]
    assert [line.index for line in plan.lines if line.custom_id == "l3"] == [4]  # after the bad one
    in_file_order = read_plan(str(path), "/v1/chat/completions", by_prefix=False)  # batch.order
    assert [line.custom_id for line in in_file_order.lines] == [f"l{i}" for i in range(6)]


def test_a_bad_line_is_named_by_its_line_number_in_the_file_blank_lines_counted(
        tmp_path: Path) -> None:
    good = orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": []}})
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join([good, b"", b"  ", b"not json", good]) + b"\n")
    plan = read_plan(str(path), "/v1/chat/completions")
    assert plan.num_total == 3  # blank lines are not requests
    assert [(i.index, i.message) for i in plan.invalid] == [
        (1, "line 4 is not valid JSON"),  # the editor's line 4, not the 2nd non-blank line
        (2, "line 5: the custom_id 'a' is used by an earlier line")]
