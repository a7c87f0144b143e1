"""Real sockets: mock upstreams and the gateway run on one event loop in a background thread; the
tests drive them with the real `openai`/`anthropic` SDKs and httpx from the main thread."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.metering.null_meter import NullMeter
from gateway.settings import GatewaySettings
from gateway.web.app import create_app
from gateway.web.server import gateway_runner

T = TypeVar("T")
MODEL = "mock-model"


def wait_until(condition: Callable[[], object], timeout_s: float = 5.0) -> bool:
    """Poll `condition` until it is true (the gateway settles usage after the answer is sent)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:  # say where the loop's tasks stood: a hang is found from this
            stacks = io.StringIO()
            for task in asyncio.all_tasks(self.loop):
                task.print_stack(file=stacks)
            raise TimeoutError(f"not done within {timeout_s:g}s; the loop's tasks:\n"
                               f"{stacks.getvalue()}") from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def start_runner(runner: web.BaseRunner) -> str:
    """Set `runner` up and serve it on a free port of 127.0.0.1 -> its URL."""
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return f"http://127.0.0.1:{port}"


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    return runner, await start_runner(runner)


async def write_sse(response: web.StreamResponse, chunks: Iterable[dict[str, Any]]) -> None:
    """Each chunk as an OpenAI SSE event, then `data: [DONE]`."""
    for chunk in chunks:
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")


def chat_upstream_app(chat: Handler, listed_models: Sequence[dict[str, Any]] | None = None
                      ) -> web.Application:
    """A hand-written upstream for one test: `chat` at /v1/chat/completions, a healthy /health
    and, with `listed_models`, GET /v1/models listing them."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": list(listed_models or ())})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    if listed_models is not None:
        app.router.add_get("/v1/models", models)
    return app


def start_chat_upstream(loop_thread: LoopThread, chat: Handler) -> tuple[web.AppRunner, str]:
    """`chat_upstream_app(chat)` started on 127.0.0.1 -> (runner, url)."""
    return loop_thread.run(start_app(chat_upstream_app(chat)))


CANNED_ANSWER = {"id": "c1", "object": "chat.completion", "created": 1, "model": MODEL,
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"},
                              "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


@dataclass(frozen=True)
class Refusal:
    """What a canned upstream answers every call with instead of CANNED_ANSWER."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


CannedUpstreamFactory = Callable[[Refusal | None], tuple[str, list[dict[str, Any]]]]


@pytest.fixture
def canned_upstreams(loop_thread: LoopThread) -> Iterator[CannedUpstreamFactory]:
    """make(refusal) -> (url, calls): an OpenAI-wire upstream on 127.0.0.1 that answers every
    chat call with `refusal` or, when None, with CANNED_ANSWER ("fine", 3 + 1 tokens); `calls`
    holds each call's JSON body. Torn down after the test."""
    runners: list[web.AppRunner] = []

    def make(refusal: Refusal | None) -> tuple[str, list[dict[str, Any]]]:
        calls: list[dict[str, Any]] = []

        async def chat(request: web.Request) -> web.Response:
            calls.append(await request.json())
            if refusal is not None:
                return web.json_response(refusal.body, status=refusal.status,
                                         headers=refusal.headers)
            return web.json_response(CANNED_ANSWER)

        runner, url = start_chat_upstream(loop_thread, chat)
        runners.append(runner)
        return url, calls

    yield make
    for runner in runners:
        loop_thread.run(runner.cleanup())


@dataclass
class Upstream:
    state: MockState
    url: str


@dataclass
class Gateway:
    url: str
    app: web.Application
    meter: NullMeter
    upstreams: list[Upstream]


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


GatewayFactory = Callable[..., Gateway]


@pytest.fixture
def make_gateway(loop_thread: LoopThread) -> Iterator[GatewayFactory]:
    """make_gateway(num_upstreams=1, configs=None, **settings) -> Gateway, torn down after the
    test."""
    runners: list[web.AppRunner] = []

    def make(num_upstreams: int = 1, configs: list[MockConfig] | None = None,
             authenticator: Any = None, meter: Any = None, **overrides: Any) -> Gateway:
        configs = configs or [MockConfig() for _ in range(num_upstreams)]
        upstreams = []
        for config in configs:
            state = MockState(config)
            runner, url = loop_thread.run(start_app(create_mock_app(state)))
            runners.append(runner)
            upstreams.append(Upstream(state, url))
        values: dict[str, Any] = {
            "auth_enabled": authenticator is not None, "health_interval_s": 0.2,
            "first_token_timeout_s": 2.0, "idle_timeout_s": 2.0, "health_timeout_s": 1.0,
            "models": [{"name": MODEL, "backend": "replica",
                        "endpoints": [u.url for u in upstreams],
                        "prices": {"input_per_token": 1e-6, "cached_input_per_token": 1e-7,
                                   "output_per_token": 2e-6}}],
        }
        values.update(overrides)
        settings = GatewaySettings(**values)
        meter = meter or NullMeter()
        app = create_app(settings, authenticator=authenticator, meter=meter)
        runner, url = loop_thread.run(start_app(app))
        runners.append(runner)
        return Gateway(url, app, meter, upstreams)

    yield make
    for runner in reversed(runners):
        loop_thread.run(runner.cleanup())


GatewayServer = Callable[[GatewaySettings], str]


@pytest.fixture
def serve_gateway(loop_thread: LoopThread) -> Iterator[GatewayServer]:
    """serve(settings) -> URL: the gateway run by the runner `aigw serve` uses (its header and
    body timeouts, its access log), torn down after the test."""
    runners: list[web.BaseRunner] = []

    def serve(settings: GatewaySettings) -> str:
        runner = gateway_runner(create_app(settings), settings)
        runners.append(runner)
        return loop_thread.run(start_runner(runner))

    yield serve
    for runner in runners:
        loop_thread.run(runner.cleanup())


@pytest.fixture
def gateway(make_gateway: GatewayFactory) -> Gateway:
    return make_gateway()


# One real replica and an authenticating gateway before it, for tests/gateway/telemetry and
# tests/gateway/dashboard: registered here, once, so that both folders share the one session
# replica (a fixture imported into two conftests is two fixtures, started twice). Imported last:
# served_replica uses LoopThread and start_app above.
from tests.gateway.served_replica import observability_loop, replica_url, served  # noqa: E402, F401
