"""FanOut: several engine requests (n choices, several prompts) driven as one HTTP request.

    fanout = FanOut(engine, subs, ...)
    await fanout.start()          # every engine request has yielded once, or PromptTooLongError
    async for index, output in fanout: ...
    await fanout.aclose()         # always (finally): aborts the engine requests still running

Each engine request is pumped by its own task into one queue, so outputs of different choices
interleave as the engine produces them. `start()` waits for each request's first output so that
errors the engine raises before its first yield (PromptTooLongError) surface before any HTTP
response is prepared. Closing (or cancelling the task that iterates) cancels the pumps; a
cancelled pump closes its engine generator, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from contracts.sampling_params import SamplingParams
from engine.outputs import RequestOutput
from engine.server.metrics import ReplicaMetrics
from engine.server.typedefs import ServedEngine


@dataclass(frozen=True)
class SubRequest:
    """One engine request: the choice `index` it fills in the response."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


_DONE = object()


class FanOut:
    def __init__(self, engine: ServedEngine, subs: list[SubRequest], *, metrics: ReplicaMetrics,
                 cache_salt: str | None = None, trace_headers: Mapping[str, str] | None = None,
                 retention: tuple[float, str | None] = (0.0, None), priority: int = 0) -> None:
        """`retention`: (seconds, id) of KV retention and `priority` (scheduling class, lower first)
        for every engine request (LLMEngine.add_request)."""
        self._engine = engine
        self._subs = subs
        self._metrics = metrics
        self._cache_salt = cache_salt
        self._retention = retention
        self._priority = priority
        self._trace_headers = trace_headers
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._buffered: list[tuple[int, RequestOutput]] = []
        self.first_outputs: dict[int, RequestOutput] = {}  # choice index -> its first output
        self._num_open = len(subs)

    async def start(self) -> None:
        """Start every engine request; return once each has yielded (or raise its error)."""
        for sub in self._subs:
            self._tasks.append(asyncio.create_task(self._pump(sub)))
        waiting = {sub.index for sub in self._subs}
        while waiting:
            index, item = await self._next()
            if isinstance(item, RequestOutput):
                self._buffered.append((index, item))
                self.first_outputs.setdefault(index, item)
            waiting.discard(index)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        for pair in self._buffered:
            yield pair
        self._buffered.clear()
        while self._num_open:
            index, item = await self._next()
            if isinstance(item, RequestOutput):
                yield index, item

    async def _next(self) -> tuple[int, object]:
        """The next output; raises a pump's error (after closing the others)."""
        index, item = await self._queue.get()
        if item is _DONE:
            self._num_open -= 1
        elif isinstance(item, BaseException):
            await self.aclose()
            raise item
        return index, item

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks.clear()

    async def _pump(self, sub: SubRequest) -> None:
        latency = self._metrics.track(priority=self._priority)
        retain_s, retention_id = self._retention
        outputs = self._engine.generate(sub.request_id, sub.prompt_token_ids, sub.params,
                                        cache_salt=self._cache_salt,
                                        trace_headers=self._trace_headers, retain_s=retain_s,
                                        retention_id=retention_id, priority=self._priority)
        try:
            async for output in outputs:
                latency.observe(output)
                self._queue.put_nowait((sub.index, output))
        except Exception as exc:  # handed to the consumer, which re-raises it
            self._queue.put_nowait((sub.index, exc))
        except asyncio.CancelledError:  # the consumer went away: the engine aborts the request
            latency.observe_abort()
            raise
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        self._queue.put_nowait((sub.index, _DONE))
