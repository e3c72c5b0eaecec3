"""API errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.engine_client import (AdapterDeleted, AdapterUnusable, EngineStopped, EngineUnavailable,
                                   UpstreamFailure, UpstreamUnavailable, WorkersOutOfSpace)
from store import FULL_ERRORS, UNAVAILABLE_ERRORS, StoreFull
from store.errors import quoted
from store.blobs import is_out_of_space

logger = logging.getLogger(__name__)

STORE_UNAVAILABLE_MESSAGE = ("the gateway cannot use its store (tenants, keys, limits) at the "
                             "moment; retry shortly")
REDIS_FULL_MESSAGE = ("the gateway's store has no room left for this call: Redis reached its "
                      "maxmemory, and refuses what calls must keep there (an upload's adapter "
                      "files, usage, rate limits); retrying will not help until the operator gives "
                      "Redis more memory (raises its maxmemory) or deletes adapters no longer used")
SQLITE_FULL_MESSAGE = ("the gateway's store has no room left for this call: the disk volume of its "
                       "SQLite file (in its data folder, unless --store names another) is full or "
                       "fails writes, so it cannot keep what calls must (usage, rate limits, "
                       "tenants, adapters); retrying will not help until the operator frees disk "
                       "space on that volume (the gateway's log names the file)")
_MSGSPEC_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MSGSPEC_MISSING = re.compile(r"(?:missing required|contains unknown) field `(.*)`")


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class ApiError(Exception):
    """An error that reaches the client as `status` with an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(ErrorBody(message=message, type=type, param=param, code=code))
        self.headers = headers or {}

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body), self.status, self.headers,
                        media_type="application/json")


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str, code: str = "not_found") -> ApiError:
    return ApiError(404, message, code=code)


def tenant_not_found(name: str) -> ApiError:
    """404 for a tenant that does not exist, its name cut as `quoted` cuts it (the store's
    NotFound names it whole, however long)."""
    return not_found(f"tenant {quoted(name)} does not exist", code="tenant_not_found")


def model_not_found(model: str, why: str | None = None) -> ApiError:
    """404 for a `model` that names nothing this tenant can use; `why`: what it reached, and why
    that does not serve, when the name is the tenant's own to know about."""
    what = f"cannot be used: {why}" if why else "does not exist or you do not have access to it"
    return ApiError(404, f"the model {quoted(model)} {what}; GET /v1/models lists the models you "
                    "can use", param="model", code="model_not_found")


def engine_failed(error: Exception) -> ApiError:
    if isinstance(error, EngineUnavailable):
        return ApiError(503, f"no engine can take this request now: {error}", type="server_error",
                        code="engine_unavailable", headers={"Retry-After": "2"})
    if isinstance(error, EngineStopped):
        return server_shutdown(f"{error}; send it again")
    if isinstance(error, WorkersOutOfSpace):
        return unavailable_until_mended(str(error), code="disk_full")
    if isinstance(error, AdapterDeleted):
        return ApiError(404, str(error), param="model", code="model_not_found")
    if isinstance(error, AdapterUnusable):
        return unavailable_until_mended(str(error), code="adapter_incompatible")
    if isinstance(error, UpstreamUnavailable):
        return ApiError(503, str(error), type="server_error", code="upstream_unavailable",
                        headers={"Retry-After": "2"})
    if isinstance(error, UpstreamFailure):  # a bad gateway: the server behind this one failed
        return ApiError(502, str(error), type="server_error", code="upstream_failure")
    return ApiError(500, f"the engine failed on this request: {error}", type="server_error",
                    code="engine_failure")


def server_shutdown(message: str = "the server shut down before this call finished; send it again",
                    headers: dict[str, str] | None = None) -> ApiError:
    """503 `server_shutdown` for a call that a graceful shutdown stopped at its deadline: sent
    again, it runs on a server that is up (the OpenAI SDKs retry a 503 by themselves)."""
    return ApiError(503, message, type="server_error", code="server_shutdown",
                    headers={"Retry-After": "2", **(headers or {})})


def from_validation_error(error: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """A 400 for a body msgspec refused, naming the offending field as `param`."""
    text = str(error)
    match = _MSGSPEC_PATH.search(text)
    if match is None:
        missing = _MSGSPEC_MISSING.search(text)
        param = missing.group(1) if missing else None
        return invalid_request(f"invalid request body: {text}", param=param)
    # A dict's value is at "field[...]" (msgspec does not say which key): the field is the param.
    param = match.group(1).replace("[...]", "") or None
    return invalid_request(f"invalid value for '{param}': {text[:match.start()]}", param=param)


def client_closed() -> ApiError:
    """499 (nginx's "client closed request") for a client that left before its answer: nobody
    reads it, but the access log and the request metrics count the call as the client's doing."""
    return ApiError(499, "the client closed the connection", code="client_closed_request")


def too_deep_message(what: str) -> str:
    """Why a JSON document nested past the depth msgspec decodes (its RecursionError) is refused."""
    return (f"{what} nests arrays and objects too deeply to be read; no field of this API nests "
            "more than a few levels")


async def handle_api_error(request: Request, error: ApiError) -> Response:
    return error.response()


async def handle_http_exception(request: Request, error: HTTPException) -> Response:
    """Starlette's own 404/405s, in the OpenAI shape."""
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    return ApiError(error.status_code, str(error.detail), type=kind,
                    headers=error.headers).response()


async def handle_client_disconnect(request: Request, error: ClientDisconnect) -> Response:
    """A client that left while sending its body: a 499 as for one that leaves while its call runs,
    where it would be a 500 with a traceback, as if the gateway had failed."""
    return client_closed().response()


def unavailable_until_mended(message: str, code: str) -> ApiError:
    """A 503 that lasts until someone acts (the operator, or the tenant uploading an adapter
    again), as `message` says: x-should-retry false and no Retry-After, so that OpenAI's SDKs do
    not send the call again (each try would cost the client a round trip, and the gateway a log
    line and a request in its metrics)."""
    return ApiError(503, message, type="server_error", code=code,
                    headers={"x-should-retry": "false"})


@contextlib.contextmanager
def refused_when_out_of_space(action: str, where: str, folder: Path | str) -> Iterator[None]:
    """503 `disk_full` for a call whose write to `where` (`folder`, which only the log names) its
    volume has no room left for, so the server could not `action`: a full disk stays full until
    the operator frees space, so not to be retried (each try would send the call, or its
    upload, again to be refused again)."""
    try:
        yield
    except OSError as error:
        if not is_out_of_space(error):
            raise
        logger.warning("could not %s: %s, %s, has no room left: %s", action, where, folder, error)
        raise unavailable_until_mended(
            f"the server has no disk space left to {action}: the volume of {where} is full; "
            "retrying will not help until the operator frees space there",
            code="disk_full") from None


def store_unavailable(error: Exception) -> ApiError:
    """The 503 for a call that needed the store while it could not be used (`error`, one of
    store.UNAVAILABLE_ERRORS): `store_full` while it has no room left (Redis at its maxmemory,
    the SQLite file's volume full), which only its operator mends, so not to be retried (OpenAI's
    SDKs read x-should-retry); else `store_unavailable`, to retry shortly (Redis unreachable, the
    SQLite file locked by another process). Either way the store recovers by itself once mended."""
    if isinstance(error, FULL_ERRORS):
        message = SQLITE_FULL_MESSAGE if isinstance(error, StoreFull) else REDIS_FULL_MESSAGE
        return unavailable_until_mended(message, code="store_full")
    return ApiError(503, STORE_UNAVAILABLE_MESSAGE, type="server_error", code="store_unavailable",
                    headers={"Retry-After": "2"})


async def handle_store_unavailable(request: Request, error: Exception) -> Response:
    """store_unavailable's answer, logged with what the store said."""
    refused = store_unavailable(error)
    logger.warning("%s %s: %s: %s", request.method, request.url.path, refused.body.error.code, error)
    return refused.response()


async def handle_unexpected(request: Request, error: Exception) -> Response:
    """A 500 in the OpenAI shape; Starlette re-raises the error afterwards, so uvicorn logs it."""
    return ApiError(500, "the gateway failed on this request; see its log",
                    type="server_error").response()


EXCEPTION_HANDLERS = {
    ApiError: handle_api_error,
    HTTPException: handle_http_exception,
    ClientDisconnect: handle_client_disconnect,
    **dict.fromkeys(UNAVAILABLE_ERRORS, handle_store_unavailable),
    Exception: handle_unexpected,
}
