"""SQLite backend: one file (WAL mode), every call run on one worker thread.

NOTE: all calls of one SqliteStore run on its single thread, and every write is a
`BEGIN IMMEDIATE` transaction, so check-then-write sequences (rate buckets, budget holds, version
numbers) stay exact within a process and across processes sharing the file.
"""

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import msgspec

from store.errors import AlreadyExists, NotFound
from store.keys import KEY_PREFIX, hash_key, new_key, verify_key
from store.limits import budget_allows, month_of, new_reservation, now_or, rate_costs, take
from store.models import AdapterRecord, ApiKeyRecord, RateDecision, Reservation, Tenant, Usage

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (name TEXT PRIMARY KEY, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_hash TEXT NOT NULL UNIQUE, record BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant);
CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS adapters (
    tenant TEXT, name TEXT, version INTEGER, digest TEXT NOT NULL, record BLOB NOT NULL,
    PRIMARY KEY (tenant, name, version));
CREATE INDEX IF NOT EXISTS adapters_digest ON adapters (digest);
CREATE TABLE IF NOT EXISTS rate_buckets (
    tenant TEXT, kind TEXT, level REAL NOT NULL, updated_at REAL NOT NULL,
    PRIMARY KEY (tenant, kind));
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT, month TEXT, requests INTEGER NOT NULL, tokens_in INTEGER NOT NULL,
    tokens_out INTEGER NOT NULL, spend_usd REAL NOT NULL, PRIMARY KEY (tenant, month));
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, month TEXT NOT NULL, tokens INTEGER NOT NULL,
    spend_usd REAL NOT NULL, expires_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS reservations_tenant ON reservations (tenant, month);
"""


class SqliteStore:
    """The Store protocol over a SQLite file; build it with `await SqliteStore.open(path)`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        self._conn: sqlite3.Connection | None = None

    @classmethod
    async def open(cls, path: Path) -> "SqliteStore":
        """Open (creating if needed) the database file at `path`."""
        store = cls(path)
        await store._call(store._connect)
        return store

    def _connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are only the explicit BEGINs below.
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        self._conn = conn

    async def close(self) -> None:
        if self._conn is not None:
            await self._call(self._conn.close)
            self._conn = None
        self._executor.shutdown(wait=True)

    async def _call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` in a read transaction (one consistent snapshot) on the store's thread."""
        return await self._call(lambda: self._transaction("BEGIN", fn))

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` in a write transaction, holding the database's write lock from the start."""
        return await self._call(lambda: self._transaction("BEGIN IMMEDIATE", fn))

    def _transaction(self, begin: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._conn
        assert conn is not None, "SqliteStore used after close()"
        conn.execute(begin)
        try:
            result = fn(conn)
        except BaseException:
            if conn.in_transaction:  # some errors (SQLITE_FULL, ...) have rolled back already
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return result

    # Tenants.

    async def create_tenant(self, tenant: Tenant) -> Tenant:
        def insert(conn: sqlite3.Connection) -> Tenant:
            try:
                conn.execute("INSERT INTO tenants VALUES (?, ?)", (tenant.name, _enc(tenant)))
            except sqlite3.IntegrityError:
                raise AlreadyExists(f"tenant {tenant.name!r} already exists") from None
            return tenant

        return await self._write(insert)

    async def get_tenant(self, name: str) -> Tenant | None:
        return await self._read(lambda conn: _get_tenant(conn, name))

    async def list_tenants(self) -> list[Tenant]:
        def select(conn: sqlite3.Connection) -> list[Tenant]:
            rows = conn.execute("SELECT record FROM tenants ORDER BY name")
            return [msgspec.json.decode(r, type=Tenant) for (r,) in rows]

        return await self._read(select)

    async def delete_tenant(self, name: str) -> list[AdapterRecord]:
        def delete(conn: sqlite3.Connection) -> list[AdapterRecord]:
            _require_tenant(conn, name)
            rows = conn.execute(
                "SELECT record FROM adapters WHERE tenant = ? ORDER BY name, version", (name,)
            )
            removed = [msgspec.json.decode(r, type=AdapterRecord) for (r,) in rows]
            conn.execute("DELETE FROM tenants WHERE name = ?", (name,))
            for table in ("api_keys", "adapters", "rate_buckets"):
                conn.execute(f"DELETE FROM {table} WHERE tenant = ?", (name,))
            return removed

        return await self._write(delete)

    # API keys.

    async def create_key(self, tenant: str, now: float | None = None) -> tuple[ApiKeyRecord, str]:
        record, plaintext = new_key(tenant, now)

        def insert(conn: sqlite3.Connection) -> None:
            _require_tenant(conn, tenant)
            conn.execute(
                "INSERT INTO api_keys VALUES (?, ?, ?, ?)",
                (record.id, tenant, record.key_hash, _enc(record)),
            )

        await self._write(insert)
        return record, plaintext

    async def authenticate(self, plaintext: str) -> Tenant | None:
        if not plaintext.startswith(KEY_PREFIX):
            return None
        key_hash = hash_key(plaintext)

        def lookup(conn: sqlite3.Connection) -> Tenant | None:
            row = conn.execute(
                "SELECT record FROM api_keys WHERE key_hash = ?", (key_hash,)
            ).fetchone()
            if row is None:
                return None
            record = msgspec.json.decode(row[0], type=ApiKeyRecord)
            if record.revoked or not verify_key(plaintext, record.key_hash):
                return None
            return _get_tenant(conn, record.tenant)

        return await self._read(lookup)

    async def revoke_key(self, key_id: str) -> ApiKeyRecord:
        def revoke(conn: sqlite3.Connection) -> ApiKeyRecord:
            row = conn.execute("SELECT record FROM api_keys WHERE id = ?", (key_id,)).fetchone()
            if row is None:
                raise NotFound(f"API key {key_id!r} does not exist")
            record = msgspec.structs.replace(
                msgspec.json.decode(row[0], type=ApiKeyRecord), revoked=True
            )
            conn.execute("UPDATE api_keys SET record = ? WHERE id = ?", (_enc(record), key_id))
            return record

        return await self._write(revoke)

    async def list_keys(self, tenant: str) -> list[ApiKeyRecord]:
        def select(conn: sqlite3.Connection) -> list[ApiKeyRecord]:
            rows = conn.execute("SELECT record FROM api_keys WHERE tenant = ?", (tenant,))
            records = [msgspec.json.decode(r, type=ApiKeyRecord) for (r,) in rows]
            return sorted(records, key=lambda k: (k.created_at, k.id))

        return await self._read(select)

    async def get_admin_key_hash(self) -> str | None:
        def select(conn: sqlite3.Connection) -> str | None:
            row = conn.execute(
                "SELECT value FROM settings WHERE name = 'admin_key_hash'"
            ).fetchone()
            return None if row is None else row[0]

        return await self._read(select)

    async def set_admin_key_hash(self, key_hash: str) -> None:
        await self._write(
            lambda conn: conn.execute(
                "INSERT OR REPLACE INTO settings VALUES ('admin_key_hash', ?)", (key_hash,)
            )
        )

    # Adapter records.

    async def put_adapter_record(self, record: AdapterRecord) -> AdapterRecord:
        def insert(conn: sqlite3.Connection) -> AdapterRecord:
            _require_tenant(conn, record.tenant)
            (latest,) = conn.execute(
                "SELECT COALESCE(MAX(version), 0) FROM adapters WHERE tenant = ? AND name = ?",
                (record.tenant, record.name),
            ).fetchone()
            stored = msgspec.structs.replace(record, version=latest + 1)
            conn.execute(
                "INSERT INTO adapters VALUES (?, ?, ?, ?, ?)",
                (stored.tenant, stored.name, stored.version, stored.digest, _enc(stored)),
            )
            return stored

        return await self._write(insert)

    async def get_adapter(
        self, tenant: str, name: str, version: int | None = None
    ) -> AdapterRecord | None:
        def select(conn: sqlite3.Connection) -> AdapterRecord | None:
            row = conn.execute(
                "SELECT record FROM adapters WHERE tenant = ? AND name = ?"
                " AND (? IS NULL OR version = ?) ORDER BY version DESC LIMIT 1",
                (tenant, name, version, version),
            ).fetchone()
            return None if row is None else msgspec.json.decode(row[0], type=AdapterRecord)

        return await self._read(select)

    async def list_adapters(self, tenant: str) -> list[AdapterRecord]:
        def select(conn: sqlite3.Connection) -> list[AdapterRecord]:
            rows = conn.execute(
                "SELECT record FROM adapters AS a WHERE tenant = ? AND version ="
                " (SELECT MAX(version) FROM adapters WHERE tenant = a.tenant AND name = a.name)"
                " ORDER BY name",
                (tenant,),
            )
            return [msgspec.json.decode(r, type=AdapterRecord) for (r,) in rows]

        return await self._read(select)

    async def delete_adapter(self, tenant: str, name: str) -> list[AdapterRecord]:
        def delete(conn: sqlite3.Connection) -> list[AdapterRecord]:
            rows = conn.execute(
                "DELETE FROM adapters WHERE tenant = ? AND name = ? RETURNING record",
                (tenant, name),
            ).fetchall()
            if not rows:
                raise NotFound(f"tenant {tenant!r} has no adapter {name!r}")
            removed = [msgspec.json.decode(r, type=AdapterRecord) for (r,) in rows]
            return sorted(removed, key=lambda a: a.version)

        return await self._write(delete)

    async def is_digest_referenced(self, digest: str) -> bool:
        return await self._read(
            lambda conn: (
                conn.execute(
                    "SELECT 1 FROM adapters WHERE digest = ? LIMIT 1", (digest,)
                ).fetchone()
                is not None
            )
        )

    # Rate limits, budgets and usage.

    async def check_and_consume_rate(
        self, tenant: Tenant, *, requests: int = 1, tokens: int = 0, now: float | None = None
    ) -> RateDecision:
        costs = rate_costs(tenant, requests, tokens)
        if not costs:
            return RateDecision(True)
        now = now_or(now)

        def consume(conn: sqlite3.Connection) -> RateDecision:
            rows = conn.execute(
                "SELECT kind, level, updated_at FROM rate_buckets WHERE tenant = ?", (tenant.name,)
            )
            decision, buckets = take(costs, {kind: (lvl, ts) for kind, lvl, ts in rows}, now)
            conn.executemany(
                "INSERT OR REPLACE INTO rate_buckets VALUES (?, ?, ?, ?)",
                [(tenant.name, kind, lvl, ts) for kind, (lvl, ts) in buckets.items()],
            )
            return decision

        return await self._write(consume)

    async def reserve_tokens(
        self,
        tenant: Tenant,
        tokens: int,
        *,
        spend_usd: float = 0.0,
        now: float | None = None,
        ttl_s: float = 600.0,
    ) -> Reservation | None:
        now = now_or(now)
        r = new_reservation(tenant, tokens, spend_usd, now, ttl_s)

        def reserve(conn: sqlite3.Connection) -> Reservation | None:
            conn.execute(
                "DELETE FROM reservations WHERE tenant = ? AND expires_at <= ?", (tenant.name, now)
            )
            if not budget_allows(tenant, _usage(conn, r.tenant, r.month, now), tokens, spend_usd):
                return None
            conn.execute(
                "INSERT INTO reservations VALUES (?, ?, ?, ?, ?, ?)",
                (r.id, r.tenant, r.month, r.tokens, r.spend_usd, r.expires_at),
            )
            return r

        return await self._write(reserve)

    async def settle(
        self, reservation: Reservation, *, tokens_in: int, tokens_out: int, spend_usd: float
    ) -> None:
        def settle(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM reservations WHERE id = ?", (reservation.id,))
            conn.execute(
                "INSERT INTO usage VALUES (?, ?, 1, ?, ?, ?) ON CONFLICT (tenant, month) DO UPDATE"
                " SET requests = requests + 1, tokens_in = tokens_in + excluded.tokens_in,"
                " tokens_out = tokens_out + excluded.tokens_out,"
                " spend_usd = spend_usd + excluded.spend_usd",
                (reservation.tenant, reservation.month, tokens_in, tokens_out, spend_usd),
            )

        await self._write(settle)

    async def get_usage(
        self, tenant: str, month: str | None = None, *, now: float | None = None
    ) -> Usage:
        now = now_or(now)
        return await self._read(lambda conn: _usage(conn, tenant, month or month_of(now), now))


def _enc(record: msgspec.Struct) -> bytes:
    return msgspec.json.encode(record)


def _get_tenant(conn: sqlite3.Connection, name: str) -> Tenant | None:
    row = conn.execute("SELECT record FROM tenants WHERE name = ?", (name,)).fetchone()
    return None if row is None else msgspec.json.decode(row[0], type=Tenant)


def _require_tenant(conn: sqlite3.Connection, name: str) -> None:
    if conn.execute("SELECT 1 FROM tenants WHERE name = ?", (name,)).fetchone() is None:
        raise NotFound(f"tenant {name!r} does not exist")


def _usage(conn: sqlite3.Connection, tenant: str, month: str, now: float) -> Usage:
    row = conn.execute(
        "SELECT requests, tokens_in, tokens_out, spend_usd FROM usage"
        " WHERE tenant = ? AND month = ?",
        (tenant, month),
    ).fetchone()
    requests, tokens_in, tokens_out, spend_usd = row or (0, 0, 0, 0.0)
    reserved_tokens, reserved_spend = conn.execute(
        "SELECT COALESCE(SUM(tokens), 0), COALESCE(SUM(spend_usd), 0.0) FROM reservations"
        " WHERE tenant = ? AND month = ? AND expires_at > ?",
        (tenant, month, now),
    ).fetchone()
    return Usage(
        tenant=tenant,
        month=month,
        requests=requests,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        spend_usd=spend_usd,
        reserved_tokens=reserved_tokens,
        reserved_spend_usd=reserved_spend,
    )
