"""Our engine replicas: OpenAI-compatible HTTP plus the request's `cache_salt`,
`continue_final_message` (Anthropic prefill), KV retention (`cache_retention_s` and
`cache_retention_id`: gateway/request/retention.py), the scheduling class (`priority`, vLLM's
int, from the request's service_tier), the prompt's token ids when the gateway
rendered it already (`prompt_token_ids` + `prompt_render_id`, chat/render.py: the replica does not
render it again) and /metrics load.

Every call carries the replica credential (`Endpoint.auth_headers`: GatewaySettings.replica_secret,
which the replicas check, engine/server/middlewares.py).

`cache_salt` (decided once per request by auth.cache_salt.cache_salt_for: per project by default)
keeps one tenant's prefix cache invisible to another (a timing side channel otherwise);
`ModelSettings.share_cache_across_projects = true` drops it for that model. Load is parsed from
the replica's Prometheus text defensively: any gauge whose name ends in one of the suffixes below.
"""

from __future__ import annotations

import math
import re
from typing import Any

from contracts.replica_protocol import SERVICE_TIER_PRIORITY, bounded_cache_salt
from gateway.backends.openai_compat import OpenAICompatBackend
from gateway.fleet.endpoints import Endpoint, EndpointLoad
from gateway.request.canonical import CanonicalRequest, estimate_prompt_tokens
from gateway.upstream.transport import PROBE_BODY_MAX_BYTES, UpstreamRequest

_LOAD_SUFFIXES = {
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_blocks_used": "num_kv_blocks_used",
    "kv_blocks_total": "num_kv_blocks_total",
}


class ReplicaBackend(OpenAICompatBackend):
    name = "replica"
    embedding_encoding = "base64"

    def upstream_body(self, request: CanonicalRequest, endpoint: Endpoint) -> dict[str, Any]:
        body = super().upstream_body(request, endpoint)
        if request.continue_final_message:
            body["continue_final_message"] = True  # vLLM's name for it: prefill
        retain_s, retention_id = request.kv_retention
        if retain_s > 0:  # KV retention (contracts/replica_protocol.py)
            body["cache_retention_s"] = retain_s
            if retention_id is not None:
                body["cache_retention_id"] = retention_id
        priority = SERVICE_TIER_PRIORITY.get(request.service_tier or "default", 0)
        if priority:  # the engine schedules higher classes first (engine/scheduler.py)
            body["priority"] = priority
        rendered = request.rendered_prompt
        if rendered is not None and request.kind == "chat":
            from gateway.routing.prefix_router import tokenizer_path
            from gateway.routing.prompt_hashing import shared_prompt_hasher

            path = tokenizer_path(endpoint)
            if rendered[0] == path:  # rendered here already (admission or routing): send the ids
                hasher = shared_prompt_hasher(path, self.settings.prompt_segment_cache_max_bytes)
                body["prompt_token_ids"] = rendered[1]
                body["prompt_render_id"] = hasher.renderer.render_id
        return body

    def upstream_cache_salt(self, request: CanonicalRequest, endpoint: Endpoint) -> str | None:
        """Our replicas get the tenant's salt as it is (the prefix router hashes blocks with it,
        as the replica does), or its digest when it is over the replica's MAX_CACHE_SALT_BYTES
        (a JWT's long `sub` in a per-key salt), unless the model shares its cache across
        projects."""
        if not request.cache_salt or endpoint.model.share_cache_across_projects:
            return None
        return bounded_cache_salt(request.cache_salt)

    def render_prompt(self, request: CanonicalRequest, endpoint: Endpoint
                      ) -> tuple[str, list[int]]:
        """(tokenizer path, the prompt's token ids) exactly as the replica will compute them
        (CPU-bound: off the event loop for long prompts); raises what count_prompt_tokens does."""
        from gateway.routing.prefix_router import tokenizer_path
        from gateway.routing.prompt_hashing import shared_prompt_hasher

        path = tokenizer_path(endpoint)
        hasher = shared_prompt_hasher(path, self.settings.prompt_segment_cache_max_bytes)
        return path, hasher.token_ids(self.upstream_body(request, endpoint),
                                      endpoint.context_length)

    def count_prompt_tokens(self, request: CanonicalRequest, endpoint: Endpoint) -> int:
        """Exactly the replica's count: the body it would be sent, rendered by the replica's own
        code (chat template, tools) and encoded with its tokenizer, found the way the prefix
        router finds it (gateway/routing/prompt_hashing.py, prefix_router.tokenizer_path)."""
        from gateway.routing.prefix_router import tokenizer_path
        from gateway.routing.prompt_hashing import shared_prompt_hasher

        if request.kind == "embedding":  # an encoder's tokenizer, not the chat model's
            return estimate_prompt_tokens(request)
        body = self.upstream_body(request, endpoint)
        hasher = shared_prompt_hasher(tokenizer_path(endpoint),
                                      self.settings.prompt_segment_cache_max_bytes)
        return len(hasher.token_ids(body, endpoint.context_length))

    async def health(self, endpoint: Endpoint) -> bool:
        return await self._get_status(endpoint, "/health") == 200

    async def load(self, endpoint: Endpoint) -> EndpointLoad | None:
        try:
            response = await self.transport.send(UpstreamRequest(
                "GET", endpoint.url + "/metrics", headers=dict(endpoint.auth_headers),
                connect_timeout_s=self.settings.health_timeout_s))
            try:
                text = (await response.read(PROBE_BODY_MAX_BYTES)).decode("utf-8", "replace")
                return parse_load(text) if response.status == 200 else None
            finally:
                response.close()
        except Exception:  # noqa: BLE001 - must not raise
            return None


_QUEUE_DELAY_SUFFIX = "predicted_queue_delay_ms"  # {service_tier}: the admission estimate
_PREFILL_COST_SUFFIX = "prefill_ms_per_token"
_TIER_LABEL = re.compile(r'service_tier="(priority|default|flex)"')


def parse_load(metrics_text: str) -> EndpointLoad | None:
    """Read load gauges from Prometheus text; unknown or malformed lines are skipped. The
    predicted queueing delay is kept per service_tier (the largest, if a tier repeats)."""
    values: dict[str, int] = {}
    delays: dict[str, float] = {}
    prefill_ms: float | None = None
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value_part = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        if name.endswith(_QUEUE_DELAY_SUFFIX) or name.endswith(_PREFILL_COST_SUFFIX):
            try:
                value = float(value_part)
            except ValueError:
                continue
            if not math.isfinite(value) or value < 0:
                continue
            if name.endswith(_PREFILL_COST_SUFFIX):
                prefill_ms = value
            elif tier := _TIER_LABEL.search(name_part):
                delays[tier.group(1)] = max(value, delays.get(tier.group(1), 0.0))
            continue
        for suffix, field in _LOAD_SUFFIXES.items():
            if name.endswith(suffix):
                try:
                    values[field] = values.get(field, 0) + int(float(value_part))
                except ValueError:
                    pass
    if not values and not delays:
        return None
    return EndpointLoad(**values, predicted_queue_delay_ms=delays or None,
                        prefill_ms_per_token=prefill_ms)
