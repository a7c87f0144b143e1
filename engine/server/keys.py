"""Typed app and request state (web.AppKey / web.RequestKey): every shared object has a key."""

from __future__ import annotations

from aiohttp import web

from engine.server.serving import ServingContext

SERVING_KEY = web.AppKey("serving", ServingContext)
REQUEST_ID_KEY = web.RequestKey("request_id", str)
