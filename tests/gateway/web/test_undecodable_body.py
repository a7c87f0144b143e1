"""A body its Content-Encoding does not describe: a 400 in the route's envelope, and the
connection is announced closed rather than dropped under the client's next request."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.gateway.conftest import MODEL, Gateway

BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/anthropic/v1/messages": {"model": MODEL, "max_tokens": 5,
                               "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("path", list(BODIES))
def test_a_body_that_is_not_its_content_encoding_is_a_400_and_the_next_request_still_works(
        gateway: Gateway, path: str, encoding: str) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10,
                      limits=httpx.Limits(max_connections=1)) as client:
        response = client.post(path, content=orjson.dumps(BODIES[path]),
                               headers={"content-type": "application/json",
                                        "content-encoding": encoding})
        assert response.status_code == 400, response.text
        body = response.json()
        error = body["error"]
        if "messages" in path:
            assert body["type"] == "error" and error["type"] == "invalid_request_error"
        else:
            assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error"
        assert encoding in error["message"]
        assert response.headers.get("connection", "").lower() == "close"
        follow_up = client.get("/v1/models")  # a new connection, not the half-read one
        assert follow_up.status_code == 200
    assert not gateway.upstreams[0].state.request_ids
    assert not gateway.meter.settled
