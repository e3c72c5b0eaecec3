"""The `Store` protocol: everything the gateway keeps outside the engine, behind one interface.

Two backends implement it: store.sqlite (embedded default) and store.redis (several gateway
processes). Lookups return None for what does not exist; writes raise store.errors exceptions.
Times (`now`) are unix seconds; None means the wall clock.
"""

from pathlib import Path
from typing import Protocol

import msgspec

from store.models import AdapterRecord, ApiKeyRecord, RateDecision, Reservation, Tenant, Usage


class SharedBlobs(Protocol):
    """Adapter files (store.blobs) kept in the store itself, so that every gateway sharing the
    store can serve every adapter; each gateway's blob folder is a cache in front of them."""

    async def put_files(self, digest: str, folder: Path) -> None:
        """Keep the adapter files of `folder`, whose digest is `digest`; a no-op if kept already.
        Readers see all of them or none."""

    async def fetch_into(self, digest: str, folder: Path) -> bool:
        """Write the files kept under `digest` into the empty `folder`; False if none are kept.
        StoreError if they are incomplete; the caller checks their digest (BlobStore.put)."""

    async def delete_unreferenced(self, digest: str) -> bool:
        """Delete the files kept under `digest` unless an adapter record references it (checked
        atomically with the delete); whether they were deleted."""

    async def drop(self, digest: str) -> None:
        """Delete the files kept under `digest`, referenced or not: they are damaged, and the
        next upload of the same files keeps them anew."""


# How the id of a store that keeps shared copies of its adapter files begins (Store.get_store_id).
SHARED_STORE_ID_PREFIX = "shared-"


class Store(Protocol):
    """Tenants, hashed API keys, adapter records, rate limits, budgets and usage."""

    # Adapter files every process sharing the store reaches (Redis); None where each process's
    # blob folder is the only copy (SQLite: one machine).
    shared_blobs: SharedBlobs | None

    async def close(self) -> None:
        """Release connections and threads."""

    async def ensure_writable(self) -> None:
        """Return once the store takes writes; one of store.UNAVAILABLE_ERRORS if it cannot now
        (Redis cannot be reached or is full, another process holds the SQLite file's write lock,
        the SQLite file's volume is full): a real write, so that a full store shows."""

    # Tenants.

    async def create_tenant(self, tenant: Tenant) -> Tenant:
        """Store a new tenant; AlreadyExists if its name is taken."""

    async def get_tenant(self, name: str) -> Tenant | None:
        """The tenant called `name`, or None."""

    async def list_tenants(self) -> list[Tenant]:
        """All tenants, sorted by name."""

    async def update_tenant(self, name: str, changes: dict[str, object]) -> Tenant:
        """Apply `changes` to the tenant's settings at once (store.models.with_settings) and
        return it as stored; NotFound if missing. Keys already cached see it at once."""

    async def delete_tenant(self, name: str) -> list[AdapterRecord]:
        """Delete a tenant with its keys, adapter records and rate state; NotFound if missing.

        Returns the adapter records removed, so the caller can collect their blobs. Its usage
        goes too, so that a tenant made anew under the name starts from nothing.
        """

    # API keys.

    async def create_key(self, tenant: str, now: float | None = None) -> tuple[ApiKeyRecord, str]:
        """A new key for `tenant` (NotFound if missing): its record and plaintext, shown once."""

    async def authenticate(self, plaintext: str) -> Tenant | None:
        """The tenant owning this key, or None if the key is unknown or revoked."""

    async def revoke_key(self, key_id: str) -> ApiKeyRecord:
        """Mark a key revoked (NotFound if missing) and return its record."""

    async def list_keys(self, tenant: str) -> list[ApiKeyRecord]:
        """The tenant's keys, revoked ones included, oldest first."""

    async def get_admin_key_hash(self) -> str | None:
        """The sha256 (store.keys.hash_key) of the admin key, or None if none is set."""

    async def get_store_id(self) -> str:
        """This store's id: random, made on the first call, the same for good after. An adapter
        folder names the store whose files it keeps (store.blobs.BlobStore.claim). It begins
        with SHARED_STORE_ID_PREFIX for a store with shared_blobs (its folders hold copies of
        those files)."""

    async def set_admin_key_hash(self, key_hash: str, *, only_if_unset: bool = False) -> bool:
        """Replace the admin key's hash (`only_if_unset`: store it only if none is set, in one
        atomic step, so that of two servers starting at once one key wins); whether it was."""

    # Adapter records.

    async def put_adapter_record(self, record: AdapterRecord) -> AdapterRecord:
        """Store `record` as the next version of its (tenant, name); NotFound if no such tenant,
        AdapterStorageExceeded if its files would take the tenant past its max_adapter_bytes
        (store.limits.check_adapter_storage, checked in the write's transaction, so concurrent
        uploads of one tenant never pass the limit together).

        Returns the record with `version` set to 1 + the latest stored version (1 for a new name).
        """

    async def get_adapter(
        self, tenant: str, name: str, version: int | None = None
    ) -> AdapterRecord | None:
        """That version of the tenant's adapter (the latest when None), or None."""

    async def list_adapters(self, tenant: str) -> list[AdapterRecord]:
        """The latest version of each of the tenant's adapters, sorted by name."""

    async def get_adapter_files(self, tenant: str) -> dict[str, int]:
        """{digest: size in bytes} of the adapter files the tenant stores, as max_adapter_bytes
        counts them (store.limits.stored_files of every version of every adapter: each set of
        files once; their sum is the tenant's stored bytes); {} for no such tenant."""

    async def delete_adapter(self, tenant: str, name: str) -> list[AdapterRecord]:
        """Delete every version of an adapter (NotFound if none) and return the removed records."""

    async def is_digest_referenced(self, digest: str) -> bool:
        """Whether any adapter record of any tenant has this digest (its blob must be kept)."""

    # Rate limits, budgets and usage.

    async def check_and_consume_rate(
        self, tenant: Tenant, *, requests: int = 1, tokens: int = 0, now: float | None = None,
        overdraw: bool = False,
    ) -> RateDecision:
        """Atomically check the tenant's rpm and tpm buckets; if both allow, pay into both.
        Negative counts give back (see refund_rate). With `overdraw`, pay whatever the buckets
        hold: one that lacks the cost goes below empty, and refills from there."""

    async def reserve_tokens(
        self,
        tenant: Tenant,
        tokens: int,
        *,
        spend_usd: float = 0.0,
        now: float | None = None,
        ttl_s: float = 600.0,
    ) -> Reservation | None:
        """Atomically hold `tokens` (and `spend_usd`) of this month's budgets, or None if they do
        not cover it. The hold lapses after `ttl_s` unless settled first."""

    async def extend_hold(
        self, reservation: Reservation, *, ttl_s: float = 600.0, now: float | None = None
    ) -> bool:
        """Make a live hold lapse `ttl_s` from now instead (a request still running keeps its
        hold); False if it was settled or had lapsed already."""

    async def settle(
        self, reservation: Reservation, *, tokens_in: int, tokens_out: int, spend_usd: float
    ) -> bool:
        """Release the hold and add the request's real counts to its month; call once, or again
        after a try that failed with one of store.UNAVAILABLE_ERRORS: it bills the call once.
        False if it billed nothing: the tenant was deleted meanwhile (and maybe made anew)."""

    async def release(self, reservation: Reservation) -> None:
        """Drop the hold of a call that used nothing, billing and counting nothing; call once
        (or again, as `settle`), instead of `settle`."""

    async def get_usage(
        self, tenant: str, month: str | None = None, *, now: float | None = None
    ) -> Usage:
        """The tenant's counters for `month` ("YYYY-MM"; the month of `now` when None)."""


async def refund_rate(
    store: Store, tenant: Tenant, *, requests: int = 1, tokens: int = 0, now: float | None = None
) -> None:
    """Give back what a call of `tenant` paid into the rate buckets (it was refused after paying,
    or used less than it paid for): a payment of the negative counts, always allowed, after which
    a bucket never holds more than its limit. Negative counts pay what the call used beyond what
    it paid (an upstream counted its prompt as more tokens than the call held), also what the
    buckets lack: they go below empty, so that the tenant's next calls wait until they refill.

    Only the buckets the call paid into (those `tenant`, as it was admitted, had), at the limits
    the tenant has now: a PATCH since the call paid must not have the bucket refill and cap at the
    old ones, nor fill a bucket it set up, which the call never paid into. Nothing for a tenant
    deleted since, or made anew under its name."""
    current = await store.get_tenant(tenant.name)
    if current is None or current.incarnation != tenant.incarnation:
        return
    paid_into = msgspec.structs.replace(current, rpm=None if tenant.rpm is None else current.rpm,
                                        tpm=None if tenant.tpm is None else current.tpm)
    await store.check_and_consume_rate(paid_into, requests=-requests, tokens=-tokens, now=now,
                                       overdraw=True)
