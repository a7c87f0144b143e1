"""Request logs in Redis Streams, one stream per project (under the project's hash tag):

    aigw:{p:<P>}:reqlog                     stream  fields m (model), t (trace id), i (id),
                                                    c (created_at), e (entry)
    aigw:reqlog:trace:<trace id>            set     "<project> <stream id>" members (EXPIRE:
                                                    retention)
    aigw:reqlog:settings                    hash    project -> settings JSON (admin API)

Each XADD trims the stream to MAXLEN ~ max_project_bytes // max_entry_bytes entries (so a project
holds at most about max_project_bytes), then XTRIM MINID ~ drops what is past the retention,
and the stream's EXPIRE is pushed to the retention (an idle project's stream goes away whole).
Stream ids are millisecond timestamps of the XADD (after the entry's created_at), so `since` is
a range read; `until`, model, trace and request id filters are applied to what the range returns
(at most `_MAX_SCANNED` entries a page).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.request_logs.entry import LogEntry
from gateway.request_logs.store import MAX_PAGE, LogQuery, RequestLogStore

_SETTINGS_KEY = "aigw:reqlog:settings"
_MAX_SCANNED = 5000  # entries a filtered page reads at most
_BATCH = 200


def stream_key(project: str) -> str:
    return f"aigw:{{p:{project}}}:reqlog"


def _trace_key(trace_id: str) -> str:
    return f"aigw:reqlog:trace:{trace_id}"


class RedisLogStore(RequestLogStore):
    def __init__(self, client: Any, retention_s: float, max_entries: int) -> None:
        self._redis = client  # decode_responses=True (shared with auth and metering)
        self._retention_s = retention_s
        self._max_entries = max(1, max_entries)

    async def append(self, entries: list[LogEntry], now: float) -> None:
        retention_ms = int(self._retention_s * 1000)
        minid = int(now * 1000) - retention_ms
        pipe = self._redis.pipeline(transaction=False)
        projects = set()
        for entry in entries:
            key = stream_key(entry.project)
            projects.add(entry.project)
            pipe.xadd(key, {"m": entry.model, "t": entry.trace_id or "", "i": entry.id,
                            "c": repr(entry.created_at), "e": entry.data.decode()},
                      maxlen=self._max_entries, approximate=True)
        for project in projects:
            pipe.xtrim(stream_key(project), minid=minid, approximate=True)
            pipe.pexpire(stream_key(project), retention_ms)
        results = await pipe.execute()
        trace_pipe = self._redis.pipeline(transaction=False)
        for entry, stream_id in zip(entries, results, strict=False):
            if entry.trace_id:
                trace_pipe.sadd(_trace_key(entry.trace_id), f"{entry.project} {stream_id}")
                trace_pipe.pexpire(_trace_key(entry.trace_id), retention_ms)
        if len(trace_pipe):
            await trace_pipe.execute()

    async def trim(self, now: float) -> None:
        """(Each append trims its streams; an idle one expires.)"""

    async def query(self, query: LogQuery) -> tuple[list[dict[str, Any]], str | None]:
        limit = min(max(1, query.limit), MAX_PAGE)
        if query.project is None:
            if query.trace_id is None:
                raise ValueError("the Redis store finds entries of every project by trace_id only")
            return await self._by_trace(query, limit), None
        import time

        high = "+"  # (an entry is added after its created_at: `until` is checked per entry)
        if query.cursor is not None:
            if not _is_stream_id(query.cursor):
                raise ValueError("cursor: not one this store handed out")
            high = f"({query.cursor}"
        floor_s = time.time() - self._retention_s
        low = str(int(max(floor_s, query.since or 0.0) * 1000))
        found: list[dict[str, Any]] = []
        num_scanned, last_id = 0, None
        while len(found) < limit and num_scanned < _MAX_SCANNED:
            rows = await self._redis.xrevrange(stream_key(query.project), high, low, count=_BATCH)
            if not rows:
                last_id = None
                break
            for stream_id, fields in rows:
                num_scanned += 1
                last_id = stream_id
                if _matches(fields, query):
                    found.append(orjson.loads(fields["e"]))
                    if len(found) == limit:
                        break
            high = f"({last_id}"
            if len(rows) < _BATCH and len(found) < limit:
                last_id = None
                break
        return found, last_id

    async def _by_trace(self, query: LogQuery, limit: int) -> list[dict[str, Any]]:
        assert query.trace_id is not None
        found = []
        for member in sorted(await self._redis.smembers(_trace_key(query.trace_id)))[:limit]:
            project, _, stream_id = member.partition(" ")
            rows = await self._redis.xrange(stream_key(project), stream_id, stream_id)
            if rows and _matches(rows[0][1], query):
                found.append(orjson.loads(rows[0][1]["e"]))
        return found

    async def project_settings(self) -> dict[str, dict[str, Any]]:
        return {project: orjson.loads(text)
                for project, text in (await self._redis.hgetall(_SETTINGS_KEY)).items()}

    async def put_project_settings(self, project: str, values: dict[str, Any] | None) -> None:
        if values is None:
            await self._redis.hdel(_SETTINGS_KEY, project)
        else:
            await self._redis.hset(_SETTINGS_KEY, project, orjson.dumps(values).decode())

    async def close(self) -> None:
        """(The client is shared: its owner closes it.)"""


def _is_stream_id(text: str) -> bool:
    ms, sep, seq = text.partition("-")
    return (text.isascii() and len(text) <= 41 and ms.isdigit()  # (isdigit alone takes '²')
            and (not sep or seq.isdigit()))


def _matches(fields: dict[str, str], query: LogQuery) -> bool:
    if query.until is not None and float(fields.get("c") or 0.0) >= query.until:
        return False
    return ((query.model is None or fields.get("m") == query.model)
            and (query.trace_id is None or fields.get("t") == query.trace_id)
            and (query.request_id is None or fields.get("i") == query.request_id))
