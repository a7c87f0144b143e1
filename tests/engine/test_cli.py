"""`aigw generate` and `aigw replica` report a bad flag or model path in one line, exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main


@pytest.fixture(autouse=True)
def _replica_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """A credential, so that each `aigw replica` here fails on the flag under test."""
    monkeypatch.setenv("AIGW_REPLICA_SECRET", "test-secret")
    monkeypatch.delenv("AIGW_REPLICA_SECRET_FILE", raising=False)


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--max-tokens", "0"],
    ["generate", "hi", "--temperature", "-1"],
    ["generate", "hi", "--model", "/nonexistent/model.gguf"],
    ["replica", "--port", "0", "--model", "/nonexistent/model.gguf"],
    ["replica", "--port", "0", "--block-size", "0"],
    # these three once served (0 threads, a 0 max_model_len read as "the model's") ...
    ["replica", "--port", "0", "--threads", "0"],
    ["replica", "--port", "0", "--max-model-len", "0"],
    ["generate", "hi", "--max-model-len", "-3"],
    # ... and these were tracebacks from deep in loading
    ["replica", "--port", "0", "--device", "bogus"],
    ["replica", "--port", "0", "--device", "mps"],
], ids=["max_tokens_0", "negative_temperature", "generate_missing_model",
        "replica_missing_model", "replica_block_size_0", "threads_0", "max_model_len_0",
        "negative_max_model_len", "unknown_device", "unsupported_device"])
def test_a_bad_engine_flag_is_one_error_line_and_status_1(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("aigw: ") and "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replica", "--port", "0", "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert (err
            == "aigw: ValueError: device 'cuda': CUDA is not available to this torch build or "
               "machine\n")


@pytest.mark.parametrize("port", ["99999", "-1", "x"])
def test_a_replica_port_outside_0_to_65535_is_a_usage_error(
        port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # was an OverflowError traceback after loading
        main(["replica", "--port", port])
    assert exit_info.value.code == 2
    assert "argument --port: " in capsys.readouterr().err


@pytest.mark.parametrize(("redis_url", "expected"), [
    ("http://127.0.0.1:{port}", "aigw: ValueError: a Redis URL starts with redis://"),
    ("redis+cluster://127.0.0.1:{port}", "aigw: RedisClusterException: "),  # no node answers
], ids=["wrong_scheme", "unreachable_cluster"])
def test_a_replica_redis_url_it_cannot_use_is_one_error_line_before_loading(
        redis_url: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    from infra.ports import free_port

    assert main(["replica", "--port", "0", "--redis-url", redis_url.format(port=free_port())]) == 1
    err = capsys.readouterr().err
    assert err.startswith(expected) and len(err.splitlines()) == 1  # was a traceback


def test_a_replica_port_in_use_is_one_error_line_before_the_model_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:  # was an OSError traceback after the model load
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["replica", "--port", str(port), "--model", "/never/loaded.gguf"]) == 1
    assert (capsys.readouterr().err
            == f"aigw: cannot listen on 127.0.0.1:{port}: Address already in use\n")


def test_a_replica_without_a_credential_refuses_to_start_before_loading(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("AIGW_REPLICA_SECRET")
    assert main(["replica", "--port", "0", "--model", "/nonexistent/model.gguf"]) == 1
    err = capsys.readouterr().err  # the credential, not the missing model: nothing was loaded
    assert err.startswith("aigw: the replica needs the gateway's credential") and "--no-auth" in err


@pytest.mark.parametrize("content", ["", "\n"], ids=["empty", "newline_only"])
def test_an_empty_replica_secret_file_is_one_error_line_not_an_open_replica(
        content: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "replica-secret"
    path.write_text(content)
    monkeypatch.delenv("AIGW_REPLICA_SECRET")
    monkeypatch.setenv("AIGW_REPLICA_SECRET_FILE", str(path))
    assert main(["replica", "--port", "0", "--no-auth"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aigw: ValueError: AIGW_REPLICA_SECRET_FILE=") and "empty" in err
