"""Bearer-key authentication: tenant keys for /v1, the admin key for /admin, the metrics key
(or the admin key) for /metrics.

The store keeps only hashes. A valid key sent where it has no permission (the admin key to /v1,
the metrics key anywhere but /metrics) is refused with 403 and what to send instead, not taken
for an unknown key.
"""

from __future__ import annotations

import logging
import secrets

from starlette.requests import Request

from gateway.errors import ApiError, unavailable_until_mended
from store import Store, Tenant
from store.keys import KEY_PREFIX, hash_key, verify_key

logger = logging.getLogger(__name__)

_ADMIN_PREFIX = KEY_PREFIX + "admin-"


def bearer_key(request: Request) -> str:
    """The key of `Authorization: Bearer <key>`, or a 401 saying what is missing."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthenticated("missing API key: send it as the header "
                               "'Authorization: Bearer <key>'")
    return key.strip()


async def authenticate_tenant(request: Request, store: Store, metrics_key_hash: str | None) -> Tenant:
    """The tenant owning the request's key; 403 for the admin key and the metrics key (valid keys,
    but no tenant's), 401 for unknown or revoked keys."""
    key = bearer_key(request)
    tenant = await store.authenticate(key)
    if tenant is not None:
        request.state.tenant = tenant.name  # for the access log and request metrics
        return tenant
    if _matches(key, await store.get_admin_key_hash()):
        raise ApiError(403, "this is the admin key, which manages tenants under /admin; create a "
                       "tenant (POST /admin/tenants) and a key for it "
                       "(POST /admin/tenants/{tenant}/keys) to call /v1",
                       type="permission_error", code="admin_key_not_allowed")
    if _matches(key, metrics_key_hash):
        raise ApiError(403, "this is the metrics key, which reads /metrics only; call /v1 with a "
                       "tenant's key (POST /admin/tenants/{tenant}/keys)",
                       type="permission_error", code="metrics_key_not_allowed")
    raise _unauthenticated("invalid API key: it is unknown or was revoked")


async def require_admin(request: Request, store: Store, metrics_key_hash: str | None) -> None:
    """Pass for the admin key; 403 for a tenant key or the metrics key, 401 for anything else
    (503 while the store holds no admin key: see _no_admin_key)."""
    key = bearer_key(request)
    admin_key_hash = await store.get_admin_key_hash()
    if _matches(key, admin_key_hash):
        return
    if _matches(key, metrics_key_hash):
        raise ApiError(403, "this endpoint needs the admin key; the metrics key reads /metrics only",
                       type="permission_error", code="admin_key_required")
    if await store.authenticate(key) is not None:
        raise ApiError(403, "this endpoint needs the admin key; tenant keys cannot manage tenants",
                       type="permission_error", code="admin_key_required")
    if admin_key_hash is None:
        raise _no_admin_key()
    raise _unauthenticated("invalid admin key")


async def require_metrics_reader(request: Request, store: Store, metrics_key_hash: str | None) -> None:
    """Pass for the metrics key (when one is set) and the admin key; 403 for a tenant key, 401
    for anything else (503 while the store holds no admin key: the key sent may be the lost
    one, whether or not a metrics key is set). The series name every tenant, which no tenant
    may see."""
    key = bearer_key(request)
    if _matches(key, metrics_key_hash):
        return
    admin_key_hash = await store.get_admin_key_hash()
    if _matches(key, admin_key_hash):
        return
    if await store.authenticate(key) is not None:
        raise ApiError(403, "/metrics needs the metrics key or the admin key: its series name every "
                       "tenant", type="permission_error", code="metrics_key_required")
    if admin_key_hash is None:
        raise _no_admin_key()
    raise _unauthenticated("invalid key for /metrics: send the metrics key (serve --metrics-key) "
                           "or the admin key")


def _no_admin_key() -> ApiError:
    """A gateway sets the admin key when it starts, so a store without one lost it (with its
    data, as a Redis restarted without persistence does): the key sent may well be the right
    one, and only the operator can put it back."""
    message = ("the store holds no admin key: it has lost its data (as a Redis restarted without "
               "its data does); restart a gateway with --admin-key (or SWITCHBOARD_ADMIN_KEY) "
               "to set it again")
    logger.warning(message)
    return unavailable_until_mended(message, code="admin_key_missing")


async def ensure_admin_key(store: Store, admin_key: str | None) -> str | None:
    """Make the store's admin key `admin_key` (when given); on a store with none, make one.

    Returns the plaintext of a newly created key, to be shown once (only its hash is kept), else
    None.
    """
    if admin_key is not None:
        await store.set_admin_key_hash(hash_key(admin_key))
        return None
    if await store.get_admin_key_hash() is not None:
        return None
    created = _ADMIN_PREFIX + secrets.token_urlsafe(32)
    # NOTE: only if still unset: a second server starting on the same fresh store at the same
    # moment must not print a key that the other's then replaces.
    return created if await store.set_admin_key_hash(hash_key(created), only_if_unset=True) else None


def _matches(key: str, key_hash: str | None) -> bool:
    """Whether `key` is the one of `key_hash` (None: no such key is set)."""
    return key_hash is not None and verify_key(key, key_hash)


def _unauthenticated(message: str) -> ApiError:
    return ApiError(401, message, type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})
