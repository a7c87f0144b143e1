"""The ceiling for a Python gateway: a bare aiohttp pass-through (no parsing, auth or metering).

    python -m bench.bare_proxy --port 9100 --upstream http://127.0.0.1:9001
"""

from __future__ import annotations

import argparse

from aiohttp import ClientSession, TCPConnector, web


def create_proxy(upstream: str) -> web.Application:
    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False)
        yield
        await app["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        async with request.app["session"].post(upstream + request.path, data=await request.read(),
                                               headers={"content-type": "application/json"}) as up:
            response = web.StreamResponse(status=up.status,
                                          headers={"content-type": up.content_type})
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/{tail:.*}", forward)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    try:  # the same event loop as `aigw serve` uses, for a fair ceiling
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(create_proxy(args.upstream), host="127.0.0.1", port=args.port, print=None,
                access_log=None)
