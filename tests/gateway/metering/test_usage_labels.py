# ruff: noqa: F811 - `served` is the fixture of test_runtime_limits, taken as a parameter
"""Usage by key, hour, tag and session on a served gateway (embedded store, the mock upstream):
tags from `x-aigw-tags` and OpenAI `metadata`, bounded (400 past the bounds, nothing metered);
the session from prompt_cache_key / x-session-id; JSON and CSV export; the per-request cost in
`x-aigw-cost-usd` (non-streaming) or the stream's comment line, equal to what the ledger counts."""

from __future__ import annotations

import csv
import io

import httpx
import openai

from tests.gateway.conftest import MODEL
from tests.gateway.metering.test_runtime_limits import Served, _project, served  # noqa: F401 - the fixture


def _usage(served: Served, project: str, **query: str) -> httpx.Response:
    return httpx.get(served.url + f"/admin/v1/projects/{project}/usage", params=query,
                     headers=served.admin)


def _send(served: Served, key: str, headers: dict[str, str] | None = None,
          **body: object) -> httpx.Response:
    return httpx.post(served.url + "/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": MODEL, "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hi"}], **body})


def test_usage_by_tag_and_session_sums_to_the_ledger_and_exports_as_csv(served: Served) -> None:
    key = _project(served, "tagged")
    sent = [({"x-aigw-tags": "team:search"}, {}), ({"x-aigw-tags": "team:ads ,,"}, {}),
            ({}, {"metadata": {"team": "search"}}), ({}, {"prompt_cache_key": "conv-1"}),
            ({"x-session-id": "conv-2"}, {})]
    for headers, body in sent:
        response = _send(served, key, headers, **body)
        assert response.status_code == 200, response.text
    ledger = _usage(served, "tagged", group_by="").json()["data"]
    assert len(ledger) == 1 and ledger[0]["requests"] == 5
    by_tag = _usage(served, "tagged", group_by="tag").json()["data"]
    assert {row["tag"]: row["requests"] for row in by_tag} == {
        None: 2, "team:ads": 1, "team:search": 2}
    for metric in ("requests", "prompt_tokens", "completion_tokens", "cost_usd"):
        assert abs(sum(row[metric] for row in by_tag) - ledger[0][metric]) < 1e-9, metric
    by_session = _usage(served, "tagged", group_by="session").json()["data"]
    assert {row["session_id"]: row["requests"] for row in by_session} == {
        None: 3, "conv-1": 1, "conv-2": 1}
    only_search = _usage(served, "tagged", group_by="key,hour", tag="team:search").json()["data"]
    assert len(only_search) == 1 and only_search[0]["requests"] == 2
    assert only_search[0]["key_id"] and len(only_search[0]["hour"]) == 13
    exported = _usage(served, "tagged", group_by="day,tag", format="csv")
    assert exported.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(exported.text)))
    assert list(rows[0]) == ["day", "model", "tag", "requests", "prompt_tokens", "cached_tokens",
                             "completion_tokens", "total_tokens", "cost_usd"]
    assert sum(int(r["requests"]) for r in rows) == 5
    formula = "=cmd|' /C calc'!A0"
    assert _send(served, key, {"x-aigw-tags": f"{formula}"}).status_code == 200
    exported = _usage(served, "tagged", group_by="tag", format="csv").text
    cells = [r["tag"] for r in csv.DictReader(io.StringIO(exported))]
    assert "'" + formula in cells and formula not in cells  # a spreadsheet shows it as text
    assert _usage(served, "tagged", group_by="colour").status_code == 400


def test_tags_past_their_bounds_are_a_400_and_nothing_is_metered(served: Served) -> None:
    key = _project(served, "bounded")
    too_many = ",".join(f"t{i}" for i in range(17))
    for headers, body in (({"x-aigw-tags": too_many}, {}), ({"x-aigw-tags": "x" * 257}, {}),
                          ({}, {"metadata": {"k": "v" * 300}}), ({}, {"metadata": {"k": 1}}),
                          ({}, {"metadata": "team"}), ({}, {"prompt_cache_key": "s" * 257}),
                          ({}, {"metadata": {"k": "a\x01b"}})):
        response = _send(served, key, headers, **body)
        assert response.status_code == 400, (headers, body, response.text)
        error = response.json()["error"]
        assert error["code"] in ("invalid_tags", "invalid_session") and error["message"]
    sixteen = ",".join(f"t{i}" for i in range(16))
    assert _send(served, key, {"x-aigw-tags": sixteen}).status_code == 200
    assert _usage(served, "bounded", group_by="").json()["data"][0]["requests"] == 1


def test_the_cost_header_and_stream_comment_equal_what_the_ledger_counts(served: Served) -> None:
    key = _project(served, "costed")
    plain = _send(served, key)
    assert "x-aigw-cost-usd" not in plain.headers  # only when asked
    asked = _send(served, key, {"x-aigw-cost": "1"})
    cost = float(asked.headers["x-aigw-cost-usd"])
    usage = asked.json()["usage"]
    assert abs(cost - 0.001 * (usage["prompt_tokens"] + usage["completion_tokens"])) < 1e-9
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {key}", "x-aigw-cost": "1"}) as streamed:
        lines = [line for line in streamed.iter_lines() if line]
    assert "x-aigw-cost-usd" not in streamed.headers
    comment = [line for line in lines if line.startswith(": x-aigw-cost-usd=")]
    assert len(comment) == 1 and lines[-1] == "data: [DONE]"
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=key,
                           default_headers={"x-aigw-cost": "1"})
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=3, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].usage is not None  # the SDK reads past the comment
    ledger = _usage(served, "costed", group_by="").json()["data"][0]
    streamed_cost = float(comment[0].split("=", 1)[1])
    assert ledger["requests"] == 4
    assert streamed_cost > 0 and ledger["cost_usd"] >= cost + streamed_cost - 1e-9
