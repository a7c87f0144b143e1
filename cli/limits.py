"""`aigw limits get|set|delete|list`: the run-time limits and budgets of a project or a key.

The store is found as `aigw keys` finds it (cli/auth.py: AIGW_REDIS_URL, else SQLite under
AIGW_DATA_DIR, with AIGW_CONFIG's values); running gateways apply a change within a second.
`set` replaces the scope's whole record, from flags or from `--json` (the admin API's body):

    aigw limits set --project acme --rpm 600 --tpm 200000 --concurrency 16 \\
        --budget 50/day --budget 1000/month --alert-at 0.8 \\
        --webhook-url https://ops.example/hooks/aigw --webhook-secret "$SECRET"
    aigw limits set --key k_0123abcd --json '{"budgets": [{"usd": 5, "window": "custom",
        "window_s": 21600}]}'

A budget flag is USD/WINDOW with WINDOW `day`, `month` or a custom length in seconds (`3600s`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from cli.auth import _runner, key_id_arg

    limits = subparsers.add_parser("limits", help="run-time limits and budgets of a project or key")
    cmds = limits.add_subparsers(dest="limits_command", required=True)

    def scoped(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = cmds.add_parser(name, help=help_text)
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--project", help="the project's own limits (all its keys together)")
        which.add_argument("--key", dest="key_id", metavar="KEY_ID", type=key_id_arg,
                           help="one key's limits")
        return parser

    scoped("get", "print the stored and the effective limits (JSON)").set_defaults(
        func=_runner(_get))
    setter = scoped("set", "replace the stored limits of the scope")
    setter.add_argument("--rpm", type=int, dest="requests_per_minute", help="requests per minute")
    setter.add_argument("--tpm", type=int, dest="tokens_per_minute", help="tokens per minute")
    setter.add_argument("--concurrency", type=int, dest="max_concurrent_requests",
                        help="requests in flight at once")
    setter.add_argument("--budget", action="append", default=[], metavar="USD/WINDOW",
                        help="a USD budget: 50/day, 1000/month or 5/3600s (repeat)")
    setter.add_argument("--alert-at", action="append", type=float, default=[], metavar="FRACTION",
                        help="fire the webhook when a budget's spend reaches this fraction")
    setter.add_argument("--webhook-url", help="where alerts are POSTed")
    setter.add_argument("--webhook-secret", help="the HMAC-SHA256 key of the alerts' signature")
    setter.add_argument("--json", dest="json_body", metavar="BODY",
                        help="the whole record as the admin API takes it (instead of the flags)")
    setter.set_defaults(func=_runner(_set))
    scoped("delete", "drop the stored limits (the config file's apply again)").set_defaults(
        func=_runner(_delete))
    cmds.add_parser("list", help="every stored record (JSON lines)").set_defaults(
        func=_runner(_list))


def parse_budget(text: str, alert_at: list[float]) -> dict[str, Any]:
    """"50/day" -> {"usd": 50.0, "window": "day", ...}; ValueError on anything else."""
    usd, _, window = text.partition("/")
    budget: dict[str, Any] = {"usd": float(usd), "alert_at": alert_at}
    if window in ("day", "month"):
        budget["window"] = window
    elif window.endswith("s") and window[:-1].isdigit():
        budget.update(window="custom", window_s=int(window[:-1]))
    else:
        raise ValueError(f"--budget {text!r}: USD/WINDOW with day, month or <seconds>s")
    return budget


def _body(args: argparse.Namespace) -> dict[str, Any]:
    if args.json_body is not None:
        body = json.loads(args.json_body)
        if not isinstance(body, dict):
            raise ValueError("--json must be a JSON object")
        return body
    body = {name: getattr(args, name) for name in ("requests_per_minute", "tokens_per_minute",
                                                   "max_concurrent_requests", "webhook_url",
                                                   "webhook_secret")
            if getattr(args, name) is not None}
    if args.alert_at and not args.budget:
        raise ValueError("--alert-at needs a --budget")
    body["budgets"] = [parse_budget(text, args.alert_at) for text in args.budget]
    return body


async def _scope(services: Any, args: argparse.Namespace) -> Any:
    from auth.store import UnknownProject
    from gateway.metering.limit_store import LimitScope

    if args.key_id is not None:
        record = await services.admin.get_key(args.key_id)
        return LimitScope(record.project, key_id=record.key_id)
    if await services.store.get_project(args.project) is None:
        raise UnknownProject(args.project)
    return LimitScope(args.project)


async def _store(services: Any) -> Any:
    from gateway.metering.limit_store import open_limit_store

    return await open_limit_store(services.redis, services.settings.data_dir)


def _print_scope(scope: Any, stored: Any) -> None:
    print(json.dumps({"project": scope.project, "key_id": scope.key_id,
                      "stored": None if stored is None else stored.public_view()}))


async def _get(services: Any, args: argparse.Namespace) -> int:
    scope = await _scope(services, args)
    store = await _store(services)
    try:
        _print_scope(scope, (await store.load()).get(scope))
    finally:
        await store.close()
    return 0


async def _set(services: Any, args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from gateway.web.limit_routes import parse_limits, validation_message

    scope = await _scope(services, args)
    try:
        limits = parse_limits(_body(args))
    except ValidationError as exc:
        raise ValueError(validation_message(exc)) from None
    store = await _store(services)
    try:
        await store.put(scope, limits)
    finally:
        await store.close()
    _print_scope(scope, limits)
    print("running gateways apply it within a second", file=sys.stderr)
    if limits.webhook_url is None and any(b.alert_at for b in limits.all_budgets):
        print("no --webhook-url: the --alert-at thresholds send no alert", file=sys.stderr)
    return 0


async def _delete(services: Any, args: argparse.Namespace) -> int:
    scope = await _scope(services, args)
    store = await _store(services)
    try:
        deleted = await store.delete(scope)
    finally:
        await store.close()
    print("deleted" if deleted else "nothing was stored", file=sys.stderr)
    return 0


async def _list(services: Any, args: argparse.Namespace) -> int:
    from gateway.metering.limit_store import LimitScope

    store = await _store(services)
    try:
        stored = await store.load()
    finally:
        await store.close()
    for project, limits in sorted(stored.projects.items()):
        _print_scope(LimitScope(project), limits)
    for key_id, limits in sorted(stored.keys.items()):
        _print_scope(LimitScope(stored.key_projects[key_id], key_id=key_id), limits)
    return 0
