"""Typed application state: every shared object has one `web.AppKey`."""

from __future__ import annotations

from aiohttp import web

from auth.principal import Authenticator
from gateway.batch.service import BatchService
from gateway.dashboard.slo import SloRates
from gateway.fleet.discovery import Discovery
from gateway.fleet.endpoints import Fleet
from gateway.metering.contract import Meter
from gateway.request.pipeline import Pipeline
from gateway.responses_store import StoredResponses
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.upstream.transport import Transport

SETTINGS = web.AppKey("settings", GatewaySettings)
AUTHENTICATOR = web.AppKey("authenticator", Authenticator)
METER = web.AppKey("meter", Meter)
ROUTER = web.AppKey("router", Router)
TRANSPORT = web.AppKey("transport", Transport)
FLEET = web.AppKey("fleet", Fleet)
DISCOVERY = web.AppKey("discovery", Discovery)
PIPELINE = web.AppKey("pipeline", Pipeline)
BATCH = web.AppKey("batch", BatchService)
RESPONSES = web.AppKey("responses", StoredResponses)  # stored Responses API answers
SLO_RATES = web.AppKey("slo_rates", SloRates)  # the dashboard's goodput/refusal rates
