"""Request metrics are labelled with the configured model and the caller's project from admission
on, so an operator sees whose requests a limit refuses; before it (failed auth, a bad body, an
unknown model) they stay "", so free client text never becomes a label value."""

from __future__ import annotations

import uuid

import httpx

from gateway.fleet.embedded import replica_environ
from tests.gateway.conftest import MODEL, GatewayFactory
from tests.gateway.test_auth_seam import KeyAuthenticator, RecordingMeter

CHAT = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
METRICS_TOKEN = "prometheus-scrape-token"  # per-project series need it (or an admin key)


def _requests_total(url: str) -> dict[tuple[str, str, str], float]:
    """(status, model, project) -> count of aigw_requests_total on /v1/chat/completions."""
    counts = {}
    scraped = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
    for line in scraped.text.splitlines():
        if line.startswith("aigw_requests_total{") and 'route="/v1/chat/completions"' in line:
            labels, value = line.rsplit(" ", 1)
            pairs = dict(p.split("=", 1) for p in labels[len("aigw_requests_total{"):-1].split(","))
            key = tuple(pairs[k].strip('"') for k in ("status", "model", "project"))
            counts[key] = float(value)
    return counts


def test_a_rate_limited_request_is_counted_under_its_model_and_project(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter(limited=True),
                           metrics_token=METRICS_TOKEN)
    response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                          headers={"authorization": "Bearer good"})
    assert response.status_code == 429
    assert _requests_total(gateway.url) == {("429", MODEL, "proj"): 1.0}


def test_requests_refused_before_admission_add_no_label_values(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter(),
                           metrics_token=METRICS_TOKEN)
    for _ in range(3):  # a different unknown model name each time
        response = httpx.post(gateway.url + "/v1/chat/completions",
                              json={**CHAT, "model": f"nope-{uuid.uuid4().hex}"},
                              headers={"authorization": "Bearer good"})
        assert response.status_code == 404
    response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 401
    assert _requests_total(gateway.url) == {("404", "", ""): 3.0, ("401", "", ""): 1.0}


def test_embedded_replicas_are_named_apart_from_the_gateway_in_traces() -> None:
    env = replica_environ({"OTEL_SERVICE_NAME": "shop-gw", "PATH": "/bin"})
    assert env == {"OTEL_SERVICE_NAME": "shop-gw-replica", "PATH": "/bin"}
    assert "OTEL_SERVICE_NAME" not in replica_environ({"PATH": "/bin"})  # the replica's default


def test_embedded_replicas_do_not_write_into_the_gateway_workers_metrics_directory() -> None:
    env = replica_environ({"PROMETHEUS_MULTIPROC_DIR": "/tmp/aigw-metrics-x", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}


def test_dashboard_files_are_counted_with_the_status_they_were_sent_with(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway()
    found = httpx.get(gateway.url + "/dashboard/static/app.js")
    assert found.status_code == 200
    unchanged = httpx.get(gateway.url + "/dashboard/static/app.js",
                          headers={"if-modified-since": found.headers["last-modified"]})
    assert unchanged.status_code == 304
    assert httpx.get(gateway.url + "/dashboard/static/missing.js").status_code == 404
    counted = {}
    for line in httpx.get(gateway.url + "/metrics").text.splitlines():
        if line.startswith("aigw_requests_total{") and "/dashboard/static" in line:
            status = line.split('status="', 1)[1].split('"', 1)[0]
            counted[status] = float(line.rsplit(" ", 1)[1])
    assert counted == {"200": 1.0, "304": 1.0, "404": 1.0}


def test_per_project_series_need_the_metrics_token_or_an_admin_key(
        make_gateway: GatewayFactory) -> None:
    """/metrics without a credential listed every project's name and token counters; now it
    gets the same families summed over projects, and the full view needs a credential."""
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter(),
                           metrics_token=METRICS_TOKEN)
    for _ in range(2):
        assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                          headers={"authorization": "Bearer good"}).status_code == 200
    anonymous = httpx.get(gateway.url + "/metrics")
    assert anonymous.status_code == 200
    assert "project=" not in anonymous.text
    summed = [line for line in anonymous.text.splitlines()
              if line.startswith("aigw_requests_total{") and "/v1/chat/completions" in line]
    assert summed == ['aigw_requests_total{model="mock-model",route="/v1/chat/completions",'
                      'status="200"} 2.0']
    assert any(line.startswith("aigw_prompt_cache_hit_ratio ")
               for line in anonymous.text.splitlines())
    full = httpx.get(gateway.url + "/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
    assert 'project="proj"' in full.text
    assert _requests_total(gateway.url) == {("200", MODEL, "proj"): 2.0}
    assert httpx.get(gateway.url + "/metrics",
                     headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(gateway.url + "/metrics",  # an invoke key is no operator
                     headers={"authorization": "Bearer good"}).status_code == 403
    public = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter(),
                          metrics_public=True)
    httpx.post(public.url + "/v1/chat/completions", json=CHAT,
               headers={"authorization": "Bearer good"})
    assert 'project="proj"' in httpx.get(public.url + "/metrics").text
