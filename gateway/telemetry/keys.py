"""Typed app state for telemetry."""

from __future__ import annotations

from aiohttp import web

from gateway.telemetry.telemetry import Telemetry

TELEMETRY = web.AppKey("telemetry", Telemetry)
