"""`aigw serve` as a process: config file, real auth + metering, two workers on one port,
SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.mock_upstream import MockState, create_mock_app
from infra.ports import free_port
from tests.gateway.conftest import MODEL, LoopThread, start_app
from tests.processes import child_processes, stop_process


@pytest.fixture(autouse=True)
def _data_dir_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process `aigw serve` runs create their data_dir at start: not ./.aigw in the checkout."""
    monkeypatch.setenv("AIGW_DATA_DIR", str(tmp_path / "aigw-data"))


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "aigw serve exited early"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("aigw serve did not become healthy")


@pytest.mark.parametrize("num_workers", [2])
def test_serve_with_config_auth_and_workers_then_drains_on_sigterm(
        loop_thread: LoopThread, tmp_path: Path, num_workers: int) -> None:
    runner, upstream_url = loop_thread.run(start_app(create_mock_app(MockState())))
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\nhealth_interval_s = 1.0\n'
                      f'[[models]]\nname = "{MODEL}"\nbackend = "openai"\nendpoints = '
                      f'["{upstream_url}"]\n'
                      '[models.prices]\ninput_per_token = 1e-6\noutput_per_token = 2e-6\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
    process = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--config", str(config),
                                "--port", str(port), "--workers", str(num_workers)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        key_file = tmp_path / "data" / "default-key.txt"  # written by whichever worker made it
        assert (tmp_path / "data").stat().st_mode & 0o777 == 0o700  # keys, pepper, prompts
        deadline = time.monotonic() + 30
        while (not (key_file.exists() and key_file.read_text().strip())
               and time.monotonic() < deadline):
            time.sleep(0.1)
        key = key_file.read_text().strip()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
        for _ in range(4):
            ok = httpx.post(url + "/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer {key}"})
            assert ok.status_code == 200, ok.text
        messages = httpx.post(url + "/v1/messages", json={**body, "max_tokens": 4},
                              headers={"x-api-key": key})
        assert messages.status_code == 200 and messages.json()["usage"]["output_tokens"] == 4
        # each scrape, whichever worker answers it (a new connection each), counts all of them
        for _ in range(6):
            assert _requests_by_status(httpx.get(url + "/metrics").text) == {"200": 5, "401": 1}
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert process.stdout is not None  # the start line names the models clients may send
        assert f"aigw serving on {url}, models: {MODEL}\n" in process.stdout.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        loop_thread.run(runner.cleanup())


def _requests_by_status(metrics_text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "aigw_requests_total" and sample.labels["route"].startswith("/v1/"):
                status = sample.labels["status"]
                counts[status] = counts.get(status, 0) + int(sample.value)
    return counts


def _child_command_lines(pid: int) -> list[list[str]]:
    """The argv of every live child process of `pid` (Linux /proc)."""
    return [argv for _, argv in child_processes(pid)]


def test_embedded_replicas_get_the_replica_args_and_serve(tmp_path: Path) -> None:
    """`aigw serve --replica-args "..."` reaches each embedded `aigw replica`; here the native q4
    mode."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
    process = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--no-auth", "--port",
                                str(port), "--kv-cache-memory", str(32 << 20),
                                "--replica-args", "--decode-weights q4 --threads 1"],
                               env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, timeout_s=240)
        replicas = [argv for argv in _child_command_lines(process.pid) if "replica" in argv]
        # the chat replica, and the bundled embedding model's beside it (the args reach both)
        assert len(replicas) == 2, _child_command_lines(process.pid)
        assert ([argv[-4:] for argv in replicas]
                == [["--decode-weights", "q4", "--threads", "1"]] * 2)
        assert replicas[1][replicas[1].index("--model") + 1].endswith("model.zip")
        models = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert models[1] == "all-MiniLM-L6-v2"
        model = models[0]
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 6,
            "messages": [{"role": "user", "content": "Name a color."}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        embedded = httpx.post(url + "/v1/embeddings", timeout=60,
                              json={"model": models[1], "input": ["a color", "a colour"]})
        assert embedded.status_code == 200, embedded.text
        assert [len(d["embedding"]) for d in embedded.json()["data"]] == [384, 384]
    finally:
        stop_process(process)


@pytest.mark.parametrize("config_text", [
    "bogus = 1\n",  # unknown key
    'port = "abc"\n',  # wrong type
    "port = \n",  # not TOML
    None,  # no such file
    '[[models]]\nname = "m"\nbackend = "bogus"\nendpoints = ["http://127.0.0.1:9"]\n',
    'router = "bogus"\n',
    '[[models]]\nname = "m"\nendpoints = ["replica-0:8001"]\n',  # no scheme: never reachable
    '[[models]]\nname = "m"\nendpoints = ["http://127.0.0.1:9"]\n'
    '[[models]]\nname = "m"\nendpoints = ["http://127.0.0.1:10"]\n',  # one name, two models
], ids=["unknown_key", "wrong_type", "not_toml", "missing_file", "unknown_backend",
        "unknown_router", "endpoint_not_a_url", "duplicate_model_name"])
def test_a_bad_config_file_is_one_error_message_and_status_1(
        tmp_path: Path, config_text: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    config = tmp_path / "gateway.toml"
    if config_text is not None:
        config.write_text(config_text)
    assert main(["serve", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aigw: invalid configuration: ") and "Traceback" not in err


@pytest.mark.parametrize(("config_text", "where"), [
    ('[[models]]\nname = "m"\nendpoints = ["http://127.0.0.1:9"]\nupstream_modle = "x"\n',
     "models.0.upstream_modle"),
    ('[[models]]\nname = "m"\nendpoint = ["http://127.0.0.1:9"]\n', "models.0.endpoint"),
    ('[[models]]\nname = "m"\nendpoints = ["http://127.0.0.1:9"]\n[models.prices]\n'
     "input_per_tokens = 1e-6\n", "models.0.prices.input_per_tokens"),
    ("[limits]\nrequests_per_minit = 600\n", "limits.requests_per_minit"),
    ("[project_limits.team-a]\ntokens_per_minutes = 1000\n",
     "project_limits.team-a.tokens_per_minutes"),
    ("[batch]\nmax_line = 10\n", "batch.max_line"),
])
def test_a_misspelt_key_in_a_table_is_an_error_naming_it(
        config_text: str, where: str, tmp_path: Path) -> None:
    """Unknown keys are errors in every table, as at the top level (configuration.md): a typo
    in `[limits]` was ignored, so the gateway started with no limit at all, and one in
    `[[models]]` sent requests upstream under the wrong name."""
    from gateway.settings import load_settings
    from infra.config_errors import one_line

    config = tmp_path / "gateway.toml"
    config.write_text(config_text)
    with pytest.raises(ValueError) as refused:
        load_settings(config)
    assert f"{where}: Extra inputs are not permitted" in one_line(refused.value)


@pytest.mark.parametrize("variable", [
    "AIGW_TRACE_SAMPLE_RATIO=abc", "AIGW_TRACE_SAMPLE_RATIO=2", "AIGW_TRACE_BUFFER_TRACES=0",
    "AIGW_TRACE_MAX_PER_S=-1", "AIGW_TRACE_MAX_PER_S=nan",
    "AIGW_JWT_ALGORITHMS=none",
])
def test_a_bad_environment_variable_is_one_error_message_and_status_1(
        variable: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    name, _, value = variable.partition("=")
    monkeypatch.setenv(name, value)
    config = tmp_path / "gateway.toml"
    config.write_text('[[models]]\nname = "m"\nendpoints = ["http://127.0.0.1:9"]\n')
    assert main(["serve", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aigw: invalid configuration: ") and "Traceback" not in err
    if name.startswith("AIGW_TRACE"):
        assert name in err  # which variable is wrong


@pytest.mark.parametrize("flag", ["--replicas", "--workers"])
@pytest.mark.parametrize("count", ["0", "-1"])
def test_replicas_or_workers_below_one_is_a_usage_error(flag: str, count: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    with pytest.raises(SystemExit) as exit_info:  # --workers 0 once served with one worker
        main(["serve", flag, count])
    assert exit_info.value.code == 2
    assert f"{flag}: must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(("words", "expected"), [
    (["--port", "99999"], "port: Input should be less than or equal to 65535 (got 99999)"),
    (["--port", "-1"], "port: Input should be greater than or equal to 0 (got -1)"),
])
def test_an_out_of_range_flag_is_one_line_naming_the_field(
        words: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    assert main(["serve", *words]) == 1
    err = capsys.readouterr().err
    assert err == f"aigw: invalid configuration: {expected}\n"  # not pydantic's paragraph and URL


@pytest.mark.parametrize("words", [
    ["--replica-args", "--no-prefix-caching"],  # one option alone: argparse took it for its own
    ["--replica-args", "--decode-weights q4"],
    ["--replica-args=--threads 1"],
])
def test_replica_args_take_the_next_word_whatever_it_starts_with(
        words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from cli import gateway as serve_cli
    from cli.main import main

    seen: list[str] = []
    monkeypatch.setattr(serve_cli, "run", lambda args: seen.append(args.replica_args) or 0)
    assert main(["serve", "--port", "1", *words, "--no-auth"]) == 0
    assert seen == [words[-1].removeprefix("--replica-args=")]


def test_a_replica_that_exits_at_start_is_one_error_line_and_status_1(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """On a free port: the default 8000 is often held (a developer's `make run`), and the port
    check before the replicas start would answer first."""
    from cli.main import main

    monkeypatch.delenv("AIGW_REDIS_URL", raising=False)
    assert main(["serve", "--port", str(free_port()), "--replica-args", "--no-such-flag"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aigw: replica ") and "exited with 2" in err and "Traceback" not in err


@pytest.mark.parametrize(("redis_url", "expected"), [
    ("redis://127.0.0.1:{port}/0", "aigw: cannot reach Redis at redis_url: "),  # nothing listens
    ("http://user:hunter2@127.0.0.1:{port}", "aigw: invalid configuration: redis_url: a Redis URL "
                                             "starts with redis://"),
    ("localhost:{port}", "aigw: invalid configuration: redis_url: "),  # no scheme at all
    ("redis://default:hunter2{port}", "aigw: invalid configuration: redis_url: the port in the "
                                      "Redis URL is not a number"),  # no @host: was a traceback
], ids=["unreachable", "wrong_scheme", "no_scheme", "port_not_a_number"])
def test_a_bad_or_unreachable_redis_url_is_one_error_line_before_any_replica_starts(
        redis_url: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Each was a traceback: from every worker (unreachable) or from the embedded replica."""
    from cli.main import main
    from gateway.fleet import embedded

    monkeypatch.setenv("AIGW_REDIS_URL", redis_url.format(port=free_port()))
    monkeypatch.setattr(embedded, "start_replicas", lambda *a, **k: pytest.fail("replica started"))
    assert main(["serve", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert err.startswith(expected) and len(err.splitlines()) == 1 and "hunter2" not in err


def test_ctrl_c_while_the_replicas_load_stops_them_with_one_line_and_status_130(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Was a KeyboardInterrupt traceback from `make run` interrupted during the model load."""
    from cli.main import main
    from gateway.fleet import embedded

    stopped: list[list[object]] = []
    monkeypatch.setattr(embedded, "start_replicas", lambda *a, **k: ["replica"])
    monkeypatch.setattr(embedded, "wait_healthy",
                        lambda replicas: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setattr(embedded, "stop_replicas", stopped.append)
    monkeypatch.delenv("AIGW_REDIS_URL", raising=False)
    assert main(["serve", "--port", str(free_port())]) == 130
    assert stopped == [["replica"]]
    assert capsys.readouterr().err == "aigw: interrupted\n"


@pytest.mark.parametrize("num_workers", ["1", "2"])
def test_a_port_in_use_is_one_error_line_before_any_replica_starts(
        num_workers: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Was a bind traceback after the model load (from each worker, and status 0 with two)."""
    import socket

    from cli.main import main
    from gateway.fleet import embedded

    monkeypatch.setattr(embedded, "start_replicas", lambda *a, **k: pytest.fail("replica started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--workers", num_workers]) == 1
    assert (capsys.readouterr().err
            == f"aigw: cannot listen on 127.0.0.1:{port}: Address already in use\n")


def test_a_data_dir_that_cannot_be_created_is_one_error_line_before_any_replica_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Was a FileExistsError traceback from the worker, after the model load."""
    from cli.main import main
    from gateway.fleet import embedded

    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    monkeypatch.setenv("AIGW_DATA_DIR", str(a_file))
    monkeypatch.delenv("AIGW_REDIS_URL", raising=False)
    monkeypatch.setattr(embedded, "start_replicas", lambda *a, **k: pytest.fail("replica started"))
    assert main(["serve", "--port", str(free_port())]) == 1
    assert capsys.readouterr().err == f"aigw: cannot use data_dir {str(a_file)!r}: File exists\n"


def test_replica_args_with_an_unclosed_quote_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    with pytest.raises(SystemExit) as exit_info:  # was a ValueError traceback from shlex
        main(["serve", "--replica-args", '--seed "1'])
    assert exit_info.value.code == 2
    assert "argument --replica-args: No closing quotation" in capsys.readouterr().err


def _has_ipv6() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", ["0.0.0.0", "", "localhost",
                                  pytest.param("::", marks=pytest.mark.skipif(
                                      not _has_ipv6(), reason="no IPv6 here"))])
def test_the_port_check_passes_every_host_the_server_can_bind(host: str) -> None:
    from infra.ports import cannot_listen

    assert cannot_listen(host, free_port()) is None  # "" (every interface) was refused by name
    assert cannot_listen(host, 0) is None


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 here")
def test_the_port_check_lets_an_ipv6_host_use_a_port_held_over_ipv4_only() -> None:
    """The server's IPv6 socket is IPv6-only (asyncio and uvloop), so it binds `::` beside another
    program's 0.0.0.0 socket; the check's dual-stack bind once refused that."""
    import socket

    from infra.ports import cannot_listen

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cannot_listen("::", port) is None
        assert cannot_listen("0.0.0.0", port) == "Address already in use"


def test_a_worker_that_fails_makes_the_exit_status_1() -> None:
    """Two spawned workers whose settings cannot be served: status 1 (it was 0 once the metrics
    directory wrapper dropped the workers' status)."""
    from cli.gateway import _serve_workers

    assert _serve_workers({"port": -1}, 2) == 1


def test_an_invalid_upstream_api_key_is_not_echoed(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    config = tmp_path / "gateway.toml"  # an unquoted key: an int, refused, and once printed whole
    config.write_text('[[models]]\nname = "m"\nendpoints = ["http://127.0.0.1:9"]\n'
                      "api_key = 123456789\n")
    assert main(["serve", "--config", str(config), "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert err == "aigw: invalid configuration: models.0.api_key: Input should be a valid string\n"
