"""One suite over both Store backends (SQLite file, real redis-server), plus the blob folder."""

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from store import (
    UNAVAILABLE_ERRORS,
    AdapterRecord,
    AdapterStorageExceeded,
    AlreadyExists,
    InvalidName,
    InvalidSetting,
    NotFound,
    RateDecision,
    RedisStore,
    Reservation,
    SqliteStore,
    Store,
    StoreError,
    StoreFull,
    StoreUnavailable,
    Tenant,
    open_store,
    refund_rate,
    unavailable_cause,
)
import gateway.admission as admission_module
import store.redis as store_redis
import store.sqlite as store_sqlite
from gateway.admission import admit, wait_for_settles
from gateway.auth import ensure_admin_key
from gateway.errors import ApiError
from store.blobs import ADAPTER_FILES, OWNER_FILE, BlobStore, collect_garbage, digest_files
from store.keys import hash_key, verify_key
from store.sqlite import LOCK_TIMEOUT_S
from store.workers import WorkerRecord, WorkerRegistry
from tests.helpers import small_volume
from tests.processes import free_port
from tests.redis_server import PersistentRedisServer, redis_server, redis_url  # noqa: F401

pytestmark = pytest.mark.anyio

T0 = datetime(2025, 3, 15, tzinfo=UTC).timestamp()
DIGEST_A, DIGEST_B, DIGEST_C = "a" * 64, "b" * 64, "c" * 64


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio needs asyncio


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """URL of an empty store; opening it twice gives two clients, like two gateway processes."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/store.db"
    return request.getfixturevalue("redis_url")


@pytest.fixture
async def store(store_url: str, tmp_path: Path) -> AsyncIterator[Store]:
    s = await open_store(store_url, tmp_path)
    yield s
    await s.close()


async def make_tenant(store: Store, name: str = "acme", **limits) -> Tenant:
    return await store.create_tenant(Tenant(name=name, created_at=T0, **limits))


def adapter(tenant: str, name: str, digest: str = DIGEST_A) -> AdapterRecord:
    return AdapterRecord(
        tenant=tenant,
        name=name,
        base_model="demo-llama",
        digest=digest,
        rank=8,
        target_modules=("q_proj", "v_proj"),
        size_bytes=1234,
        created_at=T0,
    )


def dump_backend(store_url: str, tmp_path: Path) -> bytes:
    """Every byte the backend holds: the SQLite files, or every Redis key and value."""
    if store_url.startswith("sqlite"):
        return b"".join(p.read_bytes() for p in sorted(tmp_path.glob("store.db*")))
    client = redis.Redis.from_url(store_url)
    out = []
    for key in client.scan_iter():
        kind = client.type(key)
        if kind == b"string":
            out += [key, client.get(key)]
        elif kind == b"hash":
            out += [key, *(b for kv in client.hgetall(key).items() for b in kv)]
        else:
            assert kind == b"set", kind
            out += [key, *client.smembers(key)]
    client.close()
    return b"\n".join(out)


# Tenants.


async def test_tenants_create_get_list_delete(store: Store) -> None:
    beta = await make_tenant(store, "beta", rpm=10, allowed_models=("small",))
    alpha = await make_tenant(store, "alpha", monthly_spend_budget_usd=2.5)
    assert await store.get_tenant("beta") == beta
    assert await store.get_tenant("gamma") is None
    assert await store.list_tenants() == [alpha, beta]
    with pytest.raises(AlreadyExists, match="'beta' already exists"):
        await make_tenant(store, "beta")
    assert await store.delete_tenant("beta") == []
    assert await store.list_tenants() == [alpha]
    with pytest.raises(NotFound, match="'beta' does not exist"):
        await store.delete_tenant("beta")


async def test_tenant_updates_change_only_the_fields_named(store: Store) -> None:
    acme = await make_tenant(store, rpm=10, tpm=1000, allowed_models=("small",))
    _, key = await store.create_key("acme")
    assert (await store.authenticate(key)).rpm == 10  # cached by the SQLite store
    updated = await store.update_tenant("acme", {"rpm": 2, "monthly_token_budget": 500,
                                                 "allowed_models": None})
    assert updated == msgspec.structs.replace(acme, rpm=2, monthly_token_budget=500,
                                              allowed_models=None)
    assert await store.get_tenant("acme") == updated
    assert await store.authenticate(key) == updated  # a cached key sees the new limits at once
    with pytest.raises(StoreError, match="tpm must be positive"):
        await store.update_tenant("acme", {"tpm": 0})
    with pytest.raises(StoreError, match=r"\['created_at', 'name'\] cannot be changed"):
        await store.update_tenant("acme", {"name": "other", "created_at": 0.0})
    assert await store.get_tenant("acme") == updated  # a refused update changes nothing
    with pytest.raises(NotFound, match="'nobody' does not exist"):
        await store.update_tenant("nobody", {"rpm": 1})


class _NewerTenant(Tenant, frozen=True, kw_only=True):
    """A tenant as a newer version of the store keeps it: a setting this version does not know."""

    max_concurrent_requests: int | None = None


def _stored_record(store: Store, store_url: str, name: str) -> dict:
    """The tenant's record as the store holds it, every field."""
    if store_url.startswith("redis"):
        with redis.Redis.from_url(store_url) as client:
            return msgspec.json.decode(client.get(f"sb:tenant:{name}"))
    with sqlite3.connect(store.path) as conn:
        [(record,)] = conn.execute("SELECT record FROM tenants WHERE name = ?", (name,))
    return msgspec.json.decode(record)


async def test_an_update_keeps_the_settings_a_newer_version_stored(store: Store, store_url: str):
    """Gateways of two versions share the store during a rolling upgrade: a PATCH through the
    older one once dropped the settings it did not know (a storage limit lifted without a word)."""
    await store.create_tenant(_NewerTenant(name="acme", created_at=T0, max_concurrent_requests=4))
    updated = await store.update_tenant("acme", {"rpm": 2})
    assert updated == Tenant(name="acme", created_at=T0, rpm=2)
    assert _stored_record(store, store_url, "acme")["max_concurrent_requests"] == 4
    assert await store.get_tenant("acme") == updated


async def test_concurrent_updates_never_leave_a_default_route_the_allowed_models_exclude(
        store_url: str, tmp_path: Path) -> None:
    # Two gateways change the two fields at once; each update alone is fine against what the
    # tenant had. The store checks the pair in its transaction, so one of them is refused.
    clients = [await open_store(store_url, tmp_path) for _ in range(2)]
    await make_tenant(clients[0], allowed_models=("auto", "small"), default_route="auto")
    outcomes = await asyncio.gather(
        clients[0].update_tenant("acme", {"allowed_models": ("small",)}),
        clients[1].update_tenant("acme", {"default_route": "auto"}),
        clients[1].update_tenant("acme", {"allowed_models": ("small", "large")}),
        return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert refused and all(isinstance(o, InvalidSetting) and o.field == "default_route"
                           for o in refused), outcomes  # the store alone once allowed both
    tenant = await clients[1].get_tenant("acme")
    assert tenant.default_route is None or tenant.default_route in tenant.allowed_models
    with pytest.raises(InvalidSetting, match="default_route 'auto' is not among the tenant's"):
        await clients[0].update_tenant("acme", {"allowed_models": ("large",), "default_route": "auto"})
    for client in clients:
        await client.close()


async def test_concurrent_updates_of_different_fields_all_land(store_url: str, tmp_path: Path) -> None:
    clients = [await open_store(store_url, tmp_path) for _ in range(2)]  # like two gateways
    await make_tenant(clients[0])
    fields = ["rpm", "tpm", "monthly_token_budget"]
    await asyncio.gather(*(clients[i % 2].update_tenant("acme", {field: 7 + i})
                           for i, field in enumerate(fields)))
    tenant = await clients[1].get_tenant("acme")
    assert [getattr(tenant, f) for f in fields] == [7, 8, 9]
    for client in clients:
        await client.close()


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../x", "a/b", "a:b", "-a", "a b", "a\n", "x" * 65]
)
def test_invalid_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidName, match="invalid tenant name"):
        Tenant(name=name)
    with pytest.raises(InvalidName, match="invalid adapter name"):
        adapter("acme", name)


def test_limits_must_be_positive() -> None:
    with pytest.raises(StoreError, match="rpm must be positive"):
        Tenant(name="acme", rpm=0)
    with pytest.raises(InvalidSetting, match="max_adapter_bytes must be positive"):
        Tenant(name="acme", max_adapter_bytes=0)
    assert Tenant(name="a." + "x" * 62).rpm is None


# API keys.


async def test_keys_are_stored_only_as_hashes(store: Store, store_url: str, tmp_path: Path) -> None:
    await make_tenant(store)
    record, plaintext = await store.create_key("acme", now=T0)
    assert plaintext.startswith("sb-") and len(plaintext) > 40
    assert record.key_hash == hashlib.sha256(plaintext.encode()).hexdigest() == hash_key(plaintext)
    assert plaintext.startswith(record.prefix) and len(record.prefix) == 8
    assert verify_key(plaintext, record.key_hash) and not verify_key(
        plaintext + "x", record.key_hash
    )
    dump = dump_backend(store_url, tmp_path)
    assert record.key_hash.encode() in dump
    assert plaintext.encode() not in dump
    assert plaintext[len(record.prefix) :].encode() not in dump


async def test_authenticate_until_revoked(store: Store) -> None:
    acme = await make_tenant(store)
    first, first_key = await store.create_key("acme", now=T0)
    second, second_key = await store.create_key("acme", now=T0 + 1)
    assert await store.authenticate(first_key) == acme
    assert await store.authenticate(first_key[:-1]) is None
    assert await store.authenticate("not-a-key") is None
    revoked = await store.revoke_key(first.id)
    assert revoked.revoked and revoked.id == first.id
    assert await store.authenticate(first_key) is None
    assert await store.authenticate(second_key) == acme
    assert await store.list_keys("acme") == [revoked, second]
    with pytest.raises(NotFound, match="'key_nope' does not exist"):
        await store.revoke_key("key_nope")
    with pytest.raises(NotFound, match="'ghost' does not exist"):
        await store.create_key("ghost")


async def test_admin_key_hash(store: Store) -> None:
    assert await store.get_admin_key_hash() is None
    await store.set_admin_key_hash(hash_key("sb-admin-1"))
    await store.set_admin_key_hash(hash_key("sb-admin-2"))
    assert await store.get_admin_key_hash() == hash_key("sb-admin-2")


async def test_servers_starting_at_once_on_a_fresh_store_agree_on_one_admin_key(
        store_url: str, tmp_path: Path) -> None:
    # Each made and printed a key; the one written last replaced the other, which never worked.
    servers = [await open_store(store_url, tmp_path) for _ in range(8)]
    printed = await asyncio.gather(*(ensure_admin_key(s, None) for s in servers))
    made = [key for key in printed if key is not None]
    assert len(made) == 1 and await servers[0].get_admin_key_hash() == hash_key(made[0])
    assert await servers[0].set_admin_key_hash(hash_key("x"), only_if_unset=True) is False
    for server in servers:
        await server.close()


# Adapter records.


async def test_adapter_versions_and_tenant_isolation(store: Store) -> None:
    await make_tenant(store, "acme")
    await make_tenant(store, "beta")
    v1 = await store.put_adapter_record(adapter("acme", "sql"))
    v2 = await store.put_adapter_record(adapter("acme", "sql", DIGEST_B))
    assert (v1.version, v2.version) == (1, 2)
    other = await store.put_adapter_record(adapter("beta", "sql"))
    assert other.version == 1
    chat = await store.put_adapter_record(adapter("acme", "chat"))
    assert await store.get_adapter("acme", "sql") == v2
    assert await store.get_adapter("acme", "sql", version=1) == v1
    assert await store.get_adapter("acme", "sql", version=3) is None
    assert await store.get_adapter("beta", "sql") == other
    assert await store.get_adapter("beta", "chat") is None
    assert await store.list_adapters("acme") == [chat, v2]
    assert await store.list_adapters("beta") == [other]
    assert await store.list_adapters("nobody") == []
    with pytest.raises(NotFound, match="'ghost' does not exist"):
        await store.put_adapter_record(adapter("ghost", "sql"))


async def test_concurrent_uploads_get_distinct_versions(store: Store) -> None:
    await make_tenant(store)
    records = await asyncio.gather(
        *(store.put_adapter_record(adapter("acme", "sql")) for _ in range(6))
    )
    assert sorted(r.version for r in records) == [1, 2, 3, 4, 5, 6]
    assert (await store.get_adapter("acme", "sql")).version == 6


async def test_delete_adapter_returns_versions_and_drops_refs(store: Store) -> None:
    await make_tenant(store, "acme")
    await make_tenant(store, "beta")
    v1 = await store.put_adapter_record(adapter("acme", "sql", DIGEST_A))
    v2 = await store.put_adapter_record(adapter("acme", "sql", DIGEST_B))
    await store.put_adapter_record(adapter("beta", "shared", DIGEST_B))
    assert await store.delete_adapter("acme", "sql") == [v1, v2]
    assert await store.get_adapter("acme", "sql") is None
    assert not await store.is_digest_referenced(DIGEST_A)
    assert await store.is_digest_referenced(DIGEST_B)  # beta still uses the same files
    with pytest.raises(NotFound, match="no adapter 'sql'"):
        await store.delete_adapter("acme", "sql")
    again = await store.put_adapter_record(adapter("acme", "sql"))
    assert again.version == 1


async def test_the_adapter_storage_limit_counts_each_set_of_files_once(store: Store) -> None:
    await make_tenant(store, max_adapter_bytes=3000)  # room for two sets of files of 1234 bytes
    await make_tenant(store, "beta", max_adapter_bytes=1234)
    await store.put_adapter_record(adapter("acme", "sql", DIGEST_A))
    await store.put_adapter_record(adapter("acme", "sql", DIGEST_B))
    await store.put_adapter_record(adapter("acme", "chat", DIGEST_A))  # files it stores: nothing
    assert await store.get_adapter_files("acme") == {DIGEST_A: 1234, DIGEST_B: 1234}
    with pytest.raises(AdapterStorageExceeded) as refused:
        await store.put_adapter_record(adapter("acme", "chat", DIGEST_C))
    error = refused.value
    assert (error.field, error.tenant, error.stored_bytes, error.size_bytes, error.limit_bytes) == (
        "max_adapter_bytes", "acme", 2468, 1234, 3000)
    assert (await store.get_adapter("acme", "chat")).version == 1  # nothing of it was stored
    assert not await store.is_digest_referenced(DIGEST_C)
    await store.put_adapter_record(adapter("beta", "own", DIGEST_C))  # each tenant its own limit
    assert (await store.get_adapter_files("beta"), await store.get_adapter_files("nobody")) == (
        {DIGEST_C: 1234}, {})
    await store.delete_adapter("acme", "sql")  # frees B; A stays, chat's
    assert await store.get_adapter_files("acme") == {DIGEST_A: 1234}
    assert (await store.put_adapter_record(adapter("acme", "chat", DIGEST_C))).version == 2
    # Past a limit lowered below what it stores, files it stores still add nothing; new ones do.
    await store.update_tenant("acme", {"max_adapter_bytes": 1})
    assert (await store.put_adapter_record(adapter("acme", "copy", DIGEST_A))).version == 1
    with pytest.raises(AdapterStorageExceeded, match="'acme' stores 2468 bytes of adapter files"):
        await store.put_adapter_record(adapter("acme", "copy", DIGEST_B))
    await store.update_tenant("acme", {"max_adapter_bytes": None})
    assert (await store.put_adapter_record(adapter("acme", "copy", DIGEST_B))).version == 2


async def test_concurrent_uploads_of_a_tenant_never_pass_its_storage_limit(
        store_url: str, tmp_path: Path) -> None:
    clients = [await open_store(store_url, tmp_path) for _ in range(2)]  # like two gateways
    await make_tenant(clients[0], max_adapter_bytes=2 * 1234)
    # New names and new versions of one name, each with files of its own: room for two of them.
    records = [adapter("acme", f"n{i % 3}", f"{i + 1:x}" * 64) for i in range(6)]
    # Connections made ahead: the puts then run side by side, not each behind a connection's setup.
    await asyncio.gather(*(clients[i % 2].get_tenant("acme") for i in range(len(records))))
    outcomes = await asyncio.gather(*(clients[i % 2].put_adapter_record(r)
                                      for i, r in enumerate(records)), return_exceptions=True)
    stored = [o for o in outcomes if isinstance(o, AdapterRecord)]
    assert len(stored) == 2, outcomes
    assert all(isinstance(o, AdapterStorageExceeded) for o in outcomes if o not in stored), outcomes
    assert sum((await clients[1].get_adapter_files("acme")).values()) == 2 * 1234
    for client in clients:
        await client.close()


async def test_a_tenant_stored_before_max_adapter_bytes_existed_stores_without_limit(
        store: Store, store_url: str) -> None:
    record = msgspec.json.decode(msgspec.json.encode(Tenant(name="acme", rpm=5, created_at=T0)))
    del record["max_adapter_bytes"]
    raw = msgspec.json.encode(record)  # the record as a version without the limit wrote it
    if store_url.startswith("sqlite"):
        with sqlite3.connect(store.path) as conn:
            conn.execute("INSERT INTO tenants VALUES (?, ?)", ("acme", raw))
    else:
        client = redis.Redis.from_url(store_url)
        client.set("sb:tenant:acme", raw)
        client.sadd("sb:tenants", "acme")
        client.close()
    assert (await store.get_tenant("acme")).max_adapter_bytes is None
    await store.put_adapter_record(adapter("acme", "sql", DIGEST_A))
    assert (await store.update_tenant("acme", {"max_adapter_bytes": 1234})).rpm == 5
    with pytest.raises(AdapterStorageExceeded):
        await store.put_adapter_record(adapter("acme", "sql", DIGEST_B))


async def test_delete_tenant_cascades(store: Store) -> None:
    await make_tenant(store, "acme", rpm=1)
    _, key = await store.create_key("acme")
    sql = await store.put_adapter_record(adapter("acme", "sql", DIGEST_A))
    chat = await store.put_adapter_record(adapter("acme", "chat", DIGEST_B))
    await store.check_and_consume_rate(await store.get_tenant("acme"), now=T0)
    assert await store.delete_tenant("acme") == [chat, sql]
    assert await store.authenticate(key) is None
    assert await store.list_keys("acme") == []
    assert await store.list_adapters("acme") == []
    assert not await store.is_digest_referenced(DIGEST_A)
    assert not await store.is_digest_referenced(DIGEST_B)
    fresh = await make_tenant(store, "acme", rpm=1)
    assert (await store.put_adapter_record(adapter("acme", "sql"))).version == 1
    assert (await store.check_and_consume_rate(fresh, now=T0)).allowed  # rate state went too


async def test_a_store_s_id_is_made_once_and_says_whether_it_shares_copies(store: Store) -> None:
    first = await store.get_store_id()
    assert await store.get_store_id() == first and len(first) >= 32
    assert first.startswith("shared-") == (store.shared_blobs is not None)


async def test_a_tenant_made_anew_under_a_deleted_name_starts_from_nothing(store: Store) -> None:
    old = await make_tenant(store, "acme", monthly_token_budget=100)
    settled = await store.reserve_tokens(old, 30, spend_usd=0.5, now=T0)
    assert await store.settle(settled, tokens_in=10, tokens_out=20, spend_usd=0.5) is True
    in_flight = await store.reserve_tokens(old, 40, now=T0)  # a call still running at the delete
    await store.delete_tenant("acme")
    new = await store.create_tenant(Tenant(name="acme", created_at=T0 + 1, monthly_token_budget=100))
    empty = await store.get_usage("acme", now=T0)
    assert (empty.requests, empty.tokens_in, empty.tokens_out, empty.spend_usd) == (0, 0, 0, 0.0)
    assert (empty.reserved_tokens, empty.reserved_spend_usd) == (0, 0.0)
    assert type(empty.spend_usd) is type(empty.reserved_spend_usd) is float
    # Bills nothing now, and says so (tried again, as after a lost reply, too).
    for _ in range(2):
        assert await store.settle(in_flight, tokens_in=10, tokens_out=30, spend_usd=0.1) is False
    assert (await store.get_usage("acme", now=T0)).requests == 0
    assert await store.reserve_tokens(new, 100, now=T0) is not None  # the whole budget is its own


# Rate limits.


async def test_rate_limit_allows_exactly_n_then_retry_after(store: Store) -> None:
    acme = await make_tenant(store, rpm=5)
    decisions = [await store.check_and_consume_rate(acme, now=T0) for _ in range(6)]
    assert decisions[:5] == [RateDecision(True)] * 5
    assert decisions[5] == RateDecision(False, 12.0, "rpm")  # one request refills in 60 / 5 s
    assert (await store.check_and_consume_rate(acme, now=T0 + 6)).retry_after == 6.0
    assert (await store.check_and_consume_rate(acme, now=T0 + 12)).allowed
    assert not (await store.check_and_consume_rate(acme, now=T0 + 12)).allowed
    unlimited = await make_tenant(store, "free")
    assert all([(await store.check_and_consume_rate(unlimited, now=T0)).allowed for _ in range(50)])


async def test_refused_request_consumes_nothing(store: Store) -> None:
    acme = await make_tenant(store, rpm=2, tpm=100)
    assert (await store.check_and_consume_rate(acme, tokens=100, now=T0)).allowed
    refused = await store.check_and_consume_rate(acme, tokens=50, now=T0)
    assert refused == RateDecision(False, 30.0, "tpm")
    assert (await store.check_and_consume_rate(acme, tokens=0, now=T0)).allowed  # rpm kept 1
    assert await store.check_and_consume_rate(acme, now=T0) == RateDecision(False, 30.0, "rpm")
    too_big = await store.check_and_consume_rate(acme, requests=0, tokens=101, now=T0 + 600)
    assert too_big == RateDecision(False, 60.0, "tpm")


async def test_refunds_give_back_what_was_paid_but_never_past_the_limit(store: Store) -> None:
    acme = await make_tenant(store, rpm=2, tpm=100)
    assert (await store.check_and_consume_rate(acme, tokens=90, now=T0)).allowed
    await refund_rate(store, acme, requests=1, tokens=60, now=T0)
    assert (await store.check_and_consume_rate(acme, tokens=70, now=T0)).allowed  # 100 - 30
    assert not (await store.check_and_consume_rate(acme, tokens=1, now=T0)).allowed
    await refund_rate(store, acme, requests=5, tokens=500, now=T0)  # full, not 5 requests' worth
    assert (await store.check_and_consume_rate(acme, tokens=100, now=T0)).allowed
    assert (await store.check_and_consume_rate(acme, tokens=0, now=T0)).allowed
    assert not (await store.check_and_consume_rate(acme, tokens=0, now=T0)).allowed


async def test_refunds_use_the_tenant_s_limits_as_they_are_now(store: Store) -> None:
    """A call admitted before a PATCH or a delete refunds at the tenant's limits of now, and never
    into the bucket of a tenant made anew under the same name."""
    acme = await make_tenant(store, tpm=100)
    assert (await store.check_and_consume_rate(acme, tokens=90, now=T0)).allowed
    raised = await store.update_tenant("acme", {"tpm": 6000})
    await refund_rate(store, acme, requests=0, tokens=60, now=T0 + 1)  # acme: as the call saw it
    # 10 left + 100 refilled in 1 s at 6000/min + 60 back; at the old limit it would be capped at 100
    assert (await store.check_and_consume_rate(raised, tokens=170, now=T0 + 1)).allowed
    assert not (await store.check_and_consume_rate(raised, tokens=1, now=T0 + 1)).allowed

    await store.delete_tenant("acme")
    anew = await store.create_tenant(Tenant(name="acme", created_at=T0 + 2, tpm=1000))
    assert (await store.check_and_consume_rate(anew, tokens=1000, now=T0 + 2)).allowed
    await refund_rate(store, raised, requests=0, tokens=60, now=T0 + 2)  # the deleted tenant's call
    assert not (await store.check_and_consume_rate(anew, tokens=1, now=T0 + 2)).allowed


async def test_refunds_go_only_into_the_buckets_the_call_paid_into(store: Store) -> None:
    """A call admitted while its tenant had no rpm nor tpm paid into no bucket: what it gives back
    (refused, or settling below its hold) or pays (past its hold) must not touch the buckets a
    PATCH has set up since, which would let the tenant past its new limits."""
    acme = await make_tenant(store)
    assert (await store.check_and_consume_rate(acme, tokens=500, now=T0)).allowed  # no buckets
    patched = await store.update_tenant("acme", {"rpm": 2, "tpm": 100})
    assert (await store.check_and_consume_rate(patched, tokens=96, now=T0)).allowed
    await refund_rate(store, acme, requests=1, tokens=400, now=T0)  # the call admitted before
    await refund_rate(store, acme, requests=0, tokens=-50, now=T0)  # another, billed past its hold
    assert not (await store.check_and_consume_rate(patched, requests=0, tokens=5, now=T0)).allowed
    assert (await store.check_and_consume_rate(patched, tokens=4, now=T0)).allowed
    assert await store.check_and_consume_rate(patched, tokens=0, now=T0) == \
        RateDecision(False, 30.0, "rpm")


async def test_tokens_used_beyond_what_was_paid_are_paid_past_empty(
    store: Store, store_url: str
) -> None:
    """A call that used more tokens than it paid at admission pays the rest when it settles, even
    what the bucket lacks: the tenant waits until the bucket has refilled from below empty."""
    acme = await make_tenant(store, tpm=100)
    assert (await store.check_and_consume_rate(acme, tokens=90, now=T0)).allowed
    await refund_rate(store, acme, requests=0, tokens=-40, now=T0)  # it used 130: 30 below empty
    refused = await store.check_and_consume_rate(acme, requests=0, tokens=10, now=T0 + 12)
    assert refused == RateDecision(False, 12.0, "tpm")  # 20 refilled: at -10, 20 short of 10
    assert (await store.check_and_consume_rate(acme, requests=0, tokens=10, now=T0 + 24)).allowed

    await refund_rate(store, acme, requests=0, tokens=-240, now=T0 + 24)  # 2.4 windows below
    if isinstance(store, RedisStore):  # and Redis keeps the bucket until it is full again
        client = redis.Redis.from_url(store_url)
        [bucket] = [k for k in client.scan_iter() if k.endswith(b"rate:acme")]
        assert client.ttl(bucket) >= 60 + 60 * 3.4 - 1
        client.close()
    assert not (await store.check_and_consume_rate(acme, requests=0, tokens=1, now=T0 + 168)).allowed
    assert (await store.check_and_consume_rate(acme, requests=0, tokens=1, now=T0 + 170)).allowed


async def test_a_released_hold_bills_and_counts_nothing(store: Store) -> None:
    acme = await make_tenant(store, monthly_token_budget=100)
    held = await store.reserve_tokens(acme, 100, now=T0)
    assert held is not None and await store.reserve_tokens(acme, 1, now=T0) is None
    await store.release(held)
    usage = await store.get_usage("acme", now=T0)
    assert (usage.requests, usage.tokens_in, usage.reserved_tokens) == (0, 0, 0)
    assert await store.reserve_tokens(acme, 100, now=T0) is not None


async def test_concurrent_consumers_get_exactly_n(
    store: Store, store_url: str, tmp_path: Path
) -> None:
    acme = await make_tenant(store, rpm=10)
    other = await open_store(store_url, tmp_path)  # a second gateway process
    try:
        calls = [s.check_and_consume_rate(acme, now=T0) for s in (store, other) for _ in range(15)]
        decisions = await asyncio.gather(*calls)
    finally:
        await other.close()
    assert sum(d.allowed for d in decisions) == 10
    assert {d.retry_after for d in decisions if not d.allowed} == {6.0}


# Budgets and usage.


async def test_reservations_settle_to_real_counts(store: Store) -> None:
    acme = await make_tenant(store, monthly_token_budget=1000)
    held = await store.reserve_tokens(acme, 600, now=T0)
    assert held is not None and held.month == "2025-03" and held.tokens == 600
    assert await store.reserve_tokens(acme, 500, now=T0) is None
    usage = await store.get_usage("acme", now=T0)
    assert (usage.reserved_tokens, usage.tokens_in, usage.requests) == (600, 0, 0)
    await store.settle(held, tokens_in=100, tokens_out=200, spend_usd=0.25)
    usage = await store.get_usage("acme", "2025-03", now=T0)
    assert (usage.requests, usage.tokens_in, usage.tokens_out, usage.spend_usd) == (
        1,
        100,
        200,
        0.25,
    )
    assert (usage.reserved_tokens, usage.reserved_spend_usd) == (0, 0.0)
    assert await store.reserve_tokens(acme, 700, now=T0) is not None  # 300 used + 700 = budget
    assert await store.reserve_tokens(acme, 1, now=T0) is None
    with pytest.raises(StoreError, match="amounts must be >= 0"):
        await store.reserve_tokens(acme, -1, now=T0)


async def test_spend_budget(store: Store) -> None:
    acme = await make_tenant(store, monthly_spend_budget_usd=1.0)
    first = await store.reserve_tokens(acme, 10, spend_usd=0.75, now=T0)
    assert first is not None
    assert await store.reserve_tokens(acme, 10, spend_usd=0.5, now=T0) is None
    await store.settle(first, tokens_in=5, tokens_out=5, spend_usd=0.5)
    second = await store.reserve_tokens(acme, 10, spend_usd=0.5, now=T0)
    assert second is not None
    await store.settle(second, tokens_in=5, tokens_out=5, spend_usd=0.5)
    assert (await store.get_usage("acme", now=T0)).spend_usd == 1.0
    assert await store.reserve_tokens(acme, 10, spend_usd=0.0, now=T0) is None  # used up


async def test_a_spend_budget_is_used_to_the_last_cent_despite_float_rounding(store: Store) -> None:
    acme = await make_tenant(store, monthly_spend_budget_usd=0.3)
    for _ in range(3):  # in floats, 0.1 + 0.1 + 0.1 > 0.3
        held = await store.reserve_tokens(acme, 1, spend_usd=0.1, now=T0)
        assert held is not None
        await store.settle(held, tokens_in=1, tokens_out=0, spend_usd=0.1)
    assert await store.reserve_tokens(acme, 1, spend_usd=1e-6, now=T0) is None
    assert await store.reserve_tokens(acme, 1, spend_usd=0.0, now=T0) is None  # used up
    beta = await make_tenant(store, "beta", monthly_spend_budget_usd=0.3)
    holds = [await store.reserve_tokens(beta, 1, spend_usd=0.1, now=T0) for _ in range(4)]
    assert [h is not None for h in holds] == [True, True, True, False]


async def test_unsettled_reservation_lapses(store: Store) -> None:
    acme = await make_tenant(store, monthly_token_budget=100)
    assert await store.reserve_tokens(acme, 100, now=T0, ttl_s=10) is not None
    assert await store.reserve_tokens(acme, 1, now=T0 + 9) is None
    assert (await store.get_usage("acme", now=T0 + 11)).reserved_tokens == 0
    assert await store.reserve_tokens(acme, 100, now=T0 + 11) is not None


async def test_an_extended_hold_outlives_its_first_ttl_and_a_settled_one_stays_gone(store: Store) -> None:
    acme = await make_tenant(store, monthly_token_budget=100)
    held = await store.reserve_tokens(acme, 100, now=T0, ttl_s=10)
    assert await store.extend_hold(held, ttl_s=10, now=T0 + 9)
    assert await store.reserve_tokens(acme, 1, now=T0 + 15) is None  # still held at 15 (lapses at 19)
    assert (await store.get_usage("acme", now=T0 + 15)).reserved_tokens == 100
    assert not await store.extend_hold(held, ttl_s=10, now=T0 + 20)  # lapsed at 19: not revived
    assert await store.reserve_tokens(acme, 100, now=T0 + 20) is not None
    other = await store.reserve_tokens(acme, 0, now=T0 + 20)
    await store.settle(other, tokens_in=0, tokens_out=0, spend_usd=0.0)
    assert not await store.extend_hold(other, ttl_s=10, now=T0 + 21)
    assert (await store.get_usage("acme", now=T0 + 21)).reserved_tokens == 100


async def test_an_admitted_call_keeps_its_hold_past_the_ttl_until_it_settles(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE: the store's clock is the test's, which moves on only once the hold has been renewed
    # at its last reading: with the wall clock, a loop stalled for 0.4 s let a 0.6 s hold lapse.
    clock = [time.time()]
    for module in (store_sqlite, store_redis):
        monkeypatch.setattr(module, "now_or", lambda now: clock[0] if now is None else now)
    monkeypatch.setattr(admission_module, "_RENEWALS_PER_TTL", 600)  # every 50 ms of a 30 s ttl
    renewed_at: list[float] = []
    extend_hold = store.extend_hold

    async def counted_extend_hold(reservation: Reservation, **kwargs: Any) -> bool:
        at = clock[0]
        if await extend_hold(reservation, **kwargs):
            renewed_at.append(at)
            return True
        return False

    monkeypatch.setattr(store, "extend_hold", counted_extend_hold)
    acme = await make_tenant(store, monthly_token_budget=100)
    admission = await admit(store, acme, 100, hold_ttl_s=30)
    for _ in range(6):  # 60 s: over two ttls, which only the renewals outlive
        clock[0] += 10
        for _ in range(1000):
            if clock[0] in renewed_at:
                break
            await asyncio.sleep(0.01)
    assert (await store.get_usage("acme")).reserved_tokens == 100
    assert await store.reserve_tokens(acme, 1) is None
    await admission.settle(10, 20, 0.0)
    num_renewals = len(renewed_at)
    await asyncio.sleep(0.2)  # renewals would be due: nothing revives a settled hold
    assert len(renewed_at) == num_renewals
    usage = await store.get_usage("acme")
    assert (usage.reserved_tokens, usage.tokens_in, usage.tokens_out) == (0, 10, 20)


@pytest.mark.parametrize("asked, retry", [(15, "true"), (56, "false")])
async def test_an_over_budget_call_is_told_to_retry_only_if_the_holds_could_make_room(
        store: Store, asked: int, retry: str) -> None:
    """Calls in flight hold 1 of the 15 tokens left: a call of 15 may fit once they finish; one of
    56 never can, and was told to retry (the SDKs then sent it again and again, in vain)."""
    acme = await make_tenant(store, monthly_token_budget=100)
    used = await admit(store, acme, 85)
    await used.settle(25, 60, 0.0)
    in_flight = await admit(store, acme, 1)
    with pytest.raises(ApiError) as refused:
        await admit(store, acme, asked)
    await in_flight.settle(1, 0, 0.0)
    assert (refused.value.status, refused.value.headers["x-should-retry"]) == (429, retry)
    message = refused.value.body.error.message
    assert ("retry once the calls in flight finish" in message) == (retry == "true")
    assert "14 of 100 tokens left (85 used, 1 held by calls in flight)" in message


async def test_usage_is_per_month(store: Store) -> None:
    acme = await make_tenant(store, monthly_token_budget=100)
    april = datetime(2025, 4, 1, tzinfo=UTC).timestamp()
    march_hold = await store.reserve_tokens(acme, 100, now=T0)
    april_hold = await store.reserve_tokens(acme, 100, now=april)
    assert march_hold is not None and april_hold is not None
    await store.settle(march_hold, tokens_in=60, tokens_out=0, spend_usd=0.0)
    await store.settle(april_hold, tokens_in=7, tokens_out=3, spend_usd=0.0)
    assert (await store.get_usage("acme", "2025-03")).tokens_in == 60
    april_usage = await store.get_usage("acme", now=april)
    assert (april_usage.month, april_usage.tokens_in, april_usage.tokens_out) == ("2025-04", 7, 3)


async def test_concurrent_reservations_never_exceed_budget(
    store: Store, store_url: str, tmp_path: Path
) -> None:
    acme = await make_tenant(store, monthly_token_budget=1000)
    other = await open_store(store_url, tmp_path)
    try:
        calls = [s.reserve_tokens(acme, 100, now=T0) for s in (store, other) for _ in range(15)]
        holds = await asyncio.gather(*calls)
    finally:
        await other.close()
    assert sum(h is not None for h in holds) == 10
    assert (await store.get_usage("acme", now=T0)).reserved_tokens == 1000


# Opening.


async def test_open_store_urls(tmp_path: Path, monkeypatch) -> None:
    default = await open_store(None, tmp_path)
    await default.close()
    relative = await open_store("sqlite://sub/x.db", tmp_path)
    await relative.close()
    assert (tmp_path / "switchboard.db").is_file() and (tmp_path / "sub" / "x.db").is_file()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    at_home = await open_store("sqlite://~/y.db", tmp_path / "data")
    await at_home.close()
    assert (tmp_path / "home" / "y.db").is_file()  # not in a folder named "~"
    with sqlite3.connect(tmp_path / "switchboard.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    with pytest.raises(StoreError, match="unknown store URL 'postgres://x'"):
        await open_store("postgres://x", tmp_path)
    (tmp_path / "notes.db").write_text("some notes, not a database\n")
    with pytest.raises(StoreError, match="notes.db as the SQLite store: file is not a database"):
        await open_store("sqlite://notes.db", tmp_path)


# Redis: down, stuck, restarted.


def test_the_readmes_redis_conf_starts_redis_persisting_as_it_says(tmp_path: Path) -> None:
    """Copied as shown (its folder made this test's), it once stopped Redis from starting: its
    comments ran on after each setting, which Redis reads as more arguments."""
    import subprocess

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme[readme.index("# redis.conf"):]
    conf = block[:block.index("```")].replace("/var/lib/redis", str(tmp_path))
    (tmp_path / "redis.conf").write_text(conf)
    port = free_port()
    process = subprocess.Popen(["redis-server", str(tmp_path / "redis.conf"), "--port", str(port),
                                "--bind", "127.0.0.1", "--save", ""],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client, settings = redis.Redis(port=port, socket_timeout=1.0), None
    try:
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                settings = {k: client.config_get(k)[k] for k in
                            ("appendonly", "appendfsync", "dir", "maxmemory-policy")}
                break
            time.sleep(0.05)
        assert process.poll() is None, process.communicate()[1].decode()
        assert settings == {"appendonly": "yes", "appendfsync": "everysec",
                            "dir": str(tmp_path.resolve()), "maxmemory-policy": "noeviction"}
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=10)


async def test_redis_store_that_cannot_connect_says_where(tmp_path: Path) -> None:
    server = PersistentRedisServer(tmp_path)
    server.stop()
    url = server.url.replace("redis://", "redis://:secret@")
    with pytest.raises(UNAVAILABLE_ERRORS, match="cannot reach the Redis store at 127.0.0.1:") as e:
        await RedisStore.open(url)
    assert "secret" not in str(e.value)


async def test_redis_store_that_cannot_connect_says_where_for_a_url_without_a_db() -> None:
    # redis-py keeps only the parts a URL spells out: naming the address of "redis://host:port"
    # raised KeyError 'db', a traceback where the operator should read that Redis is not up.
    with pytest.raises(UNAVAILABLE_ERRORS, match="cannot reach the Redis store at 127.0.0.1:1/0 "):
        await RedisStore.open("redis://127.0.0.1:1")


async def test_redis_store_fails_fast_while_down_and_recovers_after_a_restart(
    tmp_path: Path,
) -> None:
    server = PersistentRedisServer(tmp_path)
    store = await RedisStore.open(server.url)
    try:
        acme = await make_tenant(store, rpm=2)
        assert (await store.check_and_consume_rate(acme, now=T0)).allowed
        await asyncio.gather(*(store.get_tenant("acme") for _ in range(4)))  # 4 pooled connections
        server.process.send_signal(signal.SIGSTOP)  # stuck: connected, but no replies
        started = time.monotonic()
        with pytest.raises(UNAVAILABLE_ERRORS):
            await store.get_tenant("acme")
        assert time.monotonic() - started < 4  # one 2 s timeout, not retried (which takes 4 s)
        server.process.send_signal(signal.SIGCONT)
        server.stop()
        started = time.monotonic()
        with pytest.raises(UNAVAILABLE_ERRORS):
            await store.check_and_consume_rate(acme, now=T0)
        assert time.monotonic() - started < 2  # refused at once: no 2 s timeout waited
        server.start()  # every pooled connection is now dead, and the server has no scripts
        assert await asyncio.gather(*(store.get_tenant("acme") for _ in range(4))) == [acme] * 4
        assert (await store.check_and_consume_rate(acme, now=T0)).allowed  # the bucket was kept
        assert not (await store.check_and_consume_rate(acme, now=T0)).allowed
    finally:
        await store.close()
        server.stop()


async def test_redis_calls_waiting_for_a_connection_fail_as_soon_as_redis_stops_answering(
    tmp_path: Path,
) -> None:
    """Calls past the pool's connections wait for one: each got one in turn once a call before it
    timed out, only to wait out a timeout of its own (behind 200 calls, the last 503 came after
    14 s). Once Redis left a call unanswered, those waiting fail at once."""
    from store.redis import MAX_CONNECTIONS

    server = PersistentRedisServer(tmp_path)
    store = await RedisStore.open(server.url)
    try:
        acme = await make_tenant(store)
        server.process.send_signal(signal.SIGSTOP)  # stuck: connected, but no replies
        num_calls = 3 * MAX_CONNECTIONS
        failed = await asyncio.gather(*(store.get_tenant("acme") for _ in range(num_calls)),
                                      return_exceptions=True)
        assert all(isinstance(error, UNAVAILABLE_ERRORS) for error in failed), failed
        waited_out = [e for e in failed if "while this one waited for a connection" not in str(e)]
        assert len(waited_out) <= MAX_CONNECTIONS  # one timeout on each connection, at most
        server.process.send_signal(signal.SIGCONT)
        assert await asyncio.gather(*(store.get_tenant("acme") for _ in range(4))) == [acme] * 4
    finally:
        server.process.send_signal(signal.SIGCONT)
        await store.close()
        server.stop()


@pytest.mark.parametrize("used", [True, False], ids=["billed", "withdrawn"])
async def test_a_call_ending_while_redis_restarts_is_settled_once_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, used: bool
) -> None:
    """Its settle (or the release of its hold) is tried again until Redis is back: tried once,
    a call that ended during a restart went unbilled, or held its budget until its hold lapsed."""
    server = PersistentRedisServer(tmp_path)
    store = await RedisStore.open(server.url)
    try:
        acme = await make_tenant(store, monthly_token_budget=100)
        admission = await admit(store, acme, 100)
        server.stop()
        with caplog.at_level(logging.WARNING, logger="gateway.admission"):
            ending = admission.settle(10, 20, 0.0) if used else admission.withdraw(refund_requests=True)
            await asyncio.wait_for(ending, 10)  # refused at once: its answer does not wait
            server.start()
            await wait_for_settles(60)
        usage = await store.get_usage("acme")
        billed = (1, 10, 20) if used else (0, 0, 0)
        assert (usage.requests, usage.tokens_in, usage.tokens_out, usage.reserved_tokens) == (*billed, 0)
        tried = "settle a call" if used else "release the hold of a call"
        assert f"could not {tried} of tenant acme" in caplog.text
        assert "not billed" not in caplog.text
    finally:
        await store.close()
        server.stop()


async def test_a_redis_settle_whose_reply_was_lost_bills_once_when_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis stopped answering after it ran the settle's transaction: trying again must not bill
    the call twice, and says it billed it (for /metrics to count it once)."""
    server = PersistentRedisServer(tmp_path)
    store = await RedisStore.open(server.url)
    try:
        acme = await make_tenant(store, monthly_token_budget=100)
        admission = await admit(store, acme, 100)
        transaction, lost = store._redis.transaction, []

        async def reply_lost(*args, **kwargs):
            value = await transaction(*args, **kwargs)
            if not lost:
                lost.append(True)
                raise redis.ConnectionError("Connection closed by server.")
            return value

        monkeypatch.setattr(store._redis, "transaction", reply_lost)
        counted = []
        await admission.settle(10, 20, 0.0, on_billed=lambda: counted.append(True))
        await wait_for_settles(60)
        assert lost and counted == [True]
        usage = await store.get_usage("acme")
        assert (usage.requests, usage.tokens_in, usage.tokens_out, usage.reserved_tokens) == (1, 10, 20, 0)
    finally:
        await store.close()
        server.stop()


async def test_redis_a_call_settling_while_its_tenant_is_deleted_leaves_a_new_one_nothing(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call's first settle of the month lands between the delete's scan of the tenant's
    usage keys and its transaction (a large keyspace makes that window a second wide)."""
    store = await RedisStore.open(redis_url)
    try:
        acme = await make_tenant(store, monthly_token_budget=1000)
        held = await store.reserve_tokens(acme, 100)
        scan = store._redis.scan_iter
        settled = []

        async def scan_then_settle(*args, **kwargs):
            async for key in scan(*args, **kwargs):
                yield key
            if not settled:
                settled.append(await store.settle(held, tokens_in=40, tokens_out=60, spend_usd=0))

        monkeypatch.setattr(store._redis, "scan_iter", scan_then_settle)
        await store.delete_tenant("acme")
        assert settled
        anew = await make_tenant(store, monthly_token_budget=1000)
        usage = await store.get_usage("acme")
        assert (usage.requests, usage.tokens_in, usage.tokens_out, usage.reserved_tokens) == (0, 0, 0, 0)
        assert await store.reserve_tokens(anew, 1000) is not None
    finally:
        await store.close()


async def test_redis_limits_hold_against_a_gateway_whose_clock_runs_ahead(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gateways on several machines have clocks a little apart: one 90 s ahead took another's live
    holds for lapsed, dropping them (a second call past the monthly budget), and its rpm bucket
    for refilled (a second full minute's calls at once). Both go by Redis's clock."""
    store = await RedisStore.open(redis_url)
    try:
        acme = await make_tenant(store, rpm=2, monthly_token_budget=3000)
        assert await store.reserve_tokens(acme, 2000, ttl_s=60) is not None
        for _ in range(2):
            assert (await store.check_and_consume_rate(acme)).allowed
        clock = time.time
        monkeypatch.setattr(time, "time", lambda: clock() + 90)  # another gateway's clock
        assert await store.reserve_tokens(acme, 2000, ttl_s=60) is None
        assert (await store.get_usage("acme")).reserved_tokens == 2000
        refused = await store.check_and_consume_rate(acme)
        assert not refused.allowed and refused.retry_after <= 30
    finally:
        await store.close()


def _fill_memory(admin: redis.Redis, data_dir: Path) -> None:
    admin.config_set("maxmemory", 1)  # with noeviction, the policy README asks for


def _fail_snapshots(admin: redis.Redis, data_dir: Path) -> None:
    admin.config_set("save", "3600 1")  # snapshots on, so a failed one stops writes (MISCONF)
    shutil.rmtree(data_dir)  # Redis's working directory: the snapshot cannot be written
    with pytest.raises(redis.ResponseError):
        admin.bgsave()
        while admin.info("persistence")["rdb_bgsave_in_progress"]:
            time.sleep(0.01)
        admin.set("probe", 1)


# How a Redis comes to refuse writes, how it takes them again, and what /health says of it.
WRITE_REFUSALS = {
    "out of maxmemory": (_fill_memory, lambda admin: admin.config_set("maxmemory", 0),
                         "Redis is out of its maxmemory"),
    "snapshots failing": (_fail_snapshots, lambda admin: admin.config_set("save", ""),
                          "Redis refuses writes because its last snapshot to disk failed "
                          "(MISCONF): see Redis's log"),
}


@pytest.mark.parametrize("refusal", WRITE_REFUSALS)
async def test_a_redis_that_refuses_writes_is_unavailable_until_it_takes_them_again(
    tmp_path: Path, refusal: str
) -> None:
    """Out of its maxmemory, or after a failed snapshot to disk, Redis answers reads (or not even
    PING) but refuses writes: calls, and ensure_writable (the gateway's /health), must say "retry
    later", not fail as a bug would. Reads, of several keys at once too, go on answering."""
    refuse_writes, take_writes, cause = WRITE_REFUSALS[refusal]
    (tmp_path / "data").mkdir()
    server = PersistentRedisServer(tmp_path / "data")
    store, admin = await RedisStore.open(server.url), redis.Redis.from_url(server.url)
    registry = WorkerRegistry(store_redis.connect(server.url, 2.0))
    try:
        acme = await make_tenant(store, rpm=10, monthly_token_budget=1000)
        held = await store.reserve_tokens(acme, 10, now=T0)
        stored = [await store.put_adapter_record(adapter("acme", name)) for name in ("a", "b")]
        await registry.heartbeat(WorkerRecord(
            id="w1", url="http://127.0.0.1:1", model="demo-llama", max_model_len=64, max_loras=2,
            max_lora_rank=8, tokenizer=None, num_running=0, num_waiting=0, adapters_device=[],
            adapters_host=[], stats=b"{}", beat_at=T0), ttl_s=60)
        refuse_writes(admin, tmp_path / "data")
        assert await store.list_adapters("acme") == stored
        assert (await store.get_usage("acme", held.month, now=T0)).reserved_tokens == held.tokens
        seen = await registry.models_seen()
        assert list(seen) == ["demo-llama"] and seen["demo-llama"].rank_beats == {8: T0}
        refused = [store.ensure_writable(), store.create_tenant(Tenant(name="b", created_at=T0)),
                   store.create_key("acme"), store.check_and_consume_rate(acme, now=T0),
                   store.reserve_tokens(acme, 10, now=T0)]
        for call in refused:
            with pytest.raises(UNAVAILABLE_ERRORS) as error:
                await call
            assert unavailable_cause(error.value) == cause
        take_writes(admin)
        await store.ensure_writable()
        assert (await store.check_and_consume_rate(acme, now=T0)).allowed
    finally:
        admin.close()
        await store.close()
        await registry.close()
        server.stop()


async def test_why_a_redis_cannot_be_used_is_said_without_its_address_or_credentials(
        redis_url: str) -> None:
    """As a gateway's /health, which anyone may call, says it."""
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser("gateway", enabled=True, passwords=["+right"], keys=["*"], commands=["+@all"])
    address = redis_url.removeprefix("redis://").rstrip("/")
    causes = []
    try:
        for url in (f"redis://127.0.0.1:{free_port()}", f"redis://gateway:wrong@{address}"):
            client = store_redis.connect(url, 2.0)
            try:
                with pytest.raises(UNAVAILABLE_ERRORS) as error:
                    await client.ping()
            finally:
                await client.aclose()
            causes.append(unavailable_cause(error.value))
    finally:
        admin.acl_deluser("gateway")
        admin.close()
    assert causes == ["Redis cannot be reached (down, restarting, or refusing connections)",
                      "Redis refuses the gateway's credentials (the user and password in the "
                      "store's redis:// URL)"]


async def test_redis_calls_past_the_pooled_connections_wait_for_one(redis_url: str, monkeypatch) -> None:
    """A burst larger than the connection pool on a healthy Redis is served, not refused as if
    Redis were down (redis-py's default pool: "Too many connections")."""
    from store import redis as redis_module

    # NOTE: a small pool: 128 connections opened at once on a loaded 2-core machine took their
    # handshakes past the 2 s connect timeout.
    monkeypatch.setattr(redis_module, "MAX_CONNECTIONS", 4)
    store, registry = await RedisStore.open(redis_url), WorkerRegistry.open(redis_url)
    try:
        acme = await make_tenant(store)
        burst = 3 * redis_module.MAX_CONNECTIONS
        assert await asyncio.gather(*(store.get_tenant("acme") for _ in range(burst))) == [acme] * burst
        assert await asyncio.gather(*(registry.workers() for _ in range(burst))) == [[]] * burst
    finally:
        await store.close()
        await registry.close()


async def test_redis_calls_wait_for_a_pooled_connection_longer_than_the_redis_timeout(
        redis_url: str, monkeypatch) -> None:
    """Waiting for a connection is load, not Redis down: calls that waited past the 2 s timeout
    once failed as if it were ("No connection available"), a 503 or a call left unbilled."""
    from store import redis as redis_module

    monkeypatch.setattr(redis_module, "MAX_CONNECTIONS", 2)
    client = redis_module.connect(redis_url, timeout_s=2.0)
    try:
        started = time.monotonic()
        # Each holds its connection for 0.5 s: the last pair waits 3.5 s for one.
        waits = await asyncio.gather(*(client.blpop(["no-such-list"], timeout=0.5) for _ in range(16)))
        assert waits == [None] * 16 and time.monotonic() - started >= 4.0
    finally:
        await client.aclose()


# SQLite: calls run on the caller's event loop, and on the worker thread only to wait.


def without_suspending(call: Coroutine[Any, Any, Any]) -> Any:
    """The result of `call`, which must finish without once giving the event loop back."""
    try:
        call.send(None)
    except StopIteration as finished:
        return finished.value
    call.close()
    raise AssertionError("the call suspended: it did not run inline")


async def test_sqlite_calls_run_inline_while_the_lock_is_free(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "store.db")
    try:
        acme = await make_tenant(store, rpm=2, monthly_token_budget=100)
        assert without_suspending(store.check_and_consume_rate(acme, now=T0)).allowed
        held = without_suspending(store.reserve_tokens(acme, 30, now=T0))
        without_suspending(store.settle(held, tokens_in=10, tokens_out=5, spend_usd=0.0))
        usage = without_suspending(store.get_usage("acme", now=T0))
        assert (usage.requests, usage.tokens_in, usage.reserved_tokens) == (1, 10, 0)
    finally:
        await store.close()


async def test_sqlite_call_waits_for_another_writer_off_the_loop(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "store.db")
    other = sqlite3.connect(tmp_path / "store.db", isolation_level=None)  # another process
    try:
        acme = await make_tenant(store, rpm=1)
        other.execute("BEGIN IMMEDIATE")
        call = asyncio.ensure_future(store.check_and_consume_rate(acme, now=T0))
        await asyncio.sleep(0.2)  # the loop keeps running while the call waits for the lock
        assert not call.done()
        other.execute("COMMIT")
        assert (await call).allowed
        assert not (await store.check_and_consume_rate(acme, now=T0)).allowed  # paid once
    finally:
        other.close()
        await store.close()


async def test_sqlite_calls_locked_out_by_another_process_are_unavailable_after_one_wait(
    tmp_path: Path,
) -> None:
    store = await SqliteStore.open(tmp_path / "store.db")
    other = sqlite3.connect(tmp_path / "store.db", isolation_level=None)  # another process
    try:
        acme = await make_tenant(store, rpm=1)
        other.execute("BEGIN IMMEDIATE")  # and never lets go in time
        started = time.monotonic()
        outcomes = await asyncio.gather(
            *(store.check_and_consume_rate(acme, now=T0) for _ in range(3)),
            store.ensure_writable(), return_exceptions=True)
        waited = time.monotonic() - started
        assert all(isinstance(o, UNAVAILABLE_ERRORS) for o in outcomes), outcomes
        assert "stayed locked by another process" in str(outcomes[0])
        # One wait for all, not one each (4 x LOCK_TIMEOUT_S), with room for a stalled process,
        # whose stall SQLite's wait (a count of its sleeps) does not count.
        assert LOCK_TIMEOUT_S <= waited < 3 * LOCK_TIMEOUT_S
        assert await store.get_tenant("acme") == acme  # reads go on
        other.execute("ROLLBACK")
        await store.ensure_writable()
        assert (await store.check_and_consume_rate(acme, now=T0)).allowed  # nothing was paid
    finally:
        other.close()
        await store.close()


@pytest.mark.parametrize("used", [True, False], ids=["billed", "withdrawn"])
async def test_a_call_ending_while_another_process_holds_the_sqlite_lock_is_settled_once_it_is_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, used: bool
) -> None:
    """Its settle (or, for a call that used nothing, the release of its hold and the refund of
    its rate) waits out the lock, and is tried again: tried once, the call went unbilled, or held
    its budget and tpm, until its hold lapsed. The tries after the first go on in the
    background: the call's answer, ready, went out only once the lock was free."""
    store = await SqliteStore.open(tmp_path / "store.db")
    other = sqlite3.connect(tmp_path / "store.db", isolation_level=None)  # another process
    try:
        acme = await make_tenant(store, rpm=1, tpm=1000, monthly_token_budget=100)
        admission = await admit(store, acme, 100)
        other.execute("BEGIN IMMEDIATE")  # a script's long write
        with caplog.at_level(logging.WARNING, logger="gateway.admission"):
            # Returns, the lock still held, once its first try gave up.
            ending = admission.settle(10, 20, 0.0) if used else admission.withdraw(refund_requests=True)
            await asyncio.wait_for(ending, 10 * LOCK_TIMEOUT_S)
            assert (await store.get_usage("acme")).reserved_tokens == 100  # held while it retries
            other.execute("ROLLBACK")
            await wait_for_settles(10 * LOCK_TIMEOUT_S)
        usage = await store.get_usage("acme")
        billed = (1, 10, 20) if used else (0, 0, 0)
        assert (usage.requests, usage.tokens_in, usage.tokens_out, usage.reserved_tokens) == (*billed, 0)
        tried = "settle a call" if used else "release the hold of a call"
        assert f"could not {tried} of tenant acme" in caplog.text
        assert "not billed" not in caplog.text and "could not release" not in caplog.text.replace(
            f"could not {tried}", "")
        # tpm got back the tokens held but not used (all 100 for a withdrawn call, and rpm its
        # request): 30 of 1000 paid, or none
        paid = 30 if used else 0
        assert (await store.check_and_consume_rate(acme, requests=0 if used else 1,
                                                   tokens=1000 - paid)).allowed
    finally:
        other.close()
        await store.close()


async def test_a_shutdown_that_cannot_wait_for_a_locked_settle_logs_what_it_leaves_unbilled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A graceful stop waits for settles only so long; one still retrying then (another process
    holds SQLite's lock) is cancelled, and the log gives what it used. The loop's end cancelled
    it without a word, and the call was neither billed nor logged."""
    store = await SqliteStore.open(tmp_path / "store.db")
    other = sqlite3.connect(tmp_path / "store.db", isolation_level=None)  # another process
    try:
        acme = await make_tenant(store, monthly_token_budget=100)
        admission = await admit(store, acme, 100)
        other.execute("BEGIN IMMEDIATE")  # and never lets go in time
        with caplog.at_level(logging.WARNING, logger="gateway.admission"):
            await asyncio.wait_for(admission.settle(10, 20, 0.0), 10 * LOCK_TIMEOUT_S)
            await asyncio.wait_for(wait_for_settles(0.1), 10 * LOCK_TIMEOUT_S)
        assert ("shut down before the store confirmed the settle of a call, which may not be "
                "billed: usage of tenant 'acme'" in caplog.text)
        assert "10 prompt tokens, 20 output tokens" in caplog.text
        other.execute("ROLLBACK")
        assert (await store.get_usage("acme")).requests == 0  # never retried after the log
    finally:
        other.close()
        await store.close()


async def test_a_call_locked_out_after_paying_the_rate_limits_gets_back_what_it_paid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process takes SQLite's lock between a call's rate payment and its budget hold: the
    call gets a 503 and never runs, so its request and tokens come back once the lock is free
    (they stayed paid for a minute)."""
    store = await SqliteStore.open(tmp_path / "store.db")
    other = sqlite3.connect(tmp_path / "store.db", isolation_level=None)  # another process
    try:
        acme = await make_tenant(store, rpm=1, tpm=1000)
        reserve = store.reserve_tokens

        async def locked_first(*args, **kwargs):
            other.execute("BEGIN IMMEDIATE")
            return await reserve(*args, **kwargs)

        monkeypatch.setattr(store, "reserve_tokens", locked_first)
        with pytest.raises(StoreUnavailable):
            await admit(store, acme, 100)
        other.execute("ROLLBACK")
        await wait_for_settles(10 * LOCK_TIMEOUT_S)
        assert (await store.check_and_consume_rate(acme, requests=1, tokens=1000)).allowed
    finally:
        other.close()
        await store.close()


async def test_sqlite_wal_is_checkpointed_under_steady_writes(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "store.db")
    try:
        acme = await make_tenant(store, monthly_token_budget=10**9)
        largest = 0
        for _ in range(3000):
            held = await store.reserve_tokens(acme, 10, now=T0)
            await store.settle(held, tokens_in=5, tokens_out=5, spend_usd=0.0)
            largest = max(largest, (tmp_path / "store.db-wal").stat().st_size)
        assert (await store.get_usage("acme", now=T0)).requests == 3000
    finally:
        await store.close()
    # Never checkpointed, these 6000 commits grow it to ~82 MiB; checkpointed, it stays near 16 MiB.
    assert largest < 40 << 20


async def test_sqlite_wal_stays_bounded_while_its_checkpoint_waits(tmp_path: Path) -> None:
    """A checkpoint stuck behind slow work on the worker thread (or a busy disk's fsyncs) holds
    writes off once they would grow the WAL past its bound, rather than letting it grow on."""
    store = await SqliteStore.open(tmp_path / "store.db")
    worker_is_free = threading.Event()
    try:
        acme = await make_tenant(store, monthly_token_budget=10**9)
        # Busy for a second at most, or until the writes below have all gone through.
        store._executor.submit(worker_is_free.wait, 1.0)
        largest = 0
        for _ in range(2500):
            held = await store.reserve_tokens(acme, 10, now=T0)
            await store.settle(held, tokens_in=5, tokens_out=5, spend_usd=0.0)
            largest = max(largest, (tmp_path / "store.db-wal").stat().st_size)
        worker_is_free.set()
        assert (await store.get_usage("acme", now=T0)).requests == 2500
    finally:
        worker_is_free.set()
        await store.close()
    # Unchecked, these 5000 commits grow it to ~68 MiB; the checkpoint lets 1500 by (~21 MiB).
    assert largest < 40 << 20


async def test_a_sqlite_store_whose_own_wal_filled_its_volume_takes_writes_again(
        tmp_path: Path) -> None:
    """On a small volume the WAL, grown between checkpoints that only writes that succeed asked
    for, filled it: every write then got StoreFull for good ("free disk space"), with nothing
    there to free but the store's own WAL."""
    with small_volume(tmp_path / "volume", "2m") as volume:
        # A store that has billed before (its close folds the WAL into the file): its pages are
        # there, and the writes below only rewrite them.
        store = await SqliteStore.open(volume / "store.db")
        acme = await make_tenant(store, monthly_token_budget=10**9)
        held = await store.reserve_tokens(acme, 10, now=T0)
        await store.settle(held, tokens_in=5, tokens_out=5, spend_usd=0.0)
        await store.close()
        store = await SqliteStore.open(volume / "store.db")
        try:
            num_billed = 1
            with pytest.raises(StoreFull):
                for _ in range(10_000):
                    held = await store.reserve_tokens(acme, 10, now=T0)
                    await store.settle(held, tokens_in=5, tokens_out=5, spend_usd=0.0)
                    num_billed += 1
            assert sorted(p.name for p in volume.iterdir()) == [
                "store.db", "store.db-shm", "store.db-wal"]  # nothing else to free
            # NOTE: the checkpoint the refusal asked for runs on the worker thread. Nothing is
            # written until it has run: a small write may fit where the refused one failed.
            deadline = time.monotonic() + 10
            while (volume / "store.db-wal").stat().st_size > 0:
                assert time.monotonic() < deadline, "the WAL was never truncated"
                await asyncio.sleep(0.05)
            for _ in range(20):
                held = await store.reserve_tokens(acme, 10, now=T0)
                await store.settle(held, tokens_in=5, tokens_out=5, spend_usd=0.0)
            assert (await store.get_usage("acme", now=T0)).requests == num_billed + 20
        finally:
            await store.close()


async def test_sqlite_auth_cache_follows_revocations(tmp_path: Path) -> None:
    # NOTE: a TTL the steps below (one write elsewhere) take far less of, on a loaded machine too.
    store = await SqliteStore.open(tmp_path / "store.db", auth_cache_ttl_s=3.0)
    other = await SqliteStore.open(tmp_path / "store.db")  # another gateway process
    try:
        acme = await make_tenant(store)
        first, first_key = await store.create_key("acme", now=T0)
        second, second_key = await store.create_key("acme", now=T0)
        assert await store.authenticate(first_key) == acme  # cached from here on
        await store.revoke_key(first.id)
        assert await store.authenticate(first_key) is None  # revoked here: at once
        assert await store.authenticate(second_key) == acme
        await other.revoke_key(second.id)
        assert await store.authenticate(second_key) == acme  # revoked elsewhere: within the TTL
        await asyncio.sleep(3.05)
        assert await store.authenticate(second_key) is None
        _, third_key = await store.create_key("acme", now=T0)
        assert await store.authenticate(third_key) == acme
        await store.delete_tenant("acme")
        assert await store.authenticate(third_key) is None
    finally:
        await other.close()
        await store.close()


# Blobs.


def write_adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    (folder / "README.md").write_text("not part of the identity")
    return folder


def expected_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(ADAPTER_FILES):
        data = (folder / name).read_bytes()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def test_blobs_are_content_addressed(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    first = write_adapter(tmp_path / "one", b"\x01" * 100)
    digest, size = blobs.put(first)
    assert digest == expected_digest(first) == digest_files(first)
    assert size == 100 + len('{"r": 8}')
    assert blobs.put(write_adapter(tmp_path / "two", b"\x01" * 100)) == (digest, size)
    other, _ = blobs.put(write_adapter(tmp_path / "three", b"\x02" * 100))
    assert other != digest
    assert blobs.digests() == sorted([digest, other])
    stored = blobs.path(digest)
    assert stored == tmp_path / "blobs" / digest
    assert sorted(p.name for p in stored.iterdir()) == sorted(ADAPTER_FILES)
    assert (stored / "adapter_model.safetensors").read_bytes() == b"\x01" * 100
    assert [p.name for p in (tmp_path / "blobs").iterdir() if p.name.startswith(".")] == []


def test_blob_put_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    src = write_adapter(tmp_path / "src", b"\x03" * 10)
    real_copy = shutil.copyfile

    def copy_then_fail(a: Path, b: Path) -> None:
        if Path(b).name == ADAPTER_FILES[1]:
            raise OSError("disk full")
        real_copy(a, b)

    monkeypatch.setattr(shutil, "copyfile", copy_then_fail)
    with pytest.raises(OSError, match="disk full"):
        blobs.put(src)
    assert list((tmp_path / "blobs").iterdir()) == []
    (src / ADAPTER_FILES[1]).unlink()
    with pytest.raises(StoreError, match="lacks adapter_model.safetensors"):
        blobs.put(src)


def test_blob_put_can_link_instead_of_copying(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    staged = write_adapter(tmp_path / "blobs" / ".tmp-upload-x", b"\x04" * 10)
    digest, _ = blobs.put(staged, link=True)
    stored = blobs.path(digest)
    for name in ADAPTER_FILES:  # the same file, not a second copy of it
        assert (stored / name).stat().st_ino == (staged / name).stat().st_ino
    shutil.rmtree(staged)  # what an upload does with its staging folder once stored
    assert digest_files(stored) == digest

    def no_links(src: Path, dst: Path) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    other = write_adapter(tmp_path / "elsewhere", b"\x05" * 10)
    digest, _ = blobs.put(other, link=True)  # falls back to copying
    assert (blobs.path(digest) / ADAPTER_FILES[1]).read_bytes() == b"\x05" * 10
    assert (blobs.path(digest) / ADAPTER_FILES[1]).stat().st_ino != (other / ADAPTER_FILES[1]).stat().st_ino


def test_blob_delete_and_bad_digest(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    digest, _ = blobs.put(write_adapter(tmp_path / "src", b"\x04"))
    assert blobs.delete(digest) and not blobs.delete(digest)
    assert blobs.path(digest) is None and blobs.digests() == []
    with pytest.raises(InvalidName, match="invalid digest '../etc'"):
        blobs.path("../etc")


async def test_collect_garbage_keeps_referenced_blobs(store: Store, tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    kept, _ = blobs.put(write_adapter(tmp_path / "a", b"\x05"))
    dropped, _ = blobs.put(write_adapter(tmp_path / "b", b"\x06"))
    await make_tenant(store)
    await store.put_adapter_record(msgspec.structs.replace(adapter("acme", "sql"), digest=kept))
    assert await collect_garbage(blobs, store) == [dropped]
    assert blobs.digests() == [kept]


async def test_collect_garbage_leaves_entries_that_are_not_blobs(store: Store, tmp_path: Path) -> None:
    """A blob folder on its own volume has a `lost+found`, and one that is the data folder too
    holds the database: a sweep once raised on them (every gateway start failed), and must not
    delete them either."""
    blobs = BlobStore(tmp_path / "blobs")
    dropped, _ = blobs.put(write_adapter(tmp_path / "a", b"\x07"))
    (blobs.root / "lost+found").mkdir()
    (blobs.root / "switchboard.db").write_bytes(b"SQLite format 3\x00")
    assert blobs.digests() == [dropped]
    assert await collect_garbage(blobs, store) == [dropped]
    # and the mark of the store whose files the folder keeps (BlobStore.claim)
    assert sorted(p.name for p in blobs.root.iterdir()) == sorted([OWNER_FILE, "lost+found",
                                                                    "switchboard.db"])


async def test_digest_locks_let_one_task_at_a_time_hold_a_digest(tmp_path: Path) -> None:
    locks = BlobStore(tmp_path / "blobs").locks
    holders: list[int] = []
    most_holders = 0

    async def hold(task: int) -> None:
        nonlocal most_holders
        for _ in range(task):  # arrive `task` turns of the event loop late: some just as a
            await asyncio.sleep(0)  # holder lets go, before the waiter it woke has run
        async with locks.hold(DIGEST_A):
            holders.append(task)
            most_holders = max(most_holders, len(holders))
            for _ in range(2):
                await asyncio.sleep(0)
            holders.remove(task)

    await asyncio.gather(*(hold(task) for task in range(6)))
    assert most_holders == 1
    assert locks._locks == {}  # dropped once free


def test_stale_temp_cleanup_skips_folders_that_vanish_meanwhile(tmp_path: Path) -> None:
    """Uploads and deletes running beside the cleanup rename or remove their own .tmp-/.trash-
    folders at any moment, e.g. between its listing of the folder and its look at one of them."""

    class FinishedAfterListing(type(tmp_path)):
        def iterdir(self):
            listed = list(super().iterdir())
            for running in (".tmp-upload-running", ".trash-running"):
                shutil.rmtree(self / running)
            return iter(listed)

    blobs = BlobStore(FinishedAfterListing(tmp_path / "blobs"))
    for name in (".tmp-upload-running", ".trash-running", ".tmp-crashed"):
        (blobs.root / name).mkdir()
    crashed_at = time.time() - 2 * 3600
    os.utime(blobs.root / ".tmp-crashed", (crashed_at, crashed_at))
    blobs.remove_stale_temp(time.time())
    assert sorted(os.listdir(blobs.root)) == []
