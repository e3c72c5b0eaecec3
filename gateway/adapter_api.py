"""The adapter API: tenants upload, list, read and delete their LoRA adapters; the admin, anyone's.

`/v1/adapters...` act on the caller's own tenant (a tenant key), `/admin/tenants/{tenant}/adapters...`
on any tenant (the admin key); an upload with a tenant key is a request against its rpm. An upload
is validated in full (form, size, name, base model, and the engine's PEFT checks against that base
model) before anything is stored; then its files go to the content-addressed blob folder (and,
with Redis, to the store's shared copy, from which other gateways fetch them) and its record to
the store, as the next version of its name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.admission import charge_request, refund_request
from gateway.auth import authenticate_tenant, require_admin
from gateway.engine_client import AdapterRejected, EngineFailure, WorkersOutOfSpace
from gateway.errors import (ApiError, invalid_request, not_found, quoted, refused_when_out_of_space,
                           tenant_not_found, unavailable_until_mended)
from gateway.path_route import Endpoint, PathRoute
from gateway.state import GatewayState, gateway_state
from gateway.uploads import ADAPTER_FOLDER, RECEIVE, AdapterUpload, read_adapter_upload
from routing.models import adapter_base_models, allowed_routes, tenant_adapter_id
from routing.routes import AUTO
from store import (UNAVAILABLE_ERRORS, AdapterRecord, AdapterStorageExceeded, InvalidName, NotFound,
                   Store, StoreError, Tenant)
from store.blobs import ADAPTER_FILES, collect_garbage, digest_files
from store.models import is_valid_name, validate_name

logger = logging.getLogger(__name__)


class AdapterObject(msgspec.Struct, kw_only=True):
    """An adapter as the API shows it: `id` is its name, which its paths take; `model` is what
    calls send to use its latest version, as /v1/models lists it: the name, `base:name` once a
    served model or route took the name, or `route:name` for a tenant whose policy allows its
    base model only through a route."""

    id: str
    model: str
    object: str = "adapter"
    tenant: str
    base_model: str
    version: int
    digest: str
    rank: int
    target_modules: list[str]
    size_bytes: int
    created_at: int

    @classmethod
    def of(cls, record: AdapterRecord, tenant: Tenant, state: GatewayState) -> "AdapterObject":
        return cls(id=record.name, model=tenant_adapter_id(tenant, state.catalog, record),
                   tenant=record.tenant, base_model=record.base_model,
                   version=record.version, digest=record.digest, rank=record.rank,
                   target_modules=list(record.target_modules), size_bytes=record.size_bytes,
                   created_at=int(record.created_at))


class AdapterList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[AdapterObject]


class AdapterDeleted(msgspec.Struct, kw_only=True):
    id: str
    object: str = "adapter"
    deleted: bool = True
    versions: int


def _json(payload: msgspec.Struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status, media_type="application/json")


async def _caller_tenant(request: Request) -> Tenant:
    state = gateway_state(request)
    return await authenticate_tenant(request, state.require_store(), state.metrics_key_hash)


async def _named_tenant(request: Request) -> Tenant:
    """The tenant of the path, for the admin key only."""
    state = gateway_state(request)
    store = state.require_store()
    await require_admin(request, store, state.metrics_key_hash)
    name = request.path_params["tenant"]
    tenant = await store.get_tenant(name)
    if tenant is None:
        raise tenant_not_found(name)
    return tenant


def _not_a_base_model(state: GatewayState, tenant: Tenant, name: str) -> str:
    """Why `name` takes no adapters, and which models `tenant` may upload them for: a tenant
    allowed only routes sees no base model in /v1/models (its adapters run as route:adapter)."""
    choices = _adapter_choices(state, tenant)
    if name in allowed_routes(tenant, state.catalog):
        return (f"{quoted(name)} is a route, not a base model: upload the adapter for one of its "
                f"models, and call it as {name}:NAME; {choices}")
    if name in state.routes:  # NOTE: not "call it as route:NAME", which would answer 403
        return f"{quoted(name)} is a route your tenant's policy does not allow; {choices}"
    return f"unknown base model {quoted(name)}; {choices}"


def _adapter_choices(state: GatewayState, tenant: Tenant) -> str:
    """The base models `tenant` may upload adapters for and that run adapters now (not those of
    an upstream API, nor those served without adapter slots), as the end of a refusal."""
    uploadable = [m for m in adapter_base_models(tenant, state.catalog)
                  if (engine := state.engines.get(m)) is not None and engine.supports_adapters]
    return (f"the base models you may upload adapters for are {', '.join(uploadable)}"
            if uploadable else "you may upload adapters for no base model served now")


def _upload_as(resolve_tenant: Callable[[Request], Awaitable[Tenant]], *, is_counted: bool,
               name: str) -> Endpoint:
    """The upload endpoint `name` for the tenant `resolve_tenant` finds for the request;
    `is_counted`: each upload is a request against the tenant's rpm (its own key's are; the
    admin's are not)."""
    async def upload(request: Request) -> Response:
        """Validate an uploaded adapter, then store it as the next version of its name (201)."""
        tenant = await resolve_tenant(request)
        if not is_counted:
            return await _upload(request, tenant, resolve_tenant)
        store = gateway_state(request).require_store()
        # NOTE: before the body is read: a tenant past its rpm sends no more megabytes to check.
        await charge_request(store, tenant)
        try:
            return await _upload(request, tenant, resolve_tenant)
        except (ApiError, asyncio.CancelledError):
            # Refused, as an API call refused costs no rpm; or stopped by a shutdown's deadline,
            # which tells the client to send it again.
            await refund_request(store, tenant)
            raise

    upload.__name__ = name
    return upload


async def _upload(request: Request, tenant: Tenant,
                  resolve_tenant: Callable[[Request], Awaitable[Tenant]]) -> Response:
    state = gateway_state(request)

    async def confirm_upload() -> None:
        # The body may stream in for minutes: a key revoked or a tenant deleted (and maybe made
        # anew under its name) meanwhile must store nothing.
        if (await resolve_tenant(request)).created_at != tenant.created_at:
            raise not_found(f"tenant {tenant.name!r} was deleted while the adapter was uploaded",
                            code="tenant_not_found")
        # Checking a large adapter takes seconds: a client that left meanwhile (timed out, or
        # stopped an upload of the wrong files) must not find them served as the new version.
        # A 499, as for one that leaves while sending its body.
        if await request.is_disconnected():
            raise ClientDisconnect()

    async with read_adapter_upload(request, state.max_upload_bytes, state.blobs.root) as uploaded:
        record = await _store_adapter(state, tenant, uploaded, confirm_upload)
    return _json(AdapterObject.of(record, tenant, state), 201)


async def _store_adapter(state: GatewayState, tenant: Tenant, uploaded: AdapterUpload,
                         confirm_upload: Callable[[], Awaitable[None]]) -> AdapterRecord:
    try:
        validate_name("adapter", uploaded.name)
    except InvalidName as error:
        raise invalid_request(str(error), param="name", code="invalid_name") from None
    if uploaded.name in state.engines:
        raise invalid_request(f"{uploaded.name!r} is the name of a served base model; give the "
                              "adapter another name", param="name", code="invalid_name")
    if uploaded.name == AUTO or uploaded.name in state.routes:
        # `model` names a route before an adapter: one of this name could never be reached by it.
        # AUTO is kept even on a server with no routes yet, which may get them at its next start.
        what = "the name of a route" if uploaded.name in state.routes else \
            f"kept for routing (`model: {AUTO}` picks a tenant's default route)"
        raise invalid_request(f"{uploaded.name!r} is {what}; give the adapter another name",
                              param="name", code="invalid_name")
    engine = state.engines.get(uploaded.base_model)
    if engine is None:
        raise invalid_request(_not_a_base_model(state, tenant, uploaded.base_model),
                              param="base_model", code="model_not_found")
    if uploaded.base_model not in adapter_base_models(tenant, state.catalog):
        raise ApiError(403, f"your tenant's policy allows neither the base model "
                       f"{quoted(uploaded.base_model)} nor a route over it, so it takes none of "
                       "your adapters; GET /v1/models lists the models and routes you can use",
                       param="base_model", type="permission_error", code="model_not_allowed")
    await _refuse_past_storage_limit(state.require_store(), tenant, uploaded.folder)
    try:
        if not engine.supports_adapters:
            await engine.ensure_available()  # no worker up at all: a 503, retried later
            raise invalid_request(f"{uploaded.base_model!r} {engine.why_no_adapters}; "
                                  f"{_adapter_choices(state, tenant)}",
                                  param="base_model", code="adapters_not_served")
        info = await engine.check_adapter(str(uploaded.folder))
    except AdapterRejected as error:
        raise invalid_request(f"the adapter is not valid for {uploaded.base_model!r}: {error}",
                              code="invalid_adapter") from None
    except WorkersOutOfSpace as error:
        raise unavailable_until_mended(f"cannot check the adapter: {error}", code="disk_full") from None
    except EngineFailure as error:  # e.g. no engine worker of the model is up to check it
        raise ApiError(503, f"cannot check the adapter now: {error}", type="server_error",
                       code="engine_unavailable", headers={"Retry-After": "2"}) from None
    digest, size = await _place_files(state, uploaded.folder)
    record = AdapterRecord(tenant=tenant.name, name=uploaded.name, base_model=uploaded.base_model,
                           digest=digest, rank=info.rank, target_modules=tuple(info.target_modules),
                           size_bytes=size)
    try:
        return await _record_adapter(state, record, uploaded.folder, confirm_upload)
    except Exception as error:
        # Refused after its files were placed (the tenant was deleted meanwhile, the store was
        # locked or failed): no record references them, so they must not linger.
        await _drop_unrecorded_files(state, digest)
        if isinstance(error, NotFound):
            raise tenant_not_found(tenant.name) from None
        if isinstance(error, AdapterStorageExceeded):
            raise _storage_exceeded(error) from None
        raise


async def _refuse_past_storage_limit(store: Store, tenant: Tenant, folder: Path) -> None:
    """A 403 for an upload whose files would take its tenant past max_adapter_bytes as the tenant
    stands now, before an engine reads them to check them and they are placed in the blob folder
    and Redis (where a large one could fill the store for every tenant, only to be taken out
    again). Files the tenant stores already add nothing, so an upload of those goes on; files
    only another tenant stores count in full, as the store's check counts them: waiving those
    would tell the tenant, by a slower answer or another error, that someone stores them. The
    store's check, in the record's write, still decides: uploads in flight together pass this
    one each."""
    limit = tenant.max_adapter_bytes
    if limit is None:
        return
    size = sum((folder / name).stat().st_size for name in ADAPTER_FILES)
    stored = await store.get_adapter_files(tenant.name)
    stored_bytes = sum(stored.values())
    if stored_bytes + size <= limit:
        return
    digest = await asyncio.to_thread(digest_files, folder)  # only an upload it may refuse
    if digest not in stored:
        raise _storage_exceeded(AdapterStorageExceeded(tenant.name, stored_bytes, size, limit))


def _storage_exceeded(error: AdapterStorageExceeded) -> ApiError:
    """The 403 for an upload past its tenant's max_adapter_bytes: not a 429, which SDKs retry,
    since no wait makes room; deleting adapters or a higher limit does."""
    return ApiError(
        403, f"tenant {error.tenant!r} stores {error.stored_bytes} bytes of adapter files (every "
        f"version of each adapter; files several share count once) and this upload adds "
        f"{error.size_bytes}, past its limit of {error.limit_bytes} bytes (max_adapter_bytes): "
        "delete adapters it no longer needs (DELETE /v1/adapters/{name} deletes every version of "
        "one), or ask the operator to raise max_adapter_bytes",
        type="insufficient_quota", code="adapter_storage_exceeded")


async def _drop_unrecorded_files(state: GatewayState, digest: str) -> None:
    """Delete the blob `digest` unless a record references it (another upload of the same files)."""
    try:
        await collect_garbage(state.blobs, state.require_store(), [digest])
    except (StoreError, *UNAVAILABLE_ERRORS) as error:
        # NOTE: kept where the store cannot tell whether a record references it: deleting the
        # files of a stored adapter would break it. The next start's sweep collects them.
        logger.warning("kept the files of refused upload %s: %s", digest, error)


async def _record_adapter(state: GatewayState, record: AdapterRecord, folder: Path,
                          confirm_upload: Callable[[], Awaitable[None]]) -> AdapterRecord:
    """Store `record` as the next version of its name, its files (those of `folder`) in place."""
    store = state.require_store()
    # NOTE: held until the record references the blob: a delete of another record with the same
    # files may have collected it since our put, but none can from here on (see collect_garbage).
    async with state.blobs.locks.hold(record.digest):
        if state.blobs.path(record.digest) is None:
            await _place_files(state, folder)
        # Before the record: other gateways fetch the files as soon as they can see it.
        await _share_files(store, record.digest, folder)
        await confirm_upload()
        stored = await store.put_adapter_record(record)
    # Another gateway's delete may have dropped the shared copy between our put and our record;
    # the record now keeps it from any other (see SharedBlobs.delete_unreferenced), so put it back.
    await _share_files(store, record.digest, folder)  # a no-op unless it was dropped
    return stored


async def _place_files(state: GatewayState, folder: Path) -> tuple[str, int]:
    """Store the upload's files (staged in `folder`) in the blob folder: (digest, bytes).
    A 503 `disk_full` where its volume has no room left for them."""
    # NOTE: staged under the blob root, so the files are linked into place, not copied; the
    # folder they are linked in still takes an inode, and a directory entry.
    with refused_when_out_of_space(RECEIVE, ADAPTER_FOLDER, state.blobs.root):
        return await asyncio.to_thread(state.blobs.put, folder, link=True)


async def _share_files(store: Store, digest: str, folder: Path) -> None:
    """Keep the files in the store too, where it has shared copies, for every gateway to fetch."""
    if store.shared_blobs is not None:
        await store.shared_blobs.put_files(digest, folder)


async def list_adapters(request: Request, tenant: Tenant) -> Response:
    """The latest version of each of the tenant's adapters."""
    state = gateway_state(request)
    records = await state.require_store().list_adapters(tenant.name)
    return _json(AdapterList(data=[AdapterObject.of(r, tenant, state) for r in records]))


async def get_adapter(request: Request, tenant: Tenant) -> Response:
    """One adapter: its latest version, or `?version=N`."""
    name = request.path_params["name"]
    version = _version_param(request)
    state = gateway_state(request)
    record = await state.require_store().get_adapter(tenant.name, name, version) \
        if is_valid_name(name) else None
    if record is None:
        which = f"version {version} of " if version is not None else ""
        raise not_found(f"{which}adapter {quoted(name)} does not exist", code="adapter_not_found")
    return _json(AdapterObject.of(record, tenant, state))


async def delete_adapter(request: Request, tenant: Tenant) -> Response:
    """Delete every version of an adapter, and the files no other record shares."""
    if "version" in request.query_params:  # it would be a guess that it deletes that one alone
        raise invalid_request("DELETE removes every version of an adapter, so it takes no "
                              "version; send it without one", param="version")
    state = gateway_state(request)
    store = state.require_store()
    name = request.path_params["name"]
    try:
        if not is_valid_name(name):
            raise NotFound(name)
        removed = await store.delete_adapter(tenant.name, name)
    except NotFound:
        raise not_found(f"adapter {quoted(name)} does not exist", code="adapter_not_found") from None
    await collect_garbage(state.blobs, store, sorted({r.digest for r in removed}))
    return _json(AdapterDeleted(id=name, versions=len(removed)))


def _version_param(request: Request) -> int | None:
    text = request.query_params.get("version")
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 18) or int(text) < 1:  # fits int64
        raise invalid_request(f"version must be a positive integer, got {quoted(text)}", param="version")
    return int(text)


def _as(resolve_tenant: Callable[[Request], Awaitable[Tenant]],
        handler: Callable[[Request, Tenant], Awaitable[Response]], *, name: str) -> Endpoint:
    """The endpoint `name` running `handler` for the tenant `resolve_tenant` finds for the request."""
    async def endpoint(request: Request) -> Response:
        return await handler(request, await resolve_tenant(request))

    endpoint.__name__ = name
    endpoint.__doc__ = handler.__doc__
    return endpoint


# The multipart body of the upload routes, for the OpenAPI document.
UPLOAD_FORM_SCHEMA = {
    "type": "object",
    "required": ["name", "base_model"],
    "properties": {
        "name": {"type": "string", "description": "the adapter's name: what clients send as model"},
        "base_model": {"type": "string", "description": "the served base model it was trained on"},
        "adapter_config.json": {"type": "string", "format": "binary"},
        "adapter_model.safetensors": {"type": "string", "format": "binary"},
        "file": {"type": "string", "format": "binary",
                 "description": "instead of the two files: a .tar.gz of the adapter folder"},
    },
}
UPLOAD_PATHS = ("/v1/adapters", "/admin/tenants/{tenant}/adapters")

ROUTES = [
    PathRoute("/v1/adapters", {
        "POST": _upload_as(_caller_tenant, is_counted=True, name="upload_adapter"),
        "GET": _as(_caller_tenant, list_adapters, name="list_adapters")}),
    PathRoute("/v1/adapters/{name}", {
        "GET": _as(_caller_tenant, get_adapter, name="get_adapter"),
        "DELETE": _as(_caller_tenant, delete_adapter, name="delete_adapter")}),
    PathRoute("/admin/tenants/{tenant}/adapters", {
        "POST": _upload_as(_named_tenant, is_counted=False, name="admin_upload_adapter"),
        "GET": _as(_named_tenant, list_adapters, name="admin_list_adapters")}),
    PathRoute("/admin/tenants/{tenant}/adapters/{name}", {
        "GET": _as(_named_tenant, get_adapter, name="admin_get_adapter"),
        "DELETE": _as(_named_tenant, delete_adapter, name="admin_delete_adapter")}),
]
