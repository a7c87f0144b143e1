"""The dashboard's writes in a real headless Chromium (Playwright), on a served gateway (auth on,
embedded store, the mock upstream): an admin creates a project and a key (its secret shown
once), the key works, a limit set in the page holds on the next requests, usage by tag shows the
request's tag, rotate shows a new secret and revoke refuses the key. A page of another origin
cannot write through the admin API (no cookie to ride on, and cross-site writes are refused).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from auth import AuthSettings
from bench.mock_upstream import MockState, create_mock_app
from gateway.settings import GatewaySettings
from gateway.web.services import create_served_app
from tests.auth._admin_key import make_admin_key
from tests.gateway.conftest import MODEL, LoopThread, start_app
from tests.gateway.dashboard.test_dashboard_browser import CHROMIUM_ARGS, UI_TIMEOUT_MS, _chromium

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """(gateway URL, admin key, another origin's URL)."""
    loop_thread = LoopThread()
    data_dir = tmp_path_factory.mktemp("dashboard-admin")
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(MockState())))
    settings = GatewaySettings(data_dir=data_dir, models=[{
        "name": MODEL, "backend": "replica", "endpoints": [upstream_url],
        "prices": {"input_per_token": 1e-6, "output_per_token": 2e-6}}])
    runner, url = loop_thread.run(start_app(loop_thread.run(create_served_app(settings))))
    try:
        yield url, loop_thread.run(make_admin_key(
            AuthSettings(data_dir=data_dir, enabled=False))), upstream_url
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())
        loop_thread.close()


def _chat(url: str, key: str, tags: str = "") -> int:
    headers = {"authorization": f"Bearer {key}", **({"x-aigw-tags": tags} if tags else {})}
    return httpx.post(url + "/v1/chat/completions", headers=headers, timeout=30, json={
        "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        ).status_code


def test_an_admin_creates_a_key_sets_a_limit_and_browses_usage_by_tag(
        gateway: tuple[str, str, str], tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    executable = _chromium()
    url, admin_key, other_origin = gateway
    with tempfile.TemporaryDirectory() as profile, sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=executable, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 1600})
        try:
            page = context.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.on("dialog", lambda dialog: dialog.accept())
            page.goto(url + "/dashboard")
            page.fill("#key", admin_key)
            page.click("#login-form button")
            page.wait_for_selector("#admin-project option[value='ops']", state="attached")

            page.fill("#admin-project-name", "webco")
            page.click("#admin-new-project button")
            page.wait_for_function("document.getElementById('admin-project').value === 'webco'")
            page.fill("#admin-key-name", "browser")
            page.click("#admin-new-key button")
            page.wait_for_selector("#admin-secret:not([hidden])")
            secret = page.inner_text("#admin-secret-value").strip()
            assert secret.startswith("sk-aigw-")
            assert _chat(url, secret, tags="team:web") == 200
            row = page.locator("#admin-keys tbody tr", has_text="browser")
            key_id = row.get_attribute("data-key")
            assert key_id and key_id in secret

            row.locator("button[data-act=limits]").click()
            page.wait_for_function(
                f"document.getElementById('admin-limits-scope').textContent === 'key {key_id}'")
            page.fill("#lim-rpm", "1")
            page.fill("#lim-month", "5")
            page.click("#admin-limits-form button[type=submit]")
            page.wait_for_selector("#admin-msg:has-text('saved')")
            limits = httpx.get(url + f"/admin/v1/keys/{key_id}/limits",
                               headers={"authorization": f"Bearer {admin_key}"}).json()
            assert limits["stored"]["requests_per_minute"] == 1
            assert limits["stored"]["budgets"] == [{"usd": 5.0, "window": "month",
                                                    "window_s": None, "starts_at": 0.0,
                                                    "alert_at": []}]
            assert [_chat(url, secret), _chat(url, secret)] == [200, 429]

            page.select_option("#admin-usage-by", "tag")
            page.wait_for_selector("#admin-usage tr[data-group='team:web']")
            assert page.inner_text("#admin-usage tr[data-group='team:web']").split()[1] == "1"
            page.screenshot(path=str(tmp_path / "dashboard-admin.png"), full_page=True)

            page.locator("#admin-keys tbody tr", has_text="browser").locator(
                "button[data-act=rotate]").click()
            page.wait_for_function(
                f"document.getElementById('admin-secret-value').textContent !== {secret!r}")
            rotated = page.inner_text("#admin-secret-value").strip()
            assert rotated.startswith(f"sk-aigw-{key_id}-") and rotated != secret
            page.click("#admin-secret-hide")
            page.locator("#admin-keys tbody tr", has_text="browser").locator(
                "button[data-act=revoke]").click()
            page.wait_for_selector(f"#admin-keys tr[data-key='{key_id}'] .badge.bad")
            assert _chat(url, rotated) == 401

            attacker = context.new_page()  # another origin (the upstream's port) tries to write
            attacker.goto(other_origin + "/health")
            attacker.evaluate("""async (target) => {
                for (const init of [
                    {method: "POST", body: '{"name": "forged"}',
                     headers: {"content-type": "text/plain"}},
                    {method: "POST", body: '{"name": "forged"}', mode: "no-cors",
                     credentials: "include"}]) {
                  try { await fetch(target + "/admin/v1/projects", init); } catch (e) {}
                }
            }""", url)
        finally:
            context.close()
    names = [p["name"] for p in httpx.get(url + "/admin/v1/projects", headers={
        "authorization": f"Bearer {admin_key}"}).json()["data"]]
    assert "webco" in names and "forged" not in names
