"""Thin handlers for `/v1/files` and `/v1/batches` (OpenAI's shapes and error envelope).

Every route needs a credential with the invoke scope; every id is looked up in the caller's
project only, so another project's file or batch answers 404 as one that does not exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from aiohttp import BodyPartReader, web

from auth.principal import AuthError, Principal, Scope
from gateway.batch.file_directory import TooLarge
from gateway.batch.records import (
    COMPLETION_WINDOW_S,
    PURPOSE_BATCH,
    BatchRecord,
    BatchStatus,
    FileRecord,
    new_id,
    now_s,
)
from gateway.batch.service import BatchService
from gateway.batch.upload_quota import Reservation
from gateway.dialects.openai_common import error_body as openai_error_body
from gateway.web.credentials import authenticated
from gateway.web.keys import AUTHENTICATOR, BATCH
from infra.json_body import BodyError, read_json

_MAX_CREATE_BODY_BYTES = 64 * 1024
_MAX_PURPOSE_BYTES = 64
_MAX_FILENAME_CHARS = 255
_MAX_METADATA_PAIRS = 16
_CHUNK_BYTES = 256 * 1024


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(exc: ApiError) -> web.Response:
    return _json(openai_error_body(exc.status, exc.code, exc.message, exc.param), exc.status)


async def _caller(request: web.Request) -> tuple[BatchService, Principal]:
    """The service and the caller (authenticated before anything is opened or read)."""
    service = request.app[BATCH]
    if not service.settings.enabled:
        raise ApiError(404, "not_found", "the Batch API is not enabled on this gateway")
    try:
        principal = await authenticated(request, request.app[AUTHENTICATOR])
        principal.require(Scope.INVOKE)
    except AuthError as exc:
        raise ApiError(exc.status, exc.code, exc.message) from None
    if not await service.ensure_open():
        raise ApiError(503, "unavailable", "the Batch API is not running")
    return service, principal


def _handled(handler: Any) -> Any:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except ApiError as exc:
            return _error(exc)

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


def _limit(request: web.Request, default: int, maximum: int) -> int:
    given = request.query.get("limit")
    if given is None:
        return default
    try:
        limit = int(given)
    except ValueError:
        limit = 0
    if not 1 <= limit <= maximum:
        raise ApiError(400, "invalid_request", f"limit must be an integer from 1 to {maximum}",
                       "limit")
    return limit


def _page(objects: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": objects, "has_more": has_more,
            "first_id": objects[0]["id"] if objects else None,
            "last_id": objects[-1]["id"] if objects else None}


# files

@_handled
async def upload_file(request: web.Request) -> web.Response:
    """POST /v1/files (multipart: `purpose`, `file`), as the openai SDK's files.create sends it."""
    service, principal = await _caller(request)
    settings = service.settings
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "invalid_request", "upload the file as multipart/form-data with the "
                       "fields 'purpose' and 'file'")
    if (request.content_length or 0) > settings.max_file_bytes + 64 * 1024:
        raise ApiError(413, "file_too_large",
                       f"the file is over {settings.max_file_bytes} bytes", "file")
    with service.uploads.reserving(principal.project) as reservation:
        # (in flight, its bytes count against the project's max_project_bytes: upload_quota.py)
        file_id, written, purpose = await _receive(request, service, principal, reservation)
        try:
            record = await _keep_upload(service, principal, file_id, purpose, written)
        except BaseException:
            await service.files.delete(file_id)
            raise
    return _json(record.to_openai())


async def _receive(request: web.Request, service: BatchService, principal: Principal,
                   reservation: Reservation
                   ) -> tuple[str, tuple[str, int, int] | None, str | None]:
    """(the new file's id, (filename, bytes, newlines) of its content if the body had a `file`
    part, the `purpose` field): the upload's parts read, its file streamed to disk."""
    settings = service.settings
    file_id = new_id("file-")
    purpose: str | None = None
    written: tuple[str, int, int] | None = None  # (filename, bytes, newlines)
    stored_bytes = await service.store.project_bytes(principal.project)
    try:
        reader = await request.multipart()
        # each chunk within client_body_timeout_s, the whole upload within ten times that
        async with asyncio.timeout(service.gateway_settings.client_body_timeout_s * 10):
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise ApiError(400, "invalid_request", "nested multipart is not accepted")
                if part.name == "purpose":
                    raw = await part.read_chunk(_MAX_PURPOSE_BYTES + 1)
                    purpose = raw.decode("utf-8", "replace").strip()
                elif part.name == "file" and written is None:
                    filename = _printable(part.filename or "upload.jsonl")[:_MAX_FILENAME_CHARS]
                    chunks = _counted(
                        _chunks(part, service.gateway_settings.client_body_timeout_s),
                        reservation, lambda: stored_bytes + service.uploads.in_flight(
                            principal.project), settings.max_project_bytes)
                    num_bytes, num_newlines = await service.files.write_stream(
                        file_id, chunks, settings.max_file_bytes)
                    written = (filename, num_bytes, num_newlines)
                else:
                    await part.release()
    except TooLarge:
        raise ApiError(413, "file_too_large", f"the file is over {settings.max_file_bytes} bytes",
                       "file") from None
    except TimeoutError:
        await service.files.delete(file_id)
        raise ApiError(408, "request_timeout", "the upload did not arrive in time") from None
    except ApiError:
        await service.files.delete(file_id)
        raise
    except OSError:  # the disk (or the client's connection), not the body
        await service.files.delete(file_id)
        raise
    except Exception as exc:  # noqa: BLE001 - aiohttp's multipart parser on a malformed body
        # raises ValueError, RuntimeError, HttpProcessingError, AttributeError, ...
        await service.files.delete(file_id)
        reason = _printable(getattr(exc, "message", None) or str(exc) or type(exc).__name__)
        raise ApiError(400, "invalid_request",
                       f"not a multipart/form-data body: {reason}") from None
    return file_id, written, purpose


def _printable(text: str) -> str:
    """`text` as valid UTF-8 (a header decoded with surrogate escapes is not), for the JSON."""
    return text.encode("utf-8", "replace").decode("utf-8")[:200]


def _over_quota(num_bytes: int, max_project_bytes: int) -> ApiError:
    return ApiError(413, "storage_limit_exceeded", f"the project's files would hold "
                    f"{num_bytes} bytes (its uploads in flight included), over its "
                    f"{max_project_bytes}", "file")


async def _counted(chunks: AsyncIterator[bytes], reservation: Reservation,
                   project_bytes: Callable[[], int], max_project_bytes: int
                   ) -> AsyncIterator[bytes]:
    """`chunks`, each added to the upload's reservation; ApiError 413 once the project's bytes
    (`project_bytes()`: stored and in flight) pass `max_project_bytes`."""
    async for chunk in chunks:
        reservation.add(len(chunk))
        if (num_bytes := project_bytes()) > max_project_bytes:
            raise _over_quota(num_bytes, max_project_bytes)
        yield chunk


async def _chunks(part: BodyPartReader, idle_timeout_s: float) -> AsyncIterator[bytes]:
    while True:
        async with asyncio.timeout(idle_timeout_s):
            chunk = await part.read_chunk(_CHUNK_BYTES)
        if not chunk:
            return
        yield chunk


async def _keep_upload(service: BatchService, principal: Principal, file_id: str,
                       purpose: str | None, written: tuple[str, int, int] | None) -> FileRecord:
    if purpose != PURPOSE_BATCH:
        raise ApiError(400, "invalid_request", "purpose must be 'batch' (the only purpose this "
                       "gateway stores files for)", "purpose")
    if written is None:
        raise ApiError(400, "invalid_request", "the multipart body has no 'file' field", "file")
    filename, num_bytes, num_newlines = written
    if num_bytes == 0:
        raise ApiError(400, "invalid_request", "the file is empty", "file")
    num_lines = num_newlines + (0 if await _ends_with_newline(service, file_id) else 1)
    if num_lines > service.settings.max_lines:
        raise ApiError(400, "too_many_lines", f"the file has {num_lines} lines; a batch input "
                       f"file holds at most {service.settings.max_lines}", "file")
    # stored, and in flight here (this upload's bytes included: its reservation is held until
    # the record is stored)
    used = (await service.store.project_bytes(principal.project)
            + service.uploads.in_flight(principal.project))
    if used > service.settings.max_project_bytes:
        raise _over_quota(used, service.settings.max_project_bytes)
    record = FileRecord(file_id, principal.project, PURPOSE_BATCH, filename, num_bytes, now_s())
    await service.store.add_file(record)
    return record


async def _ends_with_newline(service: BatchService, file_id: str) -> bool:
    def last_byte() -> bytes:
        with open(service.files.path_of(file_id), "rb") as handle:
            handle.seek(-1, 2)
            return handle.read(1)

    return await asyncio.to_thread(last_byte) == b"\n"


@_handled
async def list_files(request: web.Request) -> web.Response:
    service, principal = await _caller(request)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "invalid_request", "order must be 'asc' or 'desc'", "order")
    files, has_more = await service.store.list_files(
        principal.project, request.query.get("purpose"), request.query.get("after"),
        _limit(request, 10000, 10000), order == "desc")
    return _json(_page([f.to_openai() for f in files], has_more))


async def _file(request: web.Request) -> tuple[BatchService, FileRecord]:
    service, principal = await _caller(request)
    file_id = request.match_info["file_id"]
    record = await service.store.get_file(principal.project, file_id)
    if record is None:
        raise ApiError(404, "not_found", f"no file with id {file_id!r}", "file_id")
    return service, record


@_handled
async def retrieve_file(request: web.Request) -> web.Response:
    _, record = await _file(request)
    return _json(record.to_openai())


@_handled
async def file_content(request: web.Request) -> web.StreamResponse:
    service, record = await _file(request)
    path = service.files.path_of(record.id)
    if not path.exists():
        raise ApiError(404, "not_found", f"the content of {record.id!r} is gone", "file_id")
    return web.FileResponse(path, headers={"content-type": "application/octet-stream"})


@_handled
async def delete_file(request: web.Request) -> web.Response:
    service, record = await _file(request)
    await service.store.delete_file(record.project, record.id)
    await service.files.delete(record.id)
    return _json({"id": record.id, "object": "file", "deleted": True})


# batches

@_handled
async def create_batch(request: web.Request) -> web.Response:
    service, principal = await _caller(request)
    try:
        body = await read_json(request, _MAX_CREATE_BODY_BYTES,
                               service.gateway_settings.client_body_timeout_s)
    except BodyError as exc:
        raise ApiError(exc.status, "invalid_request", exc.message) from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "the body must be a JSON object")
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str):
        raise ApiError(400, "invalid_request", "input_file_id must be a string", "input_file_id")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in service.endpoints:
        raise ApiError(400, "invalid_request", f"endpoint must be one of "
                       f"{', '.join(service.endpoints)}", "endpoint")
    window = body.get("completion_window")
    if not isinstance(window, str) or window not in COMPLETION_WINDOW_S:
        raise ApiError(400, "invalid_request", "completion_window must be '24h'",
                       "completion_window")
    metadata = _metadata(body.get("metadata"))
    max_active = service.settings.max_active_batches
    if await service.store.num_active_batches(principal.project) >= max_active:
        # (each one is polled by every gateway's runner: their number is one project's to keep)
        raise ApiError(429, "too_many_active_batches", f"the project has {max_active} batches "
                       "not yet finished, as many as it may; retry once one has ended (or cancel "
                       "one)")
    input_file = await service.store.get_file(principal.project, input_file_id)
    if input_file is None:
        raise ApiError(404, "not_found", f"no file with id {input_file_id!r}", "input_file_id")
    if input_file.purpose != PURPOSE_BATCH:
        raise ApiError(400, "invalid_request", "the input file's purpose must be 'batch'",
                       "input_file_id")
    created_at = now_s()
    record = BatchRecord(
        id=new_id("batch_"), project=principal.project, key_id=principal.key_id,
        scopes=sorted(principal.scopes),
        allowed_models=(None if principal.allowed_models is None
                        else sorted(principal.allowed_models)),
        via=principal.via, endpoint=endpoint, input_file_id=input_file_id,
        completion_window=window, created_at=created_at,
        expires_at=created_at + COMPLETION_WINDOW_S[window], metadata=metadata)
    await service.store.add_batch(record)
    service.runner.wake()
    return _json(record.to_openai())


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > _MAX_METADATA_PAIRS
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in value.items())):
        raise ApiError(400, "invalid_request", "metadata must be an object of at most 16 string "
                       "pairs (keys up to 64 characters, values up to 512)", "metadata")
    return value


async def _batch(request: web.Request) -> tuple[BatchService, Principal, BatchRecord]:
    service, principal = await _caller(request)
    batch_id = request.match_info["batch_id"]
    record = await service.store.get_batch(principal.project, batch_id)
    if record is None:
        raise ApiError(404, "not_found", f"no batch with id {batch_id!r}", "batch_id")
    return service, principal, record


@_handled
async def retrieve_batch(request: web.Request) -> web.Response:
    _, _, record = await _batch(request)
    return _json(record.to_openai())


@_handled
async def cancel_batch(request: web.Request) -> web.Response:
    service, principal, record = await _batch(request)
    if not BatchStatus(record.status).is_active:
        raise ApiError(409, "invalid_state",
                       f"a batch that is {record.status} cannot be cancelled")
    cancelled = await service.store.request_cancel(principal.project, record.id, now_s())
    if cancelled is not None and cancelled.cancelling_at is None:  # it ended in between
        raise ApiError(409, "invalid_state",
                       f"a batch that is {cancelled.status} cannot be cancelled")
    service.runner.wake()
    return _json((cancelled or record).to_openai())


@_handled
async def list_batches(request: web.Request) -> web.Response:
    service, principal = await _caller(request)
    batches, has_more = await service.store.list_batches(
        principal.project, request.query.get("after"), _limit(request, 20, 100))
    return _json(_page([b.to_openai() for b in batches], has_more))
