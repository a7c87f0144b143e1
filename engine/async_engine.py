"""AsyncEngine: runs LLMEngine on its own thread and streams each request's outputs to asyncio.

    # RequestOutput deltas:
    async for output in engine.generate(request_id, prompt_token_ids, params):
        ...

The engine thread owns the LLMEngine; the event loop talks to it only through a command queue (add,
abort, reset) and receives outputs through `loop.call_soon_threadsafe`, one callback per step.
Closing the async generator early (client gone, task cancelled) aborts the request, which frees its
KV blocks on the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contracts.output_grammar import OutputGrammar
from contracts.sampling_params import SamplingParams
from engine.admission import Admission
from engine.engine import EngineStats, LLMEngine
from engine.outputs import FinishReason, RequestOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; requests in flight end with this error."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_config = engine.model_config
        self.tokenizer = engine.tokenizer
        self.replica_id = engine.config.replica_id
        self.max_model_len = engine.max_model_len
        self.compute_info = engine.compute_info
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        # prompt tokens of requests accepted but not yet queued by the engine thread, per class:
        # admission counts them as waiting (a burst is not all admitted on one stale load)
        self._pending_tokens: dict[int, int] = {}
        # requests admitted whose generate() has not started: (class, prompt tokens), already in
        # _pending_tokens (admission and the hold are one step under the lock: see admit)
        self._held: dict[str, tuple[int, int]] = {}
        self._pending_lock = threading.Lock()
        # engine thread: adds applied since the last publish
        self._applied_tokens: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        watch = getattr(engine.runner, "watch", None)  # a tensor-parallel replica's lost rank
        if watch is not None:
            watch(self._runner_failed)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    # ---- the asyncio side ------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       *, cache_salt: str | None = None,
                       trace_headers: Mapping[str, str] | None = None,
                       retain_s: float = 0.0, retention_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        self.engine.check_prompt(len(prompt_token_ids))  # PromptTooLongError before the first yield
        stream = _Stream(asyncio.get_running_loop())
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        with self._pending_lock:
            # an admitted request's tokens are in already
            if self._held.pop(request_id, None) is None:
                self._add_pending(priority, len(prompt_token_ids))
        self._commands.put(("add", (request_id, list(prompt_token_ids), params, cache_salt,
                                    retain_s, retention_id, priority)))
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    @property
    def latency_targets_ms(self) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) p90 targets in ms (None: none; engine/slo.py)."""
        config = self.engine.config.scheduler
        return config.ttft_p90_ms, config.tpot_p90_ms

    def admit(self, priority: int, prompts: Mapping[str, int], num_cached_tokens: int = 0
              ) -> Admission:
        """Whether a new request of class `priority` would meet its TTFT target
        (engine/admission.py), counting requests accepted ahead of it that the engine thread has
        not queued yet.
        `prompts`: its engine requests' ids and prompt lengths; `num_cached_tokens`: its prompt
        tokens the prefix cache holds (num_cached_prefix_tokens). Admitted, its prompts count as
        pending at once, in the same step as the check: a burst whose requests are all checked
        before any generate() starts is not admitted whole on one load. generate() takes each
        hold over; release_holds() drops those of requests that never started."""
        with self._pending_lock:
            pending = sum(n for c, n in self._pending_tokens.items() if c <= priority)
            admission = self.engine.admission(priority, sum(prompts.values()), pending,
                                              num_cached_tokens)
            if admission.is_admitted:
                for request_id, num_tokens in prompts.items():
                    self._held[request_id] = (priority, num_tokens)
                    self._add_pending(priority, num_tokens)
            return admission

    def release_holds(self, request_ids: Iterable[str]) -> None:
        """Drop the admission holds of requests whose generate() never started (an error before
        it, a client gone); a request that started has none left (any thread, idempotent)."""
        with self._pending_lock:
            for request_id in request_ids:
                held = self._held.pop(request_id, None)
                if held is not None:
                    self._add_pending(held[0], -held[1])

    def _add_pending(self, priority: int, num_tokens: int) -> None:
        """(under _pending_lock)"""
        left = self._pending_tokens.get(priority, 0) + num_tokens
        if left > 0:
            self._pending_tokens[priority] = left
        else:
            self._pending_tokens.pop(priority, None)

    def num_cached_prefix_tokens(self, prompt_token_ids: list[int], cache_salt: str | None) -> int:
        """Prompt tokens a new request would find cached, as of the last step (any thread)."""
        return self.engine.num_cached_prefix_tokens(prompt_token_ids, cache_salt)

    def prepare_grammar(self, grammar: OutputGrammar, cache_salt: str | None = None) -> None:
        self.engine.grammars.prepare(grammar, cache_salt)  # thread-safe; the engine thread copies

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def reset_prefix_cache(self) -> bool:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._commands.put(("reset", done))
        return await done

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def kv_events_since(self, seq: int) -> dict[str, Any]:
        page = self.engine.kv_events.since(seq)
        if page is None:
            return {"replica_id": self.replica_id, "snapshot_required": True,
                    "last_seq": self.engine.kv_events.last_seq, "batches": []}
        return page.to_json()

    def kv_snapshot(self) -> dict[str, Any]:
        return self.engine.kv_snapshot().to_json()

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout=10)
        close = getattr(self.engine.runner, "close", None)  # tensor parallel: stop the workers
        if close is not None:
            close()

    def _runner_failed(self, exc: BaseException) -> None:
        """The runner is lost for good (any thread): unready at once, every stream ends with it."""
        if self._error is None:
            self._error = exc
        self._fail_all(EngineDeadError(f"engine failed: {exc}"))

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                block = not self.engine.has_unfinished_requests
                if not self._apply_commands(block):
                    break
                self._publish_load()
                if self.engine.has_unfinished_requests:
                    self._deliver(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - the thread must report every failure
            logger.exception("engine loop failed")
            self._error = exc
            self._fail_all(EngineDeadError(f"engine failed: {exc}"))

    def _publish_load(self) -> None:
        """The adds just applied are in the scheduler's queue now: the load counts them, the
        pending tokens no longer do (one lock: admission never sees them in both or neither)."""
        with self._pending_lock:
            self.engine.publish_load()
            for priority, num_tokens in self._applied_tokens.items():
                self._add_pending(priority, -num_tokens)
        self._applied_tokens.clear()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. False means stop."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = command
            if kind == "stop":
                return False
            self._apply(kind, arg)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "add":
            request_id, prompt, params, salt, retain_s, retention_id, priority = arg
            self._applied_tokens[priority] = self._applied_tokens.get(priority, 0) + len(prompt)
            try:
                self.engine.add_request(request_id, prompt, params, salt, retain_s, retention_id,
                                        priority)
            except Exception as exc:  # noqa: BLE001 - reported to that request's stream
                self._deliver_error(request_id, exc)
        elif kind == "abort":
            output = self.engine.abort_request(arg)
            if output is not None:
                self._deliver([output])
        elif kind == "reset":
            self.engine.reset_prefix_cache()
            arg.get_loop().call_soon_threadsafe(_set_result, arg, True)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, exc)


def _put_all(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, output in items:
        stream.outputs.put_nowait(output)


def _set_result(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


__all__ = ["AsyncEngine", "EngineDeadError", "FinishReason"]
