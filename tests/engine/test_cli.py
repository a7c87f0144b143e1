"""`aigw generate` and `aigw replica` report a bad flag or model path in one line, exit 1."""

from __future__ import annotations

import pytest

from gateway.cli import main


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--max-tokens", "0"],
    ["generate", "hi", "--temperature", "-1"],
    ["generate", "hi", "--model", "/nonexistent/model.gguf"],
    ["replica", "--port", "0", "--model", "/nonexistent/model.gguf"],
    ["replica", "--port", "0", "--block-size", "0"],
], ids=["max_tokens_0", "negative_temperature", "generate_missing_model",
        "replica_missing_model", "replica_block_size_0"])
def test_a_bad_engine_flag_is_one_error_line_and_status_1(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("aigw: ") and "Traceback" not in err and len(err.splitlines()) == 1
