"""A trace's request log entries in the dashboard, in a real headless Chromium (Playwright): on a
served gateway (auth on, embedded store, request logs for the default project), an admin selects
a request's trace and sees its entry (model, status, tokens, the redacted body) under the
waterfall."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.settings import GatewaySettings
from gateway.web.services import create_served_app
from tests.gateway.conftest import LoopThread, start_app
from tests.gateway.dashboard.test_dashboard_browser import CHROMIUM_ARGS, UI_TIMEOUT_MS, _chromium
from tests.gateway.request_logs.test_request_logs import _keys
from tests.gateway.scripted_upstream import create_scripted_upstream

pytestmark = pytest.mark.slow
MODEL = "chat-model"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    loop_thread = LoopThread()
    data_dir: Path = tmp_path_factory.mktemp("dashboard-logs")
    upstream, upstream_url = loop_thread.run(start_app(create_scripted_upstream([])))
    keys = loop_thread.run(_keys(data_dir, None))
    settings = GatewaySettings(data_dir=data_dir, models=[{
        "name": MODEL, "backend": "openai", "endpoints": [upstream_url], "context_length": 4096}],
        request_logs={"projects": {"default": {}}})
    runner, url = loop_thread.run(start_app(loop_thread.run(create_served_app(settings))))
    try:
        yield url, keys
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())
        loop_thread.close()


def test_a_trace_shows_its_request_log_entry(gateway: tuple[str, dict[str, str]]) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    executable = _chromium()
    url, keys = gateway
    answer = httpx.post(url + "/v1/chat/completions", timeout=30,
                        headers={"authorization": f"Bearer {keys['default']}"},
                        json={"model": MODEL, "messages": [
                            {"role": "user",
                             "content": "SAY:logged via sk-abcdefghijklmnopqrstu"}]})
    assert answer.status_code == 200, answer.text
    trace_id = answer.headers["x-aigw-trace-id"]
    with tempfile.TemporaryDirectory() as profile, sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=executable, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 1500})
        try:
            page = context.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.goto(url + "/dashboard")
            page.fill("#key", keys["ops"])
            page.click("#login-form button")
            page.click(f"#traces tr[data-trace='{trace_id}']")
            page.wait_for_selector("#trace-logs .log-entry")
            shown = page.inner_text("#trace-logs")
            assert MODEL in shown and "status 200" in shown and "/v1/chat/completions" in shown
            assert "logged via [REDACTED]" in shown and "sk-abcdefghijklmnopqrstu" not in shown
        finally:
            context.close()
