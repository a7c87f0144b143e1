"""Usage settled while Redis is down is held and written when it is back: nothing lost, nothing
counted twice. A real redis-server, stopped and started again on the same port."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.metering import MeteringSettings, open_meter
from tests.metering.conftest import principal, record
from tests.redis_server import free_port, ping


@contextmanager
def _redis_on(port: int) -> Iterator[None]:
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not on PATH: run scripts/ensure-redis.sh"
    with tempfile.TemporaryDirectory(prefix="aigw-redis-") as workdir:
        process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                                    workdir, "--save", "", "--appendonly", "no"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while not ping(port):
                assert process.poll() is None and time.monotonic() < deadline, "no redis-server"
                time.sleep(0.02)
            yield
        finally:
            process.terminate()
            process.wait(5)


def test_settles_queued_while_redis_is_down_are_written_once_it_is_back() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"

    async def scenario() -> list[tuple[str, int]]:
        with _redis_on(port):
            meter = await open_meter(MeteringSettings(), redis=url)
            admission = await meter.admit("before", principal(), "m", 5, 5)
            await meter.settle(admission, record("before", 5, 5))
        # Redis is down: the answers go out, their usage is queued and fails to write
        for i in range(3):
            admission = await meter.admit(f"down-{i}", principal(), "m", 7, 3)
            meter.settle_nowait(admission, record(f"down-{i}", 7, 3))
        await asyncio.sleep(0.3)  # several failed writes later
        with _redis_on(port):  # back, empty (no persistence): only the held records come
            deadline = time.monotonic() + 15
            while True:
                records = await meter.usage_records("acme")
                if len(records) == 3 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            rows = await meter.usage_by_project("acme", group_by=())
            await meter.close()
        return [(r.request_id, r.prompt_tokens) for r in records] + [
            ("sum", row.prompt_tokens) for row in rows]

    written = asyncio.run(scenario())
    assert sorted(written) == [("down-0", 7), ("down-1", 7), ("down-2", 7), ("sum", 21)]
