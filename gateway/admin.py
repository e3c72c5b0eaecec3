"""The admin API (admin key only): tenants, their limits and their API keys.

Key plaintexts appear exactly once, in the reply that creates them; listings show only a prefix.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import require_admin
from gateway.errors import ApiError, invalid_request, not_found, quoted, tenant_not_found
from gateway.path_route import PathRoute
from gateway.serving import decode_body
from gateway.state import gateway_state
from store import (AlreadyExists, ApiKeyRecord, InvalidName, NotFound, Store, StoreError, Tenant,
                   Usage)
from store.blobs import collect_garbage
from store.limits import MIN_SPEND_BUDGET_USD
from store.models import TENANT_SETTINGS, check_default_route_allowed


# The bounds of a tenant's settings, for creating and updating one alike.
# NOTE: at most 2^53, the largest integer a float holds exactly: rate buckets count in floats.
_Limit = Annotated[int, msgspec.Meta(gt=0, le=2**53)]
# NOTE: at least a micro-dollar: spend within SPEND_TOLERANCE_USD of a budget counts as at it, so
# a budget below that was used up at $0, refusing every call, free ones too.
_SpendLimit = Annotated[float, msgspec.Meta(ge=MIN_SPEND_BUDGET_USD)]
_Share = Annotated[float, msgspec.Meta(ge=0, le=1)]
_MONTH = re.compile(r"[0-9]{4}-(0[1-9]|1[0-2])")  # "YYYY-MM", as store.limits.month_of writes it


class TenantCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /admin/tenants. Limits left out (or null) are unlimited; a field this API does not
    know is refused, since a misspelt limit would leave the tenant unlimited."""

    name: str
    rpm: _Limit | None = None
    tpm: _Limit | None = None
    monthly_token_budget: _Limit | None = None
    monthly_spend_budget_usd: _SpendLimit | None = None
    allowed_models: list[str] | None = None
    default_route: str | None = None
    strong_share: _Share | None = None
    max_adapter_bytes: _Limit | None = None


class TenantUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """PATCH /admin/tenants/{tenant}: only the fields sent change; null makes a limit unlimited
    (and allowed_models every model, default_route the server's). The name cannot change."""

    rpm: _Limit | None | msgspec.UnsetType = msgspec.UNSET
    tpm: _Limit | None | msgspec.UnsetType = msgspec.UNSET
    monthly_token_budget: _Limit | None | msgspec.UnsetType = msgspec.UNSET
    monthly_spend_budget_usd: _SpendLimit | None | msgspec.UnsetType = msgspec.UNSET
    allowed_models: list[str] | None | msgspec.UnsetType = msgspec.UNSET
    default_route: str | None | msgspec.UnsetType = msgspec.UNSET
    strong_share: _Share | None | msgspec.UnsetType = msgspec.UNSET
    max_adapter_bytes: _Limit | None | msgspec.UnsetType = msgspec.UNSET


class KeyInfo(msgspec.Struct, kw_only=True):
    """A key as listed: never its plaintext or hash."""

    id: str
    prefix: str
    created_at: float
    revoked: bool


class TenantDetail(msgspec.Struct, kw_only=True):
    tenant: Tenant
    keys: list[KeyInfo]
    usage: Usage
    adapter_bytes: int  # the adapter files it stores, as its max_adapter_bytes counts them


class CreatedKey(msgspec.Struct, kw_only=True):
    """A new key: `key` is its plaintext, shown this once."""

    id: str
    key: str
    tenant: str
    prefix: str
    created_at: float


class TenantList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[Tenant]


def _json(payload: msgspec.Struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status, media_type="application/json")


async def _admin_store(request: Request) -> Store:
    state = gateway_state(request)
    store = state.require_store()
    await require_admin(request, store, state.metrics_key_hash)
    return store


async def create_tenant(request: Request) -> Response:
    """Create a tenant with its rate limits and monthly budgets."""
    store = await _admin_store(request)
    body = await decode_body(request, TenantCreate)
    _check_policy(request, body.allowed_models, body.default_route)
    allowed = None if body.allowed_models is None else _once_each(body.allowed_models)
    try:
        check_default_route_allowed(body.allowed_models, body.default_route)
        tenant = Tenant(name=body.name, rpm=body.rpm, tpm=body.tpm,
                        monthly_token_budget=body.monthly_token_budget,
                        monthly_spend_budget_usd=body.monthly_spend_budget_usd,
                        allowed_models=allowed, default_route=body.default_route,
                        strong_share=body.strong_share, max_adapter_bytes=body.max_adapter_bytes)
        created = await store.create_tenant(tenant)
    except AlreadyExists as error:
        raise ApiError(409, str(error), code="tenant_exists") from None
    except InvalidName as error:
        raise invalid_request(str(error), param="name") from None
    except StoreError as error:  # a setting Tenant refuses names its field
        raise invalid_request(str(error), param=error.field) from None
    return _json(created, 201)


async def update_tenant(request: Request) -> Response:
    """Change some of a tenant's limits and policy: the fields sent change (null makes a limit
    unlimited again), the others stay. Its keys, adapters and usage stay."""
    store = await _admin_store(request)
    body = await decode_body(request, TenantUpdate)
    changes = {f: getattr(body, f) for f in body.__struct_fields__
               if getattr(body, f) is not msgspec.UNSET}
    if not changes:
        raise invalid_request(f"send at least one of {', '.join(TENANT_SETTINGS)} to change")
    _check_policy(request, changes.get("allowed_models"), changes.get("default_route"))
    name = request.path_params["tenant"]
    if changes.get("allowed_models") is not None:
        changes["allowed_models"] = _once_each(changes["allowed_models"])
    try:
        return _json(await store.update_tenant(name, changes))
    except NotFound:
        raise tenant_not_found(name) from None
    except StoreError as error:  # a setting Tenant refuses names its field
        raise invalid_request(str(error), param=error.field) from None


def _once_each(models: list[str]) -> tuple[str, ...]:
    """The models in the order given, each once (a set that reads back as it was sent)."""
    return tuple(dict.fromkeys(models))


def _check_policy(request: Request, allowed_models: list[str] | None,
                  default_route: str | None) -> None:
    """Refuse names this server does not serve: a misspelt model would silently lock a tenant out
    of it, and a misspelt default route would leave `auto` meaning nothing."""
    state = gateway_state(request)
    if default_route is not None and default_route not in state.routes:
        raise invalid_request(f"default_route {default_route!r} is not a route of this "
                              f"server (routes: {', '.join(state.routes) or 'none'})",
                              param="default_route")
    known = [*state.engines, *state.routes]
    unknown = [m for m in allowed_models or () if m not in known]
    if unknown:
        served = (f"the base models and routes {', '.join(known)}" if known
                  else "no base model or route now")
        raise invalid_request(f"allowed_models names {', '.join(map(repr, unknown))}, which this "
                              f"server does not serve; it serves {served}", param="allowed_models")


async def list_tenants(request: Request) -> Response:
    """List every tenant with its limits."""
    store = await _admin_store(request)
    return _json(TenantList(data=await store.list_tenants()))


async def get_tenant(request: Request) -> Response:
    """One tenant: its limits, its keys (prefixes only), its usage this month, or in the (UTC)
    month `?month=YYYY-MM`, and the bytes of adapter files it stores."""
    store = await _admin_store(request)
    name = request.path_params["tenant"]
    month = _month_param(request)
    tenant = await store.get_tenant(name)
    if tenant is None:
        raise tenant_not_found(name)
    keys = [_key_info(k) for k in await store.list_keys(name)]
    return _json(TenantDetail(tenant=tenant, keys=keys, usage=await store.get_usage(name, month),
                              adapter_bytes=sum((await store.get_adapter_files(name)).values())))


def _month_param(request: Request) -> str | None:
    month = request.query_params.get("month")
    if month is not None and not _MONTH.fullmatch(month):
        raise invalid_request(f"month must be a month as YYYY-MM, like 2025-03, got {quoted(month)}",
                              param="month")
    return month


async def delete_tenant(request: Request) -> Response:
    """Delete a tenant with its keys, adapters, rate limits and usage: a tenant made anew under
    the name starts from nothing, and calls of this one still running bill nothing."""
    store = await _admin_store(request)
    name = request.path_params["tenant"]
    try:
        removed = await store.delete_tenant(name)
    except NotFound:
        raise tenant_not_found(name) from None
    await collect_garbage(gateway_state(request).blobs, store, sorted({r.digest for r in removed}))
    return Response(msgspec.json.encode({"name": name, "deleted": True}),
                    media_type="application/json")


async def create_key(request: Request) -> Response:
    """Create an API key for a tenant; the reply holds its plaintext, shown only this once."""
    store = await _admin_store(request)
    name = request.path_params["tenant"]
    try:
        record, plaintext = await store.create_key(name)
    except NotFound:
        raise tenant_not_found(name) from None
    return _json(CreatedKey(id=record.id, key=plaintext, tenant=record.tenant,
                            prefix=record.prefix, created_at=record.created_at), 201)


async def revoke_key(request: Request) -> Response:
    """Revoke an API key; requests with it get 401 from then on."""
    store = await _admin_store(request)
    key_id = request.path_params["key_id"]
    try:
        record = await store.revoke_key(key_id)
    except NotFound:
        raise not_found(f"API key {quoted(key_id)} does not exist", code="key_not_found") from None
    return _json(_key_info(record))


def _key_info(record: ApiKeyRecord) -> KeyInfo:
    return KeyInfo(id=record.id, prefix=record.prefix, created_at=record.created_at,
                   revoked=record.revoked)


ROUTES = [
    PathRoute("/admin/tenants", {"POST": create_tenant, "GET": list_tenants}),
    PathRoute("/admin/tenants/{tenant}", {"GET": get_tenant, "PATCH": update_tenant,
                                          "DELETE": delete_tenant}),
    PathRoute("/admin/tenants/{tenant}/keys", {"POST": create_key}),
    PathRoute("/admin/keys/{key_id}", {"DELETE": revoke_key}),
]
