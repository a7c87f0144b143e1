"""Admission: from an HTTP request to an admitted `CanonicalRequest`, or a refusal.

    request ids        the client's x-request-id (if safe to echo) or a fresh one; the usage
                       record's id, unique per gateway request
    Admitter.authorize the credential (before the body: a bad body without a credential is a
                       401) -> the invoke scope -> the body under its cap -> the dialect's parse
                       -> the model exists and the key may call it
    Admitter.admit     that, then the tenant's cache salt, session, retention and service tier,
                       the reserve of output tokens (a max_tokens over the context length is a
                       400), the prompt's tokens as the meter counts them, and `meter.admit`

Raises AuthError, GatewayError or RateLimited: the pipeline answers each in the dialect's
envelope, and nothing refused here is ever metered. The request's observer is told the
authentication and the admission (gateway/request/observer.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from auth.cache_salt import cache_salt_for
from auth.principal import Authenticator, AuthError, Principal, Scope
from auth.settings import AuthSettings
from gateway.dialects.base import Dialect
from gateway.fleet.endpoints import Fleet, ModelRoute
from gateway.metering.contract import Admission, Meter, MeterBacklogged, ReservationTooLarge
from gateway.request.canonical import CanonicalRequest, estimate_prompt_tokens
from gateway.request.errors import BadRequest, GatewayError, ModelNotFound, PayloadTooLarge
from gateway.request.fallback import FallbackChains
from gateway.request.keeper import AnswerKeeper
from gateway.request.observer import RequestObserver
from gateway.request.retention import RetentionPolicy, RetentionSettings
from gateway.request.usage_tags import TAGS_HEADER, usage_session, usage_tags
from gateway.request_logs import RequestLog
from gateway.request_logs.capture import keep_body
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.web.credentials import (
    credential_of,  # one rule for every route: Bearer, else x-api-key
)
from infra.json_body import BodyError, read_json

log = logging.getLogger("aigw.gateway")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_ID_PREFIX = os.urandom(8).hex()  # per process: ids stay unique across workers and restarts
_id_counter = itertools.count()
_time_ns = time.time_ns


def _client_request_id(request: web.Request) -> str | None:
    """The client's x-request-id if it is safe to echo."""
    given = request.headers.get("x-request-id")
    return given if given and _REQUEST_ID.match(given) else None


def _fresh_id() -> str:
    return f"{_ID_PREFIX}{next(_id_counter):08x}"  # (no syscall per id)


def new_request_id() -> str:
    """A fresh gateway request id (for an answer made before any request object exists)."""
    return _fresh_id()


def request_id_of(request: web.Request) -> str:
    """The client's x-request-id if it is safe to echo, else a fresh one."""
    return _client_request_id(request) or _fresh_id()


def request_ids_of(request: web.Request) -> tuple[str, str]:
    """(request id, usage record id). The record id is unique per gateway request: the meters
    settle once per record id, so a client-chosen x-request-id (which clients reuse, e.g. one per
    trace or a constant) gets a fresh suffix; '/' is outside the client ids' alphabet, so no
    client id can name another request's record."""
    given = request.headers.get("x-request-id")  # (_client_request_id's rule, inline)
    fresh = f"{_ID_PREFIX}{next(_id_counter):08x}"  # (_fresh_id's)
    if given and _REQUEST_ID.match(given):
        return given, f"{given}/{fresh}"
    return fresh, fresh


async def read_json_body(request: web.Request, max_body_bytes: int,
                         timeout_s: float | None = None) -> Any:
    """The request's JSON body; 413 over the cap, 408 when it does not arrive within
    `timeout_s`, 415 for a Content-Encoding not decoded here, 400 if it is not JSON
    (infra/json_body.py)."""
    try:
        return await read_json(request, max_body_bytes, timeout_s)
    except BodyError as exc:
        if exc.status == 413:
            raise PayloadTooLarge(exc.message) from exc
        if exc.status == 408:
            raise GatewayError(exc.message, status=408, code="request_timeout") from exc
        if exc.status == 415:
            raise GatewayError(exc.message, status=415, code="unsupported_media_type") from exc
        raise BadRequest(exc.message) from exc


CacheSaltOf = Callable[[Principal], "str | None"]


def default_cache_salt_of(principal: Principal) -> str | None:
    """auth's rule with its default scope: one prompt cache per project."""
    return cache_salt_for(principal, _DEFAULT_AUTH_SETTINGS)


_DEFAULT_AUTH_SETTINGS = AuthSettings()


class Admitter:
    """The admission step of one pipeline (module docstring)."""

    def __init__(self, settings: GatewaySettings, authenticator: Authenticator, meter: Meter,
                 router: Router, fleet: Fleet, chains: FallbackChains,
                 cache_salt_of: CacheSaltOf) -> None:
        self.settings = settings
        self.authenticator = authenticator
        self.meter = meter
        self.router = router
        self.fleet = fleet
        self._chains = chains
        self.cache_salt_of = cache_salt_of
        self._counts_tokens = getattr(meter, "counts_tokens", None)
        self.request_log: RequestLog | None = None  # set by the served app: keep sampled bodies
        self.retention = RetentionPolicy(RetentionSettings(
            settings.max_cache_retention_s, settings.session_cache_retention_s,
            settings.cache_retention_max_sessions))

    async def authorize(self, request: web.Request, parse: Callable[[Any, str], CanonicalRequest],
                        request_id: str, observer: RequestObserver
                        ) -> tuple[CanonicalRequest, Principal, ModelRoute]:
        """The checks every model route makes first: the credential (before the body), the invoke
        scope, the body cap, `parse` (the dialect's validation), the model exists and the key may
        call it. Raises AuthError or GatewayError."""
        started_ns = _time_ns()
        try:
            principal = await self.authenticator.authenticate(credential_of(request))
        except AuthError as exc:
            observer.on_authenticated(started_ns, None, exc.code)
            raise
        observer.on_authenticated(started_ns, principal, None)
        principal.require(Scope.INVOKE)
        body = await read_json_body(request, self.settings.max_body_bytes,
                                    self.settings.client_body_timeout_s)
        request_log = self.request_log
        is_logged = request_log is not None and request_log.sample(principal.project)
        if is_logged:
            keep_body(request, body)  # (sampled: the log keeps the body as the client sent it)
        canonical = parse(body, request_id)
        canonical.observer = observer
        canonical.is_logged = is_logged
        if TAGS_HEADER in request.headers or (isinstance(body, dict) and "metadata" in body):
            canonical.tags = usage_tags(body, request.headers)  # bounded: 400 past them
        principal.require_model(canonical.model)
        route = self.fleet.get(canonical.model)
        if route is None:
            raise ModelNotFound.named(canonical.model)
        return canonical, principal, route

    async def admit(self, request: web.Request, dialect: Dialect, request_id: str, usage_id: str,
                    keeper: AnswerKeeper | None, observer: RequestObserver
                    ) -> tuple[CanonicalRequest, Principal, ModelRoute, Admission]:
        canonical, principal, route = await self.authorize(request, dialect.parse, request_id,
                                                           observer)
        canonical.project = principal.project
        canonical.allowed_models = principal.allowed_models
        canonical.cache_salt = self.cache_salt_of(principal)
        canonical.session_id = request.headers.get("x-session-id")
        if keeper is not None:  # e.g. a stored conversation before the input (previous_response_id)
            await keeper.prepare(canonical, principal)
        if canonical.prompt_cache_key is not None or canonical.session_id is not None:
            canonical.usage_session = usage_session(canonical)  # (else none: no call)
        canonical.kv_retention = self.retention.decide(canonical)
        canonical.service_tier = canonical.service_tier or self.settings.project_service_tiers.get(
            principal.project, self.settings.default_service_tier)
        max_tokens = canonical.max_tokens  # per choice; 0 (echo scoring a prompt) reserves none
        if max_tokens is None:
            max_tokens = self.settings.default_max_tokens
        context_length = route.context_length
        if context_length is not None and max_tokens > context_length:
            context_length = self._chains.context_length(route)  # a fallback's may be longer
        if context_length is not None and max_tokens > context_length:
            if canonical.max_tokens is not None:  # as the replica would refuse it, unadmitted
                raise BadRequest(
                    f"max_tokens ({max_tokens}) is over this model's context length of "
                    f"{context_length} tokens", param="max_tokens", code="context_length_exceeded")
            max_tokens = context_length  # the default reserve, on a small model
        num_prompt_tokens = await self._admission_prompt_tokens(canonical, route, principal)
        canonical.admitted_tokens = (num_prompt_tokens, canonical.num_choices * max_tokens)
        if canonical.rendered_prompt is not None:  # admission prices the cache: the expected hit
            num_prompt_tokens -= await self._expected_cached_tokens(canonical, route)
        observer.on_admitting(canonical.model, principal.project)
        try:
            admission = await self.meter.admit(usage_id, principal, canonical.model,
                                               num_prompt_tokens,
                                               canonical.num_choices * max_tokens)
        except ReservationTooLarge as exc:
            raise BadRequest(exc.message, param="max_tokens") from exc
        except MeterBacklogged as exc:  # back-pressure: the usage ledger cannot keep up
            raise GatewayError(exc.message, status=503, code="metering_backlogged") from exc
        observer.on_admitted()
        return canonical, principal, route, admission

    async def _expected_cached_tokens(self, canonical: CanonicalRequest, route: ModelRoute) -> int:
        """The rendered prompt's tokens the prefix index expects the routed replica to hold: a
        token limit reserves only the uncached rest (settle charges the real figures), so agent
        turns that hit most of their prompt are not throttled as if they recomputed it."""
        try:
            return await self.router.expected_cached_tokens(canonical, route.endpoints)
        except Exception:  # noqa: BLE001 - an index outage: reserve the whole prompt
            log.debug("no cache estimate for %s", canonical.request_id, exc_info=True)
            return 0

    async def _admission_prompt_tokens(self, canonical: CanonicalRequest, route: ModelRoute,
                                       principal: Principal) -> int:
        """The prompt's tokens as admission counts them: exactly (the rendered prompt, chat
        template framing included, kept on the request for the prefix router to hash) when a
        token limit or budget applies and the backend renders like its upstream; with another
        upstream's configured tokenizer, its text tokens plus framing (at least the estimate);
        else the estimate. An estimate without the template's framing let 8 clients on two gateways
        pass a 3,000 tokens-a-minute limit by 135: admission saw each prompt ~20 tokens short."""
        render = getattr(route.backend, "render_prompt", None)
        counts_tokens = self._counts_tokens
        estimate = estimate_prompt_tokens(canonical)
        if (not route.endpoints or counts_tokens is None or not counts_tokens(principal)):
            return estimate
        if render is None or canonical.num_prompts != 1 or canonical.kind == "embedding":
            if not route.settings.tokenizer:
                return estimate
            try:  # another upstream, with its tokenizer: text tokens + framing, at least the
                # estimate (its template is unknown here)
                counted = await asyncio.to_thread(route.backend.count_prompt_tokens, canonical,
                                                  route.endpoints[0])
            except Exception:  # noqa: BLE001 - the estimate stands
                return estimate
            return max(counted, estimate)
        try:  # (in a worker thread: the first call loads the tokenizer, a long prompt encodes)
            canonical.rendered_prompt = await asyncio.to_thread(render, canonical,
                                                                route.endpoints[0])
        except Exception:  # noqa: BLE001 - the upstream refuses it itself, in its own words
            log.debug("cannot render %s for admission", canonical.request_id, exc_info=True)
            return estimate
        assert canonical.rendered_prompt is not None  # render returns (text, ids)
        return len(canonical.rendered_prompt[1])
