"""The ops dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright): after
some traffic, an admin signs in and sees the replica, the project's usage and a trace waterfall
with gateway and replica spans. Saves the screenshot the README shows (docs/dashboard.png).

Skips only where no Chromium can be found or installed (scripts/ensure-chromium.sh installs it).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.gateway.served_replica import ADMIN_KEY, PROJECT, USER_KEY, Served

pytestmark = pytest.mark.slow
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The README's picture is refreshed only on request (AIGW_UPDATE_SCREENSHOT=1), so a test run never
# leaves the checkout modified; otherwise the screenshot goes to pytest's temporary directory.
README_SCREENSHOT = Path(__file__).resolve().parents[3] / "docs" / "dashboard.png"
UI_TIMEOUT_MS = 30_000


def _chromium() -> str:
    if not Path(CHROMIUM).exists():
        script = Path(__file__).resolve().parents[3] / "scripts" / "ensure-chromium.sh"
        subprocess.run(["bash", str(script)], check=False, timeout=600, capture_output=True)
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing and scripts/ensure-chromium.sh could not install it")
    return CHROMIUM


def _traffic(served: Served) -> None:
    headers = {"authorization": f"Bearer {USER_KEY}"}
    shared = "You are a terse assistant for the acme project. Answer in one word. " * 4
    for index, stream in enumerate((False, True, False)):
        body = {"model": served.model, "max_tokens": 5, "stream": stream,
                "messages": [{"role": "system", "content": shared},
                             {"role": "user", "content": f"Question {index}: pick a colour."}]}
        response = httpx.post(served.url + "/v1/chat/completions", json=body, headers=headers,
                              timeout=120)
        assert response.status_code == 200, response.text


def test_dashboard_shows_replica_usage_and_trace_waterfall(served: Served, tmp_path: Path) -> None:
    update_readme = os.environ.get("AIGW_UPDATE_SCREENSHOT") == "1"
    screenshot = README_SCREENSHOT if update_readme else tmp_path / "dashboard.png"
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    executable = _chromium()
    _traffic(served)
    replica = served.replica_url.split("://")[1]
    with tempfile.TemporaryDirectory() as profile, sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=executable, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 1500})
        try:
            page = context.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.goto(served.url + "/dashboard")
            page.wait_for_selector("#login-form")
            assert page.is_hidden("#main")  # nothing shown without a key
            page.fill("#key", USER_KEY)  # a key without the admin scope is refused
            page.click("#login-form button")
            page.wait_for_selector("#login-error:not([hidden])")
            # the page says how to get a key it takes (the first key is not one)
            assert ("aigw keys create --project default --scope ai_gateway:admin"
                    in page.inner_text("#login"))
            page.fill("#key", ADMIN_KEY)
            page.click("#login-form button")
            page.wait_for_selector(f"#replicas tr[data-replica='{replica}'] .badge.ok")
            page.wait_for_selector(f"#usage tr[data-project='{PROJECT}']")
            page.wait_for_selector("#waterfall .wf-bar.replica")
            page.wait_for_selector("#chart-tokens .uplot")
            names = page.locator("#waterfall .wf-name").all_inner_texts()
            assert any(name.startswith("POST /v1/chat/completions") for name in names), names
            assert any(name.startswith("gateway.route") for name in names), names
            assert any(name.startswith("engine.decode") for name in names), names
            caption = page.inner_text("#tracing")  # which requests get a trace
            assert "every new request up to 100 a second" in caption, caption
            usage_row = page.inner_text(f"#usage tr[data-project='{PROJECT}']")
            assert usage_row.split()[1] != "0"  # requests counted
            page.locator("#waterfall .wf-row").first.click()
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            context.close()
    assert screenshot.stat().st_size > 10_000
