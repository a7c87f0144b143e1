"""/metrics labels from projects are bounded: a trusted issuer's JWTs may name any number of
projects, and only the first `metrics_max_projects` keep their own label value."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import jwt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.mock_upstream import MockState, create_mock_app
from gateway.metering.contract import UsageRecord
from gateway.settings import GatewaySettings
from gateway.telemetry.metrics import OTHER_PROJECTS, GatewayMetrics
from gateway.web.services import create_served_app
from tests.gateway.conftest import MODEL, LoopThread, start_app

SECRET = "a-long-shared-hmac-secret-32-bytes!"


def _record(project: str, prompt_tokens: int) -> UsageRecord:
    return UsageRecord(request_id=f"{project}-{prompt_tokens}", project=project, key_id="k",
                       model="m", endpoint="e", prompt_tokens=prompt_tokens, cached_tokens=0,
                       completion_tokens=1, cost_usd=0.0, latency_ms=1.0, status=200,
                       created_at=0.0)


def _samples(text: str, family_name: str) -> dict[str, float]:
    return {sample.labels["project"]: sample.value
            for family in text_string_to_metric_families(text) if family.name == family_name
            for sample in family.samples if sample.name.endswith("_total")}


def test_projects_past_the_cap_are_counted_under_one_other_label() -> None:
    metrics = GatewayMetrics(max_projects=2)
    for i, project in enumerate(["a", "b", "c", "d", "a", "c"]):
        metrics.observe_usage(_record(project, 10 + i))
    tokens = _samples(metrics.render().decode(), "aigw_input_tokens")
    assert tokens == {"a": 10 + 14, "b": 11, OTHER_PROJECTS: 12 + 13 + 15}


def test_the_anonymous_view_keeps_a_counters_created_time_not_the_sum_of_its_projects() -> None:
    """Summing the project label away added the `_created` timestamps of every project's series
    (a date decades ahead); the summed series was created when its first project's was."""
    metrics = GatewayMetrics()
    for project in ("a", "b", "c"):
        metrics.observe_usage(_record(project, 10))

    def input_token_samples(per_project: bool) -> list[tuple[str, float]]:
        text = metrics.render(per_project=per_project).decode()
        return [(sample.name, sample.value) for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name.startswith("aigw_input_tokens_")]

    created = [value for name, value in input_token_samples(True)
               if name == "aigw_input_tokens_created"]
    assert len(created) == 3
    assert dict(input_token_samples(False)) == {"aigw_input_tokens_total": 30.0,
                                                "aigw_input_tokens_created": min(created)}


def test_jwt_projects_of_a_trusted_issuer_do_not_grow_the_metrics_labels(
        loop_thread: LoopThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_JWT_HS256_SECRET", SECRET)
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(MockState())))
    settings = GatewaySettings(
        data_dir=tmp_path, metrics_public=True, metrics_max_projects=2,
        models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url]}])
    runner, url = loop_thread.run(start_app(loop_thread.run(create_served_app(settings))))
    try:
        now = int(time.time())
        for i in range(6):
            token = jwt.encode({"sub": f"svc-{i}", "project": f"tenant-{i}", "iat": now,
                                "exp": now + 300, "scope": "ai_gateway:invoke"}, SECRET,
                               algorithm="HS256")
            answer = httpx.post(url + "/v1/chat/completions", headers={
                "authorization": f"Bearer {token}"}, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200, answer.text
        text = httpx.get(url + "/metrics").text
        admin = jwt.encode({"sub": "ops", "project": "ops", "iat": now, "exp": now + 300,
                            "scope": "ai_gateway:admin"}, SECRET, algorithm="HS256")
        overview = httpx.get(url + "/dashboard/api/overview",
                             headers={"authorization": f"Bearer {admin}"}).json()
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())
    requests = _samples(text, "aigw_requests")
    assert {p for p in requests if p} == {"tenant-0", "tenant-1", OTHER_PROJECTS}
    assert requests[OTHER_PROJECTS] == 4
    assert set(_samples(text, "aigw_input_tokens")) == {"tenant-0", "tenant-1", OTHER_PROJECTS}
    # the dashboard's usage series were one per project ever seen, kept for the process's life
    series = overview["usage"]["projects"]
    assert set(series) == {"tenant-0", "tenant-1", OTHER_PROJECTS}, list(series)
    assert sum(series[OTHER_PROJECTS]["series"]["requests"]) == 4
