"""`aigw projects|keys|usage` against the store a gateway with the same environment uses."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from auth import open_auth
from auth.settings import AuthSettings
from cli.main import main
from tests.redis_cluster import clean_url_for


@pytest.fixture
def cli_env(store_kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            request: pytest.FixtureRequest) -> AuthSettings:
    monkeypatch.setenv("AIGW_DATA_DIR", str(tmp_path / "data"))
    redis_url = clean_url_for(store_kind, request)
    if redis_url is not None:
        monkeypatch.setenv("AIGW_REDIS_URL", redis_url)
    else:
        monkeypatch.delenv("AIGW_REDIS_URL", raising=False)
    return AuthSettings.from_env()


def test_keys_create_prints_only_the_key_on_stdout_and_the_key_works(
        cli_env: AuthSettings, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["projects", "create", "acme"]) == 0
    if cli_env.redis_url is None:  # the CLI made data_dir: readable by this user only
        assert cli_env.data_dir.stat().st_mode & 0o777 == 0o700
    capsys.readouterr()
    assert main(["keys", "create", "--project", "acme", "--scope", "ai_gateway:invoke",
                 "--scope", "ai_gateway:usage:read", "--name", "ci", "--model", "m1",
                 "--expires-in", "3600"]) == 0
    out, err = capsys.readouterr()
    assert re.fullmatch(r"sk-aigw-[0-9a-f]{12}-[A-Za-z0-9_-]+\n", out)
    key = out.strip()
    assert key not in err and '"name": "ci"' in err

    async def authenticate() -> str:
        services = await open_auth(cli_env)
        try:
            return (await services.authenticator.authenticate(key)).project
        finally:
            await services.close()

    assert asyncio.run(authenticate()) == "acme"

    assert main(["keys", "list", "--project", "acme"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(listed) == 1 and listed[0]["allowed_models"] == ["m1"]
    key_id = listed[0]["key_id"]
    assert key.startswith(f"sk-aigw-{key_id}-")

    assert main(["keys", "rotate", key_id, "--grace-seconds", "60"]) == 0
    rotated = capsys.readouterr().out.strip()
    assert rotated.startswith(f"sk-aigw-{key_id}-") and rotated != key
    assert main(["keys", "revoke", rotated]) == 0  # the whole key, pasted, stands for its id
    assert rotated[len(f"sk-aigw-{key_id}-"):] not in capsys.readouterr().err
    assert main(["keys", "list", "--project", "acme"]) == 0
    assert json.loads(capsys.readouterr().out)["revoked_at"] is not None

    assert main(["projects", "list"]) == 0
    assert capsys.readouterr().out == "acme\n"


def test_cli_errors_go_to_stderr_with_a_nonzero_status(
        cli_env: AuthSettings, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "--project", "nope", "--scope", "ai_gateway:invoke"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "nope" in err
    assert main(["keys", "revoke", "000000000000"]) == 1
    capsys.readouterr()
    assert main(["projects", "create", "empty-model"]) == 0  # `--model "$MODEL"`, MODEL unset:
    assert main(["keys", "create", "--project", "empty-model", "--scope", "ai_gateway:invoke",
                 "--model", ""]) == 1  # a key that could call nothing
    assert "models must be model names" in capsys.readouterr().err
    assert main(["keys", "rotate", "sk-aigw-000000000000-a-pasted-secret"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("aigw: UnknownKey: 000000000000 (in ")  # no secret echoed
    assert "secret" not in err
    assert main(["keys", "list", "--project", "nope"]) == 1  # docs/reference/cli.md: one error form
    out, err = capsys.readouterr()  # which store was read: run elsewhere, the CLI reads another
    where = ("Redis at AIGW_REDIS_URL" if cli_env.redis_url
             else f"SQLite under {cli_env.data_dir.resolve()}")
    assert (out, err.count("\n")) == ("", 1)
    assert err.startswith(f"aigw: UnknownProject: nope (in {where}; the gateway's store is ")


def test_usage_prints_json_and_csv(cli_env: AuthSettings,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["projects", "create", "acme"]) == 0
    capsys.readouterr()
    assert main(["usage", "--project", "acme"]) == 0
    assert json.loads(capsys.readouterr().out) == {"project": "acme", "data": []}
    assert main(["usage", "--project", "acme", "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("day,model,requests,")
    # spaces, as in --help
    assert main(["usage", "--project", "acme", "--group-by", "model, day"]) == 0
    assert json.loads(capsys.readouterr().out) == {"project": "acme", "data": []}


@pytest.mark.parametrize("args", [
    ["--project", "nope"],
    ["--project", "acme", "--since", "yesterday"],
    ["--project", "acme", "--until", "2026-13-01"],
], ids=["unknown_project", "malformed_since", "malformed_until"])
def test_usage_refuses_what_the_usage_api_refuses(
        cli_env: AuthSettings, capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    """As GET .../usage answers 404/400: an empty report would hide the typo."""
    assert main(["projects", "create", "acme"]) == 0
    capsys.readouterr()
    assert main(["usage", *args]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("aigw: ")


def test_usage_of_a_project_known_only_from_jwts_is_printed(
        cli_env: AuthSettings, capsys: pytest.CaptureFixture[str]) -> None:
    """Not in the project store (JWT callers name their own), but metered: not an unknown
    project."""
    import time

    from auth import Principal
    from gateway.metering import MeteringSettings, UsageRecord, open_meter

    async def meter_one() -> None:
        services = await open_auth(cli_env)
        meter = await open_meter(MeteringSettings(), redis=services.redis,
                                 data_dir=cli_env.data_dir)
        try:
            principal = Principal("jwt-only", "jwt:ci", frozenset(["ai_gateway:invoke"]))
            admission = await meter.admit("r1", principal, "m", 4, 8)
            await meter.settle(admission, UsageRecord(
                request_id="r1", project="jwt-only", key_id="jwt:ci", model="m", endpoint="r0",
                prompt_tokens=4, cached_tokens=0, completion_tokens=2, cost_usd=0.0,
                latency_ms=1.0, status=200, created_at=time.time()))
        finally:
            await meter.close()
            await services.close()

    asyncio.run(meter_one())
    assert main(["usage", "--project", "jwt-only", "--group-by", "model"]) == 0
    assert json.loads(capsys.readouterr().out)["data"][0]["prompt_tokens"] == 4


@pytest.mark.parametrize(("redis_url", "expected"), [
    ("redis://127.0.0.1:{port}/0", "aigw: ConnectionError: "),  # nothing listens there
    ("http://user:hunter2@127.0.0.1:{port}",
     "aigw: ValidationError: redis_url: a Redis URL starts with"),
], ids=["unreachable", "wrong_scheme"])
def test_a_bad_or_unreachable_redis_url_is_one_error_line_not_a_traceback(
        redis_url: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from infra.ports import free_port

    monkeypatch.setenv("AIGW_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("AIGW_REDIS_URL", redis_url.format(port=free_port()))
    assert main(["projects", "list"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(expected) and len(err.splitlines()) == 1
    assert "hunter2" not in err


def test_the_cli_uses_the_store_named_in_the_aigw_config_file_as_the_gateway_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A data_dir set only in the config file once sent `aigw keys create` to ./.aigw: a key the
    gateway had never heard of."""
    from gateway.settings import load_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AIGW_DATA_DIR", raising=False)
    monkeypatch.delenv("AIGW_REDIS_URL", raising=False)
    config = tmp_path / "gateway.toml"
    config.write_text(f'data_dir = "{tmp_path / "from-file"}"\n')
    monkeypatch.setenv("AIGW_CONFIG", str(config))
    assert main(["projects", "create", "acme"]) == 0
    assert load_settings().data_dir == tmp_path / "from-file"  # the gateway's view
    assert (tmp_path / "from-file" / "aigw.sqlite3").exists() and not (tmp_path / ".aigw").exists()
    monkeypatch.setenv("AIGW_DATA_DIR", str(tmp_path / "from-env"))  # the environment wins
    assert main(["projects", "list"]) == 0
    # printed by `create`; `list` on an empty store adds nothing
    assert capsys.readouterr().out == "acme\n"


@pytest.mark.parametrize("config_text", ["port = \n", None], ids=["not_toml", "missing"])
def test_a_bad_aigw_config_is_one_cli_error_line(
        config_text: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gateway.toml"
    if config_text is not None:
        config.write_text(config_text)
    monkeypatch.setenv("AIGW_CONFIG", str(config))
    assert main(["projects", "list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aigw: ") and len(err.splitlines()) == 1


_IMPORTED_BY = """
import sys
from cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:  # --help
    pass
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "bench", "transformers"))
print("heavy:", heavy, file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["keys", "--help"], ["bench", "--help"],
                                  ["projects", "list"]])
def test_a_command_imports_no_benchmark_nor_torch(argv: list[str], tmp_path: Path) -> None:
    """Building the parser once imported every benchmark module (and through them aiohttp, the
    gateway, the engine): seconds before any `aigw` command did anything."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _IMPORTED_BY, *argv], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).parents[2],
                          env={"PATH": "/usr/bin:/bin", "AIGW_DATA_DIR": str(tmp_path)})
    assert "heavy: []" in done.stderr, done.stderr
