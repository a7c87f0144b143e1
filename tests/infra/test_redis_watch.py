"""infra/redis_watch.py on a real Redis (one server and a three-node cluster): a message on the
channel reaches `on_message` in milliseconds, a version bump with no message (a lost one) reaches
`on_version` within a poll, a failing callback is retried, and `stop` ends both loops."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from infra.redis_client import connect_redis
from infra.redis_watch import ChangeWatch, open_pubsub_feed

CHANNEL = "aigw:test:watch:changes"
VERSION_KEY = "aigw:test:watch:version"
log = logging.getLogger("tests.redis_watch")


async def _until(condition: Callable[[], bool], limit_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if condition():
            return time.monotonic() - started
        await asyncio.sleep(0.005)
    return None


def _watch(client: object, seen: dict[str, list[object]], poll_interval_s: float,
           on_version: Callable[[int], Awaitable[None]] | None = None) -> ChangeWatch:
    async def read_version() -> int:
        raw = await client.get(VERSION_KEY)  # type: ignore[attr-defined]
        return 0 if raw is None else int(raw)

    async def record_version(version: int) -> None:
        seen["versions"].append(version)

    async def record_message(data: str) -> None:
        seen["messages"].append(data)

    return ChangeWatch("test", read_version=read_version,
                       on_version=on_version or record_version,
                       open_feed=lambda: open_pubsub_feed(client, CHANNEL),
                       on_message=record_message, poll_interval_s=poll_interval_s, log=log)


def test_a_published_change_and_a_bare_version_bump_both_reach_the_watcher(
        any_clean_redis_url: str) -> None:
    async def scenario() -> None:
        listener = connect_redis(any_clean_redis_url, decode_responses=True)
        writer = connect_redis(any_clean_redis_url, decode_responses=True)
        seen: dict[str, list[object]] = {"versions": [], "messages": []}
        watch = _watch(listener, seen, poll_interval_s=0.3)
        try:
            await watch.start(0)
            await asyncio.sleep(0.3)  # subscribed
            # push: the message arrives well before the next poll could matter
            num_received = 0
            for attempt in range(5):  # a message published before the subscription is lost
                await writer.publish(CHANNEL, f"scope-{attempt}")
                if await _until(lambda: bool(seen["messages"]), 0.2) is not None:
                    num_received = len(seen["messages"])
                    break
            assert num_received >= 1, seen
            assert str(seen["messages"][0]).startswith("scope-")
            assert seen["versions"] == []  # nothing bumped the version
            # poll: a bump with no message (the message lost) is seen within about one interval
            await writer.incr(VERSION_KEY)
            elapsed = await _until(lambda: seen["versions"] == [1], 2.0)
            assert elapsed is not None and elapsed <= 0.3 + 0.5, (elapsed, seen)
            assert watch.version == 1
            await asyncio.sleep(0.7)  # more polls of the same version: no second call
            assert seen["versions"] == [1]
        finally:
            started = time.monotonic()
            await watch.stop()
            assert time.monotonic() - started < 2.0  # both loops end within about a poll
            await listener.aclose()
            await writer.aclose()
        assert not watch._tasks

    asyncio.run(scenario())


def test_a_version_whose_callback_failed_is_tried_again_on_the_next_poll(
        clean_redis_url: str) -> None:
    async def scenario() -> None:
        client = connect_redis(clean_redis_url, decode_responses=True)
        calls: list[int] = []

        async def flaky(version: int) -> None:
            calls.append(version)
            if len(calls) == 1:
                raise ConnectionError("the store went away mid-reload")

        watch = _watch(client, {"versions": [], "messages": []}, 0.05, on_version=flaky)
        try:
            await watch.start(0)
            await client.set(VERSION_KEY, 4)
            assert await _until(lambda: len(calls) >= 2, 2.0) is not None, calls
            assert calls[:2] == [4, 4] and watch.version == 4
            await asyncio.sleep(0.2)
            assert len(calls) == 2  # applied once it worked; not again
        finally:
            await watch.stop()
            await client.aclose()

    asyncio.run(scenario())
