"""Rate-limit, budget and adapter-storage arithmetic shared by the backends (the Redis Lua
scripts mirror the first two).

Rate limits are token buckets, one per (tenant, kind): a bucket holds at most `limit` units and
refills at `limit` per minute, so a full bucket allows exactly `limit` requests (or tokens) at once
and then `limit` per minute; a request is allowed only if every bucket can pay its cost, and then
all of them pay.
"""

import math
import secrets
import time
from collections.abc import Iterable
from datetime import UTC, datetime

from store.errors import AdapterStorageExceeded, StoreError
from store.models import AdapterRecord, RateDecision, Reservation, Tenant, Usage

WINDOW_S = 60.0
# Spend is float dollars, summed one call at a time, so a budget met exactly can come out a rounding
# error over it ($0.1 + $0.1 + $0.1 > $0.3): spend within this of the budget counts as at it. It is
# far below a micro-dollar, so what it lets through is never worth a cent.
SPEND_TOLERANCE_USD = 1e-9
MIN_SPEND_BUDGET_USD = 1e-6  # a spend budget below it is all tolerance: used up at $0


def now_or(now: float | None) -> float:
    """`now` if given, else the wall clock (tests and callers pass `now` to pin time)."""
    return time.time() if now is None else now


def month_of(now: float) -> str:
    """The UTC month ("YYYY-MM") that usage at time `now` is billed to."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m")


def months_in_flight(now: float) -> tuple[str, str]:
    """The months a call still running at `now` may bill: this one, and the one before (a call
    that began before the month turned)."""
    this_month = month_of(now)
    first_day = datetime.strptime(this_month, "%Y-%m").replace(tzinfo=UTC).timestamp()
    return this_month, month_of(first_day - 1)


def rate_costs(tenant: Tenant, requests: int, tokens: int) -> dict[str, tuple[int, int]]:
    """{kind: (limit, cost)} for the buckets a request of this size must pay into (a negative
    cost gives back what a call refused after admission paid)."""
    costs = {}
    if tenant.rpm is not None and requests != 0:
        costs["rpm"] = (tenant.rpm, requests)
    if tenant.tpm is not None and tokens != 0:
        costs["tpm"] = (tenant.tpm, tokens)
    return costs


def take(
    costs: dict[str, tuple[int, int]],
    buckets: dict[str, tuple[float, float]],
    now: float,
    overdraw: bool = False,
) -> tuple[RateDecision, dict[str, tuple[float, float]]]:
    """Try to pay `costs` from `buckets` ({kind: (level, updated_at)}, missing = full).

    Returns the decision and, when allowed, the buckets to store. A cost above its limit is never
    allowed; its retry_after is then one window (the gateway should reject such a request as too
    large by comparing with the tenant's limit). With `overdraw`, every cost is paid, a bucket
    that lacks it going below empty (it then refills from there).
    """
    new_buckets = {}
    retry_after, limited_by = 0.0, None
    for kind, (limit, cost) in costs.items():
        level, updated_at = buckets.get(kind, (float(limit), now))
        # NOTE: a clock behind the stored one (another gateway process) refills nothing.
        level = min(float(limit), level + max(0.0, now - updated_at) * limit / WINDOW_S)
        if level < cost and not overdraw:
            wait = WINDOW_S if cost > limit else (cost - level) * WINDOW_S / limit
            if wait > retry_after:
                retry_after, limited_by = wait, kind
        new_buckets[kind] = (min(float(limit), level - cost), max(updated_at, now))
    if limited_by is not None:
        return RateDecision(False, retry_after, limited_by), {}
    return RateDecision(True), new_buckets


def budget_allows(tenant: Tenant, usage: Usage, tokens: int, spend_usd: float) -> bool:
    """Whether the month's budgets cover `usage` (held reservations included) plus this request.

    NOTE: a spend budget that is used up refuses even requests estimated at $0.
    """
    if tenant.monthly_token_budget is not None:
        used = usage.tokens_in + usage.tokens_out + usage.reserved_tokens
        if used + tokens > tenant.monthly_token_budget:
            return False
    budget_usd = tenant.monthly_spend_budget_usd
    if budget_usd is not None:
        spent = usage.spend_usd + usage.reserved_spend_usd
        is_used_up = spent >= budget_usd - SPEND_TOLERANCE_USD
        if is_used_up or spent + spend_usd > budget_usd + SPEND_TOLERANCE_USD:
            return False
    return True


def budget_left(tenant: Tenant, usage: Usage) -> tuple[float, float]:
    """The tokens and spend this month's budgets leave beside what is used and held (inf where
    unlimited; below 0 where calls in flight hold more than is left)."""
    tokens = spend_usd = math.inf
    if tenant.monthly_token_budget is not None:
        used = usage.tokens_in + usage.tokens_out + usage.reserved_tokens
        tokens = tenant.monthly_token_budget - used
    if tenant.monthly_spend_budget_usd is not None:
        spend_usd = tenant.monthly_spend_budget_usd - usage.spend_usd - usage.reserved_spend_usd
    return tokens, spend_usd


def new_reservation(
    tenant: Tenant, tokens: int, spend_usd: float, now: float, ttl_s: float
) -> Reservation:
    """A hold of `tokens` and `spend_usd` on this month's budgets, lapsing after `ttl_s`."""
    if tokens < 0 or spend_usd < 0 or ttl_s <= 0:
        raise StoreError(
            f"cannot reserve tokens={tokens}, spend_usd={spend_usd}, ttl_s={ttl_s}: "
            "amounts must be >= 0 and the ttl > 0"
        )
    return Reservation(
        id=secrets.token_hex(8),
        tenant=tenant.name,
        tenant_created_at=tenant.created_at,
        month=month_of(now),
        tokens=tokens,
        spend_usd=spend_usd,
        expires_at=now + ttl_s,
    )


def stored_files(records: Iterable[AdapterRecord]) -> dict[str, int]:
    """{digest: size in bytes} of the files `records` reference: files that several versions or
    adapters share are stored once, so they count once."""
    return {r.digest: r.size_bytes for r in records}


def check_adapter_storage(tenant: Tenant, stored: dict[str, int], record: AdapterRecord) -> None:
    """Refuse (AdapterStorageExceeded) `record` if its files would take `tenant` past its
    max_adapter_bytes; `stored`: stored_files of the tenant's records. Files it stores already
    add nothing, so storing them again always passes (also past a limit lowered since)."""
    limit = tenant.max_adapter_bytes
    if limit is None or record.digest in stored:
        return
    stored_bytes = sum(stored.values())
    if stored_bytes + record.size_bytes > limit:
        raise AdapterStorageExceeded(tenant.name, stored_bytes, record.size_bytes, limit)
