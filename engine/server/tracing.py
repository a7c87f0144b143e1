"""Replica spans that continue the gateway's trace, and GET /debug/traces to read them back.

    engine = install_tracing(app, engine)     # engine/server/app.py, before the ServingContext

`TracedEngine` wraps the engine's `generate`: when a request finishes, it builds after the fact,
from `RequestOutput.timings` (queue_s, prefill_s, decode_s, counted back from the moment the final
output arrived), a `replica.generate` span whose parent is the incoming W3C `traceparent`, with
children `engine.queue`, `engine.prefill` and `engine.decode`. Nothing runs per token.

A request that never finishes (its caller went away or timed out, and the engine aborts it; or the
engine raised) still gets its `replica.generate` span: the counts of its last output, finish reason
`abort` (an engine error instead: its `error.type`, and status ERROR unless the prompt was too
long), and an `engine.decode` child from its first output on, when there was one (the engine's
queue/prefill split is not known then).

Spans go to this process's own SpanBuffer (and OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set,
see infra/telemetry/settings.py); the gateway's dashboard fetches a trace's replica spans from
`GET /debug/traces?trace_id=<32 hex>` and merges them with its own. Spans carry token counts and
timings, never prompt or completion text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from contracts.sampling_params import SamplingParams
from engine.outputs import FinishReason, PromptTooLongError, RequestOutput
from engine.server.typedefs import ServedEngine
from infra.telemetry.settings import TelemetrySettings
from infra.telemetry.span_buffer import SpanBuffer
from infra.telemetry.tracing import build_tracer_provider

_PROPAGATOR = TraceContextTextMapPropagator()
_NS_PER_S = 1_000_000_000
SPAN_BUFFER_KEY = web.AppKey("span_buffer", SpanBuffer)


class TracedEngine:
    """The engine, with `generate` traced; everything else is the engine's own (`__getattr__`)."""

    def __init__(self, inner: ServedEngine, tracer: Tracer) -> None:
        self.inner = inner
        self._tracer = tracer
        self._model = inner.model_config.model_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       *, cache_salt: str | None = None,
                       trace_headers: Mapping[str, str] | None = None,
                       retain_s: float = 0.0, retention_id: str | None = None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        started_ns = time.time_ns()
        first_output_ns: int | None = None
        last: RequestOutput | None = None
        error: BaseException | None = None
        outputs = self.inner.generate(request_id, prompt_token_ids, params, cache_salt=cache_salt,
                                      trace_headers=trace_headers, retain_s=retain_s,
                                      retention_id=retention_id, priority=priority)
        try:
            async for output in outputs:
                if first_output_ns is None:
                    first_output_ns = time.time_ns()
                last = output
                if output.finished:
                    self.record(request_id, params, output, trace_headers or {}, started_ns,
                                time.time_ns())
                yield output
        except Exception as exc:
            error = exc
            raise
        finally:
            if last is None or not last.finished:  # aborted (cancelled, closed early) or failed
                self.record_unfinished(request_id, params, last, trace_headers or {}, started_ns,
                                       first_output_ns, time.time_ns(), error)
            await outputs.aclose()  # type: ignore[attr-defined]

    def _attributes(self, request_id: str, params: SamplingParams, output: RequestOutput | None,
                    finish_reason: str | None) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "gen_ai.system": "aigw", "gen_ai.request.model": self._model,
            "gen_ai.response.model": self._model, "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": output.num_prompt_tokens if output else 0,
            "gen_ai.usage.output_tokens": output.num_output_tokens if output else 0,
            "aigw.cached_tokens": output.num_cached_tokens if output else 0,
            "aigw.replica": self.inner.replica_id, "aigw.request_id": request_id}
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = [finish_reason]
        return attributes

    def record_unfinished(self, request_id: str, params: SamplingParams, last: RequestOutput | None,
                          trace_headers: Mapping[str, str], started_ns: int,
                          first_output_ns: int | None, ended_ns: int,
                          error: BaseException | None) -> None:
        """Spans for an engine request that ended without a final output (module docstring)."""
        attributes = self._attributes(request_id, params, last,
                                      None if error is not None else str(FinishReason.ABORT))
        root = self._tracer.start_span("replica.generate",
                                       context=_PROPAGATOR.extract(trace_headers),
                                       kind=SpanKind.SERVER, start_time=started_ns,
                                       attributes=attributes)
        if not root.is_recording():
            return
        if error is not None:
            root.set_attribute("error.type", type(error).__qualname__)
            if not isinstance(error, PromptTooLongError):  # (that one is the caller's 400)
                root.set_status(Status(StatusCode.ERROR, str(error)[:200]))
        if first_output_ns is not None:
            self._tracer.start_span(
                "engine.decode", context=set_span_in_context(root), start_time=first_output_ns,
                attributes={"gen_ai.usage.output_tokens": last.num_output_tokens if last else 0},
            ).end(end_time=ended_ns)
        root.end(end_time=ended_ns)

    def record(self, request_id: str, params: SamplingParams, final: RequestOutput,
               trace_headers: Mapping[str, str], started_ns: int, finished_ns: int) -> None:
        """Spans for one finished engine request (see the module docstring)."""
        timings = final.timings
        decode_ns = finished_ns - int(timings.get("decode_s", 0.0) * _NS_PER_S)
        prefill_ns = decode_ns - int(timings.get("prefill_s", 0.0) * _NS_PER_S)
        queue_ns = prefill_ns - int(timings.get("queue_s", 0.0) * _NS_PER_S)
        parent = _PROPAGATOR.extract(trace_headers)
        attributes = self._attributes(request_id, params, final,
                                      None if final.finish_reason is None
                                      else str(final.finish_reason))
        root = self._tracer.start_span("replica.generate", context=parent, kind=SpanKind.SERVER,
                                       start_time=min(started_ns, queue_ns), attributes=attributes)
        if not root.is_recording():
            return
        context = set_span_in_context(root)
        prefill_attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": final.num_prompt_tokens,
            "aigw.cached_tokens": final.num_cached_tokens,
            "aigw.computed_tokens": max(0, final.num_prompt_tokens - final.num_cached_tokens)}
        if "num_prefill_chunks" in timings:
            prefill_attributes["aigw.prefill_chunks"] = int(timings["num_prefill_chunks"])
        for name, start, end, extra in (
                ("engine.queue", queue_ns, prefill_ns, {}),
                ("engine.prefill", prefill_ns, decode_ns, prefill_attributes),
                ("engine.decode", decode_ns, finished_ns,
                 {"gen_ai.usage.output_tokens": final.num_output_tokens})):
            self._tracer.start_span(name, context=context, start_time=start,
                                    attributes=extra).end(end_time=end)
        root.end(end_time=finished_ns)


def install_tracing(app: web.Application, engine: ServedEngine,
                    settings: TelemetrySettings | None = None) -> ServedEngine:
    """Add GET /debug/traces and the provider's shutdown to `app`; return the traced engine."""
    settings = settings or TelemetrySettings.from_env(service_name="aigw-replica")
    provider, buffer = build_tracer_provider(settings)
    app[SPAN_BUFFER_KEY] = buffer
    app.router.add_get("/debug/traces", debug_traces)

    async def shutdown(_: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(provider.shutdown)

    app.cleanup_ctx.append(shutdown)
    return TracedEngine(engine, provider.get_tracer("aigw.replica"))  # type: ignore[return-value]


async def debug_traces(request: web.Request) -> web.Response:
    """{"spans": [...]} of one trace (`?trace_id=`), or of the most recent traces without one."""
    buffer = request.app[SPAN_BUFFER_KEY]
    trace_id = request.query.get("trace_id")
    if trace_id:
        spans = buffer.trace(trace_id)
    else:
        spans = [span for trace in buffer.recent(20) for span in trace]
    return web.json_response({"spans": spans})
