"""Refusing cross-site writes to the admin API (what makes the dashboard's writes CSRF-safe).

The admin API and the dashboard authenticate by an `Authorization: Bearer` header that the page
adds from sessionStorage; the gateway sets no cookie, so a browser never attaches a credential
on its own and a forged cross-site request arrives without one. As a second line, a write
(any method but GET/HEAD/OPTIONS) is refused with 403 when the browser says it comes from
another site: `Sec-Fetch-Site` other than same-origin/none, or an `Origin` whose host is not the
request's `Host`. Clients that are not browsers (the CLI, SDKs, curl) send neither header.
The gateway answers no CORS preflight, so no other origin can read an admin answer either.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_SAME_SITE_FETCH = frozenset({"same-origin", "none"})


def cross_site_write(request: web.Request) -> str | None:
    """Why this request is a cross-site write (the 403's message), or None when it is not."""
    if request.method in _SAFE_METHODS:
        return None
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site.lower() not in _SAME_SITE_FETCH:
        return f"a cross-site write is refused (Sec-Fetch-Site: {fetch_site[:32]})"
    origin = request.headers.get("Origin")
    if origin is not None:
        origin_host = urlsplit(origin).netloc.lower() if origin != "null" else "null"
        if origin_host != (request.host or "").lower():
            return "a cross-site write is refused (Origin is not this gateway)"
    return None
