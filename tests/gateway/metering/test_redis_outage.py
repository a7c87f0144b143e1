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
from tests.gateway.metering.conftest import principal, record
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
        assert meter.backlog_bytes() > 3 * 300  # held records count against the byte bound
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


def test_a_hung_redis_bounds_the_backlog_in_bytes_refuses_new_requests_and_drops_nothing() -> None:
    """A redis-server stopped with SIGSTOP accepts connections and never answers: queued usage
    writes wait in the coalescer with no error to hold them by. Past backlog_max_bytes the meter
    refuses new requests (MeterBacklogged, the gateway's 503) instead of growing, and once Redis
    answers again every record is written."""
    import os
    import signal

    from gateway.metering.contract import MeterBacklogged

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    bound = 8_000

    async def scenario() -> tuple[int, int, int, list[str]]:
        with _redis_on(port):
            meter = await open_meter(MeteringSettings(backlog_max_bytes=bound), redis=url)
            admission = await meter.admit("before", principal(), "m", 5, 5)
            await meter.settle(admission, record("before", 5, 5))
            pid = int(subprocess.check_output(["redis-cli", "-p", str(port), "info", "server"],
                                              text=True).split("process_id:")[1].split()[0])
            os.kill(pid, signal.SIGSTOP)
            try:
                num_admitted, peak = 0, 0
                for i in range(1_000):  # one would do at a time; a hang holds them all
                    try:
                        admission = await meter.admit(f"hung-{i}", principal(), "m", 7, 3)
                    except MeterBacklogged:
                        break
                    meter.settle_nowait(admission, record(f"hung-{i}", 7, 3))
                    num_admitted += 1
                    await asyncio.sleep(0.002)  # past the linger: a flush goes out and hangs
                    peak = max(peak, meter.backlog_bytes())
            finally:
                os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 15
            while meter.backlog_bytes() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            left = meter.backlog_bytes()
            await meter.admit("after", principal(), "m", 1, 1)  # admitted again
            records = await meter.usage_records("acme")
            await meter.close()
        return num_admitted, peak, left, [r.request_id for r in records]

    num_admitted, peak, left, written = asyncio.run(scenario())
    assert 3 <= num_admitted < 1_000  # refused once the bound was passed, not before
    assert bound < peak <= bound + 2_000  # passed by at most the one write admitted last
    assert left == 0
    assert sorted(written) == sorted(["before", *(f"hung-{i}" for i in range(num_admitted))])
