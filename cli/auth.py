"""`aigw projects|keys|usage`: manage a gateway's data from the shell.

The store is chosen like the gateway's: AIGW_REDIS_URL set -> Redis, else SQLite under
AIGW_DATA_DIR (default ./.aigw); with AIGW_CONFIG set, the file's `redis_url` and `data_dir` count
too (the environment wins), as they do for `aigw serve`. `aigw keys create` and `aigw keys rotate`
print the key alone on stdout (for `KEY=$(aigw keys create ...)`), everything else on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from infra.config_errors import one_line

if TYPE_CHECKING:
    from auth.settings import AuthSettings

Action = Callable[[Any, argparse.Namespace], Awaitable[int]]


def key_id_arg(text: str) -> str:
    """A KEY_ID argument: the key id, or the whole key `sk-aigw-<key_id>-<secret>` pasted as it
    was handed out, which stands for its id (so an error never echoes the secret)."""
    from auth.keys import key_id_of

    return key_id_of(text)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    projects = subparsers.add_parser("projects", help="create and list projects")
    project_cmds = projects.add_subparsers(dest="projects_command", required=True)
    create_project = project_cmds.add_parser("create", help="create a project")
    create_project.add_argument("name")
    create_project.set_defaults(func=_runner(_create_project))
    project_cmds.add_parser("list", help="list projects").set_defaults(func=_runner(_list_projects))

    keys = subparsers.add_parser("keys", help="create, list, revoke and rotate API keys")
    key_cmds = keys.add_subparsers(dest="keys_command", required=True)
    create_key = key_cmds.add_parser("create", help="create a key; prints it alone on stdout")
    create_key.add_argument("--project", required=True)
    create_key.add_argument("--scope", action="append", required=True, dest="scopes",
                            help="ai_gateway:invoke, ai_gateway:usage:read or ai_gateway:admin")
    create_key.add_argument("--name", default="")
    create_key.add_argument("--model", action="append", dest="models",
                            help="allow only these models (repeat); default: every model")
    create_key.add_argument("--expires-in", type=float, dest="expires_in_s", metavar="SECONDS")
    create_key.set_defaults(func=_runner(_create_key))
    list_keys = key_cmds.add_parser("list", help="list a project's keys (JSON lines)")
    list_keys.add_argument("--project", required=True)
    list_keys.set_defaults(func=_runner(_list_keys))
    revoke = key_cmds.add_parser("revoke", help="revoke a key (every instance within 1 s)")
    revoke.add_argument("key_id", type=key_id_arg)
    revoke.set_defaults(func=_runner(_revoke_key))
    rotate = key_cmds.add_parser("rotate", help="new secret, same key id; prints it on stdout")
    rotate.add_argument("key_id", type=key_id_arg)
    rotate.add_argument("--grace-seconds", type=float, default=0.0, dest="grace_s")
    rotate.set_defaults(func=_runner(_rotate_key))

    usage = subparsers.add_parser("usage", help="a project's usage by day, hour, model, key, tag "
                                                "or session")
    usage.add_argument("--project", required=True)
    usage.add_argument("--format", choices=("json", "csv"), default="json")
    usage.add_argument("--group-by", default="model,day",
                       help="any of day, hour, model, key, tag, session (comma-separated)")
    usage.add_argument("--since", help="first UTC day, YYYY-MM-DD")
    usage.add_argument("--until", help="last UTC day, YYYY-MM-DD")
    usage.set_defaults(func=_runner(_usage))


def _runner(action: Action) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return asyncio.run(_with_services(action, args))
    return run


async def _with_services(action: Action, args: argparse.Namespace) -> int:
    from redis.exceptions import RedisClusterException, RedisError
    from yaml import YAMLError

    from auth import open_auth
    from auth.settings import AuthSettings
    from auth.store import StoreError, UnknownKey, UnknownProject

    settings = None
    try:
        # enabled=False: the CLI manages the store but authenticates nobody, so no watcher runs.
        settings = _store_settings(AuthSettings.from_env()).model_copy(update={"enabled": False})
        services = await open_auth(settings)
        try:
            return await action(services, args)
        finally:
            await services.close()
    except (StoreError, ValueError, OSError, YAMLError,  # a bad AIGW_CONFIG or data dir
            RedisError, RedisClusterException) as exc:  # Redis unreachable
        where = ""
        if settings is not None and isinstance(exc, (UnknownProject, UnknownKey)):
            where = f" ({_which_store(settings)})"  # (run elsewhere, the CLI reads another)
        print(f"aigw: {type(exc).__name__}: {one_line(exc)}{where}", file=sys.stderr)
        return 1


def _which_store(settings: AuthSettings) -> str:
    """Which store the CLI read, for a project or key it did not find there: a CLI run in
    another directory than `aigw serve` reads another ./.aigw."""
    store = ("Redis at AIGW_REDIS_URL" if settings.redis_url
             else f"SQLite under {settings.data_dir.resolve()}")
    return (f"in {store}; the gateway's store is where its AIGW_DATA_DIR, AIGW_REDIS_URL or "
            f"AIGW_CONFIG point")


def _store_settings(settings: AuthSettings) -> AuthSettings:
    """The store a gateway started with this environment uses: with AIGW_CONFIG set, its
    `redis_url` and `data_dir` (environment over file), as gateway/web/services.py takes them."""
    if not os.environ.get("AIGW_CONFIG"):
        return settings
    from gateway.settings import load_settings

    gateway = load_settings()
    return settings.model_copy(update={"redis_url": gateway.redis_url,
                                       "data_dir": gateway.data_dir})


async def _create_project(services: Any, args: argparse.Namespace) -> int:
    project = await services.admin.create_project(args.name)
    print(project.name)
    return 0


async def _list_projects(services: Any, args: argparse.Namespace) -> int:
    for project in await services.store.list_projects():
        print(project.name)
    return 0


async def _create_key(services: Any, args: argparse.Namespace) -> int:
    record, secret = await services.admin.create_key(
        args.project, args.scopes, name=args.name, allowed_models=args.models,
        expires_in_s=args.expires_in_s)
    print(json.dumps(record.public_view()), file=sys.stderr)
    print("this key is shown once: store it now", file=sys.stderr)
    print(secret)
    return 0


async def _list_keys(services: Any, args: argparse.Namespace) -> int:
    from auth.store import UnknownProject

    if await services.store.get_project(args.project) is None:
        raise UnknownProject(args.project)  # printed as every other CLI error
    for record in await services.store.list_keys(args.project):
        print(json.dumps(record.public_view()))
    return 0


async def _revoke_key(services: Any, args: argparse.Namespace) -> int:
    record = await services.admin.revoke_key(args.key_id)
    print(json.dumps(record.public_view()), file=sys.stderr)
    return 0


async def _rotate_key(services: Any, args: argparse.Namespace) -> int:
    record, secret = await services.admin.rotate_key(args.key_id, args.grace_s)
    print(json.dumps(record.public_view()), file=sys.stderr)
    print(secret)
    return 0


async def _usage(services: Any, args: argparse.Namespace) -> int:
    from auth.store import UnknownProject
    from gateway.metering import open_usage_reader, render_csv, render_json
    from gateway.metering.usage_report import validate_day

    # The same refusals as GET /admin/v1/projects/{project}/usage: a typo selects nothing.
    since, until = validate_day(args.since, "since"), validate_day(args.until, "until")
    reader = await open_usage_reader(services.redis, services.settings.data_dir)
    try:
        # "model, day" as --help writes it
        group_by = [part.strip() for part in args.group_by.split(",")]
        rows = await reader.usage_by_project(args.project, group_by, since=since, until=until)
    finally:
        await reader.close()
    if not rows and await services.store.get_project(args.project) is None:
        raise UnknownProject(args.project)  # a project known only from JWTs has usage
    print(render_csv(rows, group_by) if args.format == "csv"
          else render_json(args.project, rows, group_by),
          end="" if args.format == "csv" else "\n")
    return 0
