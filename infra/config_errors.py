"""Start-up errors as one line for the CLI (`aigw: invalid configuration: ...`).

pydantic's ValidationError is a paragraph per field plus a docs URL; here each field is
`where: message (got value)`, joined with "; ", and no credential is echoed (a URL may hold a
password; an unquoted api_key in TOML is an int). Any other error is folded onto one line (a YAML
error's caret drawing included).
"""

from __future__ import annotations

_SECRET_WORDS = ("url", "secret", "pepper", "api_key", "password")


def one_line(exc: Exception) -> str:
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return " ".join(str(exc).split())
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or exc.title
        message = error["msg"].removeprefix("Value error, ")
        secret = any(word in where for word in _SECRET_WORDS)
        got = f" (got {error['input']!r})" if error["type"] != "missing" and not secret and \
            not isinstance(error["input"], dict) else ""
        problems.append(f"{where}: {message}{got}")
    return "; ".join(problems)
