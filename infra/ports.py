"""Local ports: a free one to hand out, and whether a server could listen on a given one."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def cannot_listen(host: str, port: int) -> str | None:
    """Why binding `host:port` fails (a port in use, an address this machine lacks), or None.
    `aigw serve` and `aigw replica` check it before loading a model: the commonest first-run
    mistake, a second `make run` on 8000, was a bind traceback after the load. A plain bind,
    without SO_REUSEPORT, so that `--workers` cannot join another gateway's port group either.
    The sockets are made as asyncio's and uvloop's create_server make them: "" is every interface,
    a family this machine lacks is skipped, and an IPv6 socket is IPv6-only (else `--host ::` would
    collide with another program's IPv4 socket on the port, which the server does not)."""
    if port == 0:
        return None
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in addresses:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue
            with sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
