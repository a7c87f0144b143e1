"""The shared key store in Redis.

Key layout (every key starts with `aigw:`; `{...}` is a Redis Cluster hash tag):

    aigw:auth:projects                 hash   project name -> ProjectRecord JSON
    aigw:auth:key:{k:<key_id>}         string KeyRecord JSON (found by key id, never by scan)
    aigw:{p:<project>}:auth:keys       set    key ids of the project (listing only)
    aigw:auth:revocation_version       int    INCR on every revoke/rotate (polled as a backup)
    aigw:auth:revocations              pubsub channel; message = changed key id
    aigw:auth:pepper                   string hex pepper, when AuthSettings.key_pepper is unset

No command here touches two keys at once, so no cross-slot script is needed; on Redis Cluster
the revocation channel is a plain PUBLISH, which the cluster bus carries to every node. The metering
keys (usage, limits) share the `{p:<project>}` tag: see gateway/metering/redis_meter.py.
"""

from __future__ import annotations

import json
from typing import Any

from auth.keys import KeyRecord, ProjectRecord
from auth.store import KeyStore, ProjectExists, UnknownKey
from infra.redis_watch import ChangeFeed, open_pubsub_feed

PROJECTS_KEY = "aigw:auth:projects"
REVOCATION_VERSION_KEY = "aigw:auth:revocation_version"
REVOCATION_CHANNEL = "aigw:auth:revocations"
PEPPER_KEY = "aigw:auth:pepper"


def key_record_key(key_id: str) -> str:
    return f"aigw:auth:key:{{k:{key_id}}}"


def project_keys_key(project: str) -> str:
    return f"aigw:{{p:{project}}}:auth:keys"


def connect_redis(url: str) -> Any:
    """A decoding client for `url` (redis:// or redis+cluster://: infra/redis_client.py)."""
    from infra.redis_client import connect_redis as connect

    return connect(url, decode_responses=True)


class RedisKeyStore(KeyStore):
    def __init__(self, client: Any, owns_client: bool = False) -> None:
        self.client = client
        self._owns_client = owns_client

    async def create_project(self, project: ProjectRecord) -> None:
        created = await self.client.hsetnx(
            PROJECTS_KEY, project.name, json.dumps({"created_at": project.created_at}))
        if not created:
            raise ProjectExists(project.name)

    async def get_project(self, name: str) -> ProjectRecord | None:
        raw = await self.client.hget(PROJECTS_KEY, name)
        return None if raw is None else ProjectRecord(name, json.loads(raw)["created_at"])

    async def list_projects(self) -> list[ProjectRecord]:
        raw = await self.client.hgetall(PROJECTS_KEY)
        return [ProjectRecord(name, json.loads(value)["created_at"])
                for name, value in sorted(raw.items())]

    async def add_key(self, record: KeyRecord) -> None:
        await self.client.set(key_record_key(record.key_id), json.dumps(record.to_json_dict()))
        await self.client.sadd(project_keys_key(record.project), record.key_id)

    async def get_key(self, key_id: str) -> KeyRecord | None:
        raw = await self.client.get(key_record_key(key_id))
        return None if raw is None else KeyRecord.from_json_dict(json.loads(raw))

    async def list_keys(self, project: str) -> list[KeyRecord]:
        key_ids = sorted(await self.client.smembers(project_keys_key(project)))
        if not key_ids:
            return []
        pipe = self.client.pipeline(transaction=False)  # the records span slots: no MULTI
        for key_id in key_ids:
            pipe.get(key_record_key(key_id))
        raws = await pipe.execute()
        records = [KeyRecord.from_json_dict(json.loads(raw)) for raw in raws if raw is not None]
        return sorted(records, key=lambda r: (r.created_at, r.key_id))

    async def replace_key(self, record: KeyRecord) -> None:
        updated = await self.client.set(
            key_record_key(record.key_id), json.dumps(record.to_json_dict()), xx=True)
        if not updated:
            raise UnknownKey(record.key_id)
        await self.client.incr(REVOCATION_VERSION_KEY)
        await self.client.publish(REVOCATION_CHANNEL, record.key_id)

    async def revocation_version(self) -> int:
        raw = await self.client.get(REVOCATION_VERSION_KEY)
        return 0 if raw is None else int(raw)

    async def load_or_create_pepper(self, candidate: bytes) -> bytes:
        await self.client.set(PEPPER_KEY, candidate.hex(), nx=True)
        return bytes.fromhex(await self.client.get(PEPPER_KEY))

    async def open_change_feed(self) -> ChangeFeed | None:
        return await open_pubsub_feed(self.client, REVOCATION_CHANNEL)

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()
