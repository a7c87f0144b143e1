"""Bearer JWTs: good tokens pass; expired, early, wrong audience/issuer, `none` and HS/RS
confusion are refused with 401."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from auth import AuthError, Principal
from auth.jwt_verifier import JwtVerifier
from auth.settings import AuthSettings

ISSUER, AUDIENCE, HS_SECRET = "https://issuer.test", "aigw", "a-long-shared-hmac-secret-32-bytes!"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())


def _claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    claims = {"sub": "svc-1", "project": "acme", "scope": "ai_gateway:invoke ai_gateway:usage:read",
              "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 300}
    claims.update(overrides)
    return {k: v for k, v in claims.items() if v is not None}


def _jwks_file(tmp_path: Path) -> Path:
    keys = []
    for kid, key, alg in (("rsa-1", RSA_KEY, "RS256"), ("ec-1", EC_KEY, "ES256")):
        jwk = json.loads(jwt.algorithms.get_default_algorithms()[alg].to_jwk(key.public_key()))
        keys.append({**jwk, "kid": kid, "alg": alg, "use": "sig"})
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": keys}))
    return path


def _verifier(tmp_path: Path,
              algorithms: tuple[str, ...] = ("HS256", "RS256", "ES256")) -> JwtVerifier:
    return JwtVerifier(AuthSettings(
        data_dir=tmp_path, jwt_hs256_secret=HS_SECRET, jwt_jwks_file=_jwks_file(tmp_path),
        jwt_issuer=ISSUER, jwt_audience=AUDIENCE, jwt_algorithms=algorithms))


def _verify(verifier: JwtVerifier, token: str) -> Principal:
    return asyncio.run(verifier.verify(token))


def _refused(verifier: JwtVerifier, token: str) -> AuthError:
    with pytest.raises(AuthError) as refused:
        _verify(verifier, token)
    assert refused.value.status == 401
    return refused.value


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_hs256_rs256_and_es256_tokens_name_the_project_scopes_and_subject(tmp_path: Path) -> None:
    verifier = _verifier(tmp_path)
    for token in (jwt.encode(_claims(), HS_SECRET, algorithm="HS256"),
                  jwt.encode(_claims(), RSA_KEY, algorithm="RS256", headers={"kid": "rsa-1"}),
                  jwt.encode(_claims(), EC_KEY, algorithm="ES256", headers={"kid": "ec-1"}),
                  jwt.encode(_claims(), EC_KEY, algorithm="ES256")):  # no kid: tried by alg
        principal = _verify(verifier, token)
        assert (principal.project, principal.key_id, principal.via) == ("acme", "jwt:svc-1", "jwt")
        assert principal.scopes == {"ai_gateway:invoke", "ai_gateway:usage:read"}


@pytest.mark.parametrize("overrides", [
    {"exp": int(time.time()) - 10},
    {"nbf": int(time.time()) + 86_400},  # (computed at collection: a long suite must not reach it)
    {"aud": "someone-else"},
    {"iss": "https://evil.test"},
    {"exp": None},
    {"project": None},
    {"project": "team:dev"},  # its stored responses' Redis keys were project dev's, id "X:team"
    {"project": "a}b"},
    {"project": "a\nb"},
    {"project": "p" * 65},
], ids=["expired", "nbf_in_future", "wrong_audience", "wrong_issuer", "no_exp", "no_project",
        "project_with_a_colon", "project_with_a_brace", "project_with_a_newline",
        "project_over_64"])
def test_tokens_with_bad_claims_are_refused(tmp_path: Path, overrides: dict[str, Any]) -> None:
    verifier = _verifier(tmp_path)
    _refused(verifier, jwt.encode(_claims(**overrides), RSA_KEY, algorithm="RS256",
                                  headers={"kid": "rsa-1"}))


def test_a_token_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _refused(_verifier(tmp_path), jwt.encode(_claims(), other, algorithm="RS256",
                                              headers={"kid": "rsa-1"}))
    _refused(_verifier(tmp_path), jwt.encode(_claims(), "wrong-secret-but-long-enough-000000",
                                              algorithm="HS256"))


def test_alg_none_is_refused(tmp_path: Path) -> None:
    header, payload = _b64(b'{"alg":"none","typ":"JWT"}'), _b64(json.dumps(_claims()).encode())
    error = _refused(_verifier(tmp_path), f"{header}.{payload}.")
    assert "not allowed" in error.message


@pytest.mark.parametrize("algorithms", [("HS256", "RS256", "ES256"), ("RS256", "ES256")])
def test_hs256_signed_with_the_rsa_public_key_is_refused(
        tmp_path: Path, algorithms: tuple[str, ...]) -> None:
    """The classic confusion: HMAC over the token with the public PEM as the secret."""
    public_pem = RSA_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    header = _b64(b'{"alg":"HS256","typ":"JWT","kid":"rsa-1"}')
    payload = _b64(json.dumps(_claims()).encode())
    signature = _b64(hmac.new(public_pem, f"{header}.{payload}".encode(), hashlib.sha256).digest())
    _refused(_verifier(tmp_path, algorithms), f"{header}.{payload}.{signature}")


def test_an_algorithm_outside_the_allow_list_is_refused(tmp_path: Path) -> None:
    verifier = _verifier(tmp_path, algorithms=("RS256",))
    _refused(verifier, jwt.encode(_claims(), EC_KEY, algorithm="ES256", headers={"kid": "ec-1"}))
    _refused(verifier, jwt.encode(_claims(), HS_SECRET, algorithm="HS256"))


def test_without_an_allow_list_the_algorithms_of_the_configured_keys_are_accepted(
        tmp_path: Path) -> None:
    """AIGW_JWT_HS256_SECRET alone (as deploy/ sets it) accepts HS256 tokens; a JWKS alone
    accepts RS256/ES256 and still refuses HS256."""
    hs_only = JwtVerifier(AuthSettings(data_dir=tmp_path, jwt_hs256_secret=HS_SECRET))
    assert _verify(hs_only, jwt.encode(_claims(), HS_SECRET, algorithm="HS256")).project == "acme"
    _refused(hs_only, jwt.encode(_claims(), RSA_KEY, algorithm="RS256", headers={"kid": "rsa-1"}))
    jwks_only = JwtVerifier(AuthSettings(data_dir=tmp_path, jwt_jwks_file=_jwks_file(tmp_path)))
    assert _verify(jwks_only, jwt.encode(_claims(), EC_KEY, algorithm="ES256")).project == "acme"
    _refused(jwks_only, jwt.encode(_claims(), HS_SECRET, algorithm="HS256"))
    assert AuthSettings.from_env({"AIGW_JWT_HS256_SECRET": HS_SECRET}).allowed_jwt_algorithms == {
        "HS256"}


def test_the_none_algorithm_cannot_be_configured() -> None:
    with pytest.raises(ValueError):
        AuthSettings(jwt_algorithms=("none", "RS256"))


def test_keys_are_fetched_from_a_jwks_url(tmp_path: Path) -> None:
    jwks = json.loads(_jwks_file(tmp_path).read_text())

    async def scenario() -> tuple[Principal, AuthError]:
        from aiohttp import web
        from aiohttp.test_utils import TestServer

        app = web.Application()
        app.router.add_get("/jwks.json", lambda _: web.json_response(jwks))
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        try:
            verifier = JwtVerifier(AuthSettings(
                data_dir=tmp_path, jwt_jwks_url=str(server.make_url("/jwks.json")),
                jwt_issuer=ISSUER, jwt_audience=AUDIENCE))
            good = await verifier.verify(jwt.encode(_claims(), RSA_KEY, algorithm="RS256",
                                                    headers={"kid": "rsa-1"}))
            with pytest.raises(AuthError) as refused:
                await verifier.verify(jwt.encode(_claims(), RSA_KEY, algorithm="RS256",
                                                 headers={"kid": "unknown"}))
            return good, refused.value
        finally:
            await server.close()

    good, refused = asyncio.run(scenario())
    assert good.project == "acme" and refused.status == 401


@pytest.mark.parametrize("claim", ["exp", "nbf", "iat"])
@pytest.mark.parametrize("value_of", [lambda now: str(now + 300), lambda now: True,
                                      lambda now: float("inf"), lambda now: 10**400,
                                      lambda now: [now + 300], lambda now: {"t": now + 300}],
                         ids=["numeric_string", "true", "infinity", "400_digits", "list", "object"])
def test_a_date_claim_that_is_not_a_numeric_date_is_refused(
        tmp_path: Path, claim: str, value_of: Any) -> None:
    """RFC 7519 NumericDate is a JSON number: pyjwt read "1796170000" (and true) through int(),
    so a string exp was accepted; Python's json reads Infinity, an exp that never comes."""
    now = int(time.time())
    value = value_of(now)
    header = base64.urlsafe_b64encode(b'{"alg":"HS256","typ":"JWT"}').rstrip(b"=")
    payload = json.dumps(_claims(**{claim: value})).encode()  # (json writes Infinity, big ints)
    signing_input = header + b"." + base64.urlsafe_b64encode(payload).rstrip(b"=")
    signature = hmac.new(HS_SECRET.encode(), signing_input, hashlib.sha256).digest()
    token = (signing_input + b"." + base64.urlsafe_b64encode(signature).rstrip(b"=")).decode()
    _refused(_verifier(tmp_path), token)


def test_a_token_with_a_byte_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    token = jwt.encode(_claims(), HS_SECRET, algorithm="HS256")
    _refused(_verifier(tmp_path), token[:10] + "\udcff" + token[10:])  # as aiohttp decodes it
