"""Records kept by the store, as msgspec Structs (stored as JSON; never pickled)."""

import re
import time
from collections.abc import Collection

import msgspec

from store.errors import InvalidName, InvalidSetting, StoreError, quoted

# NOTE: one rule for every name that becomes part of a Redis key or a path: it starts with a letter
# or digit, so "." and ".." are impossible, and has no "/" or ":".
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def validate_name(kind: str, name: str) -> str:
    """Return `name` if it is a valid tenant/adapter name, else raise InvalidName saying why."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidName(
            f"invalid {kind} name {quoted(name)}: use 1-64 characters from letters, digits, '.', '_' "
            "and '-', starting with a letter or digit"
        )
    return name


def is_valid_name(name: str) -> bool:
    """Whether `name` follows the naming rule (a lookup by any other string finds nothing)."""
    return isinstance(name, str) and _NAME_RE.fullmatch(name) is not None


def is_digest(text: str) -> bool:
    """Whether `text` is a lowercase hex sha256 (as blob digests are)."""
    return isinstance(text, str) and _DIGEST_RE.fullmatch(text) is not None


def validate_digest(digest: str) -> str:
    """Return `digest` if it is a lowercase hex sha256, else raise InvalidName."""
    if not is_digest(digest):
        raise InvalidName(f"invalid digest {quoted(digest)}: expected 64 lowercase hex characters")
    return digest


def _check_positive(field: str, value: int | float | None) -> None:
    if value is not None and not value > 0:
        raise InvalidSetting(field, f"{field} must be positive or unset (unlimited), got {value!r}")


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant: its name (the id) and its limits. None means unlimited / every model."""

    name: str
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (prompt + completion) per minute
    monthly_token_budget: int | None = None
    monthly_spend_budget_usd: float | None = None
    allowed_models: tuple[str, ...] | None = None  # base models and routes it may name
    default_route: str | None = None  # the route `model: "auto"` means; None: the server's
    strong_share: float | None = None  # learned routes: target share of strong-model calls
    # The bytes of adapter files it may store: every version of every adapter, each set of files once.
    max_adapter_bytes: int | None = None
    created_at: float = msgspec.field(default_factory=time.time)

    @property
    def incarnation(self) -> str:
        """The tenant as engines tell tenants apart (the prefix cache's key): its name and when it
        was made, so a tenant made anew under a deleted one's name hits none of its cached prompts."""
        return f"{self.name}@{self.created_at!r}"

    def __post_init__(self) -> None:
        validate_name("tenant", self.name)
        _check_positive("rpm", self.rpm)
        _check_positive("tpm", self.tpm)
        _check_positive("monthly_token_budget", self.monthly_token_budget)
        _check_positive("monthly_spend_budget_usd", self.monthly_spend_budget_usd)
        _check_positive("max_adapter_bytes", self.max_adapter_bytes)
        if self.strong_share is not None and not 0.0 <= self.strong_share <= 1.0:
            raise InvalidSetting("strong_share",
                                 f"strong_share must be in [0, 1], got {self.strong_share!r}")


# The tenant fields an update may change (store.Store.update_tenant): its limits and policy.
TENANT_SETTINGS = ("rpm", "tpm", "monthly_token_budget", "monthly_spend_budget_usd",
                   "allowed_models", "default_route", "strong_share", "max_adapter_bytes")


def check_default_route_allowed(allowed_models: Collection[str] | None,
                                default_route: str | None) -> None:
    """Refuse (InvalidSetting) a default route the tenant's own allowed_models excludes: `auto`
    would then be a 403 for it, and listed nowhere."""
    if allowed_models is not None and default_route is not None and \
            default_route not in allowed_models:
        raise InvalidSetting("default_route", f"default_route {default_route!r} is not among the "
                             f"tenant's allowed_models ({', '.join(allowed_models) or 'none'}); add "
                             "it to them, or change default_route to a route they hold or to null "
                             "(the server's default route)")


def with_settings(tenant: Tenant, changes: dict[str, object]) -> Tenant:
    """`tenant` with `changes` (field -> new value; None clears a limit) applied and validated;
    StoreError for a field that is not one of TENANT_SETTINGS or a value Tenant refuses.

    Stores call it inside the update's transaction, so the default route is checked against the
    allowed models as they are then, not as a concurrent update of the other found them."""
    unknown = sorted(set(changes) - set(TENANT_SETTINGS))
    if unknown:
        raise StoreError(f"tenant fields {unknown} cannot be changed; settings: {TENANT_SETTINGS}")
    updated = msgspec.structs.replace(tenant, **changes)
    # NOTE: only when one of the two changes: a tenant stored before the rule can still be updated.
    if "allowed_models" in changes or "default_route" in changes:
        check_default_route_allowed(updated.allowed_models, updated.default_route)
    return updated


def updated_tenant(stored: bytes, changes: dict[str, object]) -> tuple[Tenant, bytes]:
    """The tenant whose record is `stored` (JSON) with `changes` applied (see with_settings), and
    its record to store. The record keeps the fields of `stored` this version does not know: a
    newer version's, during a rolling upgrade of gateways sharing one store, which an update from
    an older one would otherwise drop (a newer limit lifted without a word)."""
    updated = with_settings(msgspec.json.decode(stored, type=Tenant), changes)
    known = {f.encode_name for f in msgspec.structs.fields(Tenant)}
    newer = {k: v for k, v in msgspec.json.decode(stored).items() if k not in known}
    return updated, msgspec.json.encode({**msgspec.to_builtins(updated), **newer})


class ApiKeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's API key as stored: only its sha256 is kept; `prefix` is shown in listings."""

    id: str
    tenant: str
    prefix: str
    key_hash: str
    created_at: float
    revoked: bool = False


class AdapterRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One uploaded version of a tenant's LoRA adapter; `digest` (store.blobs) is its identity."""

    tenant: str
    name: str
    base_model: str
    digest: str
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    version: int = 0  # assigned by Store.put_adapter_record: 1 + the latest version of the name
    created_at: float = msgspec.field(default_factory=time.time)

    def __post_init__(self) -> None:
        validate_name("tenant", self.tenant)
        validate_name("adapter", self.name)
        validate_digest(self.digest)
        _check_positive("rank", self.rank)


class RateDecision(msgspec.Struct, frozen=True):
    """The answer of a rate-limit check: on a refusal, which limit and how long to wait."""

    allowed: bool
    retry_after: float = 0.0  # seconds; > 0 when not allowed
    limited_by: str | None = None  # "rpm" or "tpm"


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """Budget held for one in-flight request until it is settled with its real counts."""

    id: str
    tenant: str
    tenant_created_at: float  # which tenant of that name: one deleted and made anew bills nothing
    month: str  # "YYYY-MM" (UTC): the month the request is billed to
    tokens: int
    spend_usd: float
    expires_at: float  # after this the hold is dropped (the gateway died before settling)


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's counters for one month; `reserved_*` are the holds of requests in flight."""

    tenant: str
    month: str
    requests: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    spend_usd: float = 0.0
    reserved_tokens: int = 0
    reserved_spend_usd: float = 0.0
