"""Both prefix-index implementations behind one fixture: every index test runs on each."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from gateway.routing.index import InProcessIndex, PrefixIndex
from gateway.routing.redis_index import RedisIndex
from tests.redis_cluster import clean_url_for

T = TypeVar("T")


class IndexUnderTest:
    """An index plus the loop it lives on (the redis client is bound to one loop)."""

    def __init__(self, kind: str, redis_url: str | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.kind = kind
        self.index: PrefixIndex = (InProcessIndex() if redis_url is None
                                   else self.run(_open_redis(redis_url)))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.index.close())
        self.loop.close()


async def _open_redis(url: str) -> PrefixIndex:
    return RedisIndex.from_url(url)


@pytest.fixture(params=["in_process", "redis", "redis-cluster"])
def index(request: pytest.FixtureRequest) -> Iterator[IndexUnderTest]:
    url = clean_url_for(str(request.param), request)
    under_test = IndexUnderTest(request.param, url)
    yield under_test
    under_test.close()
