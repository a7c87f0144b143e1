"""The shared `BatchStore`: Redis, so every gateway sees the same files and batches.

    aigw:batch:file:<id>                    a file's metadata (JSON)
    aigw:batch:files:<project>[:<purpose>]  the project's file ids, scored by created_at
    aigw:batch:bytes:<project>              the bytes the project's files hold
    aigw:batch:{<id>}:state                 hash: body (JSON without cancelling_at), cancelling_at,
                                            project
    aigw:batch:{<id>}:lines                 hash: line index -> {ok, output, record} (HSETNX: the
                                            first)
    aigw:batch:{<id>}:metered               set of metered line indexes
    aigw:batch:{<id>}:lease                 the gateway working it (SET NX PX)
    aigw:batch:batches:<project>            the project's batch ids, scored by created_at
    aigw:batch:active                       batches with work left, scored by created_at
    aigw:batch:active:<project>             the same, one project's (its count is bounded)

A zset orders members of one score by their bytes, so (created_at, id) pages the same as SQLite's
index. Each call touches one key or keys of one batch (one hash tag): Redis Cluster works too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.batch.records import BatchRecord, BatchStatus, FileRecord, LineResult
from gateway.batch.store import BatchStore

_P = "aigw:batch:"
_LINE_PAGE = 512
# take the lease if free, or renew it if ours
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


def _state(batch_id: str) -> str:
    return f"{_P}{{{batch_id}}}:state"


def _lines(batch_id: str) -> str:
    return f"{_P}{{{batch_id}}}:lines"


def _metered(batch_id: str) -> str:
    return f"{_P}{{{batch_id}}}:metered"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisBatchStore(BatchStore):
    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._lease = redis.register_script(_LEASE)

    async def add_file(self, record: FileRecord) -> None:
        redis = self._redis
        key = f"{_P}file:{record.id}"
        previous = await redis.get(key)
        await redis.set(key, orjson.dumps(record.__dict__))
        if previous is not None:
            await redis.decrby(f"{_P}bytes:{record.project}",
                               orjson.loads(previous)["num_bytes"])
        await redis.incrby(f"{_P}bytes:{record.project}", record.num_bytes)
        for index in (f"{_P}files:{record.project}",
                      f"{_P}files:{record.project}:{record.purpose}"):
            await redis.zadd(index, {record.id: record.created_at})

    async def _file_any(self, file_id: str) -> FileRecord | None:
        raw = await self._redis.get(f"{_P}file:{file_id}")
        return None if raw is None else FileRecord(**orjson.loads(raw))

    async def get_file(self, project: str, file_id: str) -> FileRecord | None:
        record = await self._file_any(file_id)
        return record if record is not None and record.project == project else None

    async def _page(self, index: str, after: str | None, limit: int, newest_first: bool
                    ) -> tuple[list[str], bool]:
        start = 0
        if after is not None:
            rank = await (self._redis.zrevrank if newest_first else self._redis.zrank)(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = await self._redis.zrange(index, start, start + limit, desc=newest_first)
        return [_text(i) for i in ids[:limit]], len(ids) > limit

    async def list_files(self, project: str, purpose: str | None, after: str | None,
                         limit: int, newest_first: bool) -> tuple[list[FileRecord], bool]:
        index = f"{_P}files:{project}" + (f":{purpose}" if purpose else "")
        ids, has_more = await self._page(index, after, limit, newest_first)
        records = [await self._file_any(file_id) for file_id in ids]
        return [r for r in records if r is not None], has_more

    async def delete_file(self, project: str, file_id: str) -> bool:
        record = await self.get_file(project, file_id)
        if record is None or not await self._redis.delete(f"{_P}file:{file_id}"):
            return False
        await self._redis.decrby(f"{_P}bytes:{project}", record.num_bytes)
        for index in (f"{_P}files:{project}", f"{_P}files:{project}:{record.purpose}"):
            await self._redis.zrem(index, file_id)
        return True

    async def project_bytes(self, project: str) -> int:
        return int(await self._redis.get(f"{_P}bytes:{project}") or 0)

    async def add_batch(self, record: BatchRecord) -> None:
        await self._redis.hset(_state(record.id), mapping={"body": _body(record),
                                                           "project": record.project})
        await self._redis.zadd(f"{_P}batches:{record.project}", {record.id: record.created_at})
        await self._redis.zadd(f"{_P}active", {record.id: record.created_at})
        await self._redis.zadd(f"{_P}active:{record.project}", {record.id: record.created_at})

    async def get_batch_any(self, batch_id: str) -> BatchRecord | None:
        body, cancelling_at = await self._redis.hmget(_state(batch_id), ["body", "cancelling_at"])
        if body is None:
            return None
        record = BatchRecord.from_json(orjson.loads(body))
        record.cancelling_at = None if cancelling_at is None else int(cancelling_at)
        return record

    async def get_batch(self, project: str, batch_id: str) -> BatchRecord | None:
        record = await self.get_batch_any(batch_id)
        return record if record is not None and record.project == project else None

    async def list_batches(self, project: str, after: str | None, limit: int
                           ) -> tuple[list[BatchRecord], bool]:
        ids, has_more = await self._page(f"{_P}batches:{project}", after, limit, True)
        records = [await self.get_batch_any(batch_id) for batch_id in ids]
        return [r for r in records if r is not None], has_more

    async def save_batch(self, record: BatchRecord) -> None:
        await self._redis.hset(_state(record.id), "body", _body(record))
        if not BatchStatus(record.status).is_active:
            await self._redis.zrem(f"{_P}active", record.id)
            await self._redis.zrem(f"{_P}active:{record.project}", record.id)

    async def request_cancel(self, project: str, batch_id: str, at: int) -> BatchRecord | None:
        record = await self.get_batch(project, batch_id)
        if record is None:
            return None
        if BatchStatus(record.status).is_active:
            await self._redis.hsetnx(_state(batch_id), "cancelling_at", at)
        return await self.get_batch(project, batch_id)

    async def active_batch_ids(self) -> list[str]:
        return [_text(i) for i in await self._redis.zrange(f"{_P}active", 0, -1)]

    async def num_active_batches(self, project: str) -> int:
        return int(await self._redis.zcard(f"{_P}active:{project}"))

    async def try_lease(self, batch_id: str, owner: str, lease_s: float) -> bool:
        return bool(await self._lease(keys=[f"{_P}{{{batch_id}}}:lease"],
                                      args=[owner, int(lease_s * 1000)]))

    async def record_line(self, batch_id: str, result: LineResult) -> bool:
        value = orjson.dumps({"ok": result.ok, "output": result.output.decode(),
                              "record": result.usage_record})
        inserted = bool(await self._redis.hsetnx(_lines(batch_id), str(result.index), value))
        if inserted and result.metered:
            await self._redis.sadd(_metered(batch_id), result.index)
        return inserted

    async def mark_metered(self, batch_id: str, index: int) -> None:
        await self._redis.sadd(_metered(batch_id), index)

    async def recorded_lines(self, batch_id: str) -> tuple[dict[int, bool], list[LineResult]]:
        metered = {int(i) for i in await self._redis.smembers(_metered(batch_id))}
        recorded: dict[int, bool] = {}
        unmetered: list[LineResult] = []
        async for field, raw in self._redis.hscan_iter(_lines(batch_id), count=_LINE_PAGE):
            index, line = int(field), orjson.loads(raw)
            recorded[index] = line["ok"]
            if index not in metered and line["record"] is not None:
                unmetered.append(LineResult(index, line["ok"], line["output"].encode(),
                                            line["record"]))
        return recorded, unmetered

    async def line_outputs(self, batch_id: str
                           ) -> AsyncIterator[tuple[bool, bytes, dict[str, Any] | None]]:
        record = await self.get_batch_any(batch_id)
        num_lines = 0 if record is None else record.num_total
        for start in range(0, num_lines, _LINE_PAGE):
            fields = [str(i) for i in range(start, min(start + _LINE_PAGE, num_lines))]
            for raw in await self._redis.hmget(_lines(batch_id), fields):
                if raw is not None:
                    line = orjson.loads(raw)
                    yield line["ok"], line["output"].encode(), line["record"]

    async def drop_lines(self, batch_id: str) -> None:
        await self._redis.delete(_lines(batch_id), _metered(batch_id))

    async def close(self) -> None:
        await self._redis.aclose()


def _body(record: BatchRecord) -> bytes:
    data = record.to_json()
    data.pop("cancelling_at")
    return orjson.dumps(data)
