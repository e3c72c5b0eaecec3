"""SQLite backend: one file (WAL mode), calls run on the caller's event loop, never waiting.

A call is a transaction of a few indexed statements (tens of microseconds), so it runs right on
the event loop thread, on a connection that never waits for the file's write lock: handing every
call to a thread would cost more than the call. A call that would wait (another process, or a
bulk call of this one, is writing) goes to the store's worker thread instead, which waits for the
lock until LOCK_TIMEOUT_S after the call was made, then raises StoreUnavailable; so do calls whose
result grows with the data (listings, deleting a tenant), and the WAL checkpoints, whose fsync
must not stall the loop. A call whose writes the file's volume has no room for (or fails) raises
StoreFull, and the next calls write again once the operator frees disk space there.

NOTE: every write is a `BEGIN IMMEDIATE` transaction, so check-then-write sequences (rate buckets,
budget holds, version numbers) stay exact within a process and across processes sharing the file.

Authentication is cached in the process for `auth_cache_ttl_s` (2 s by default): a key revoked or
a tenant deleted or updated through this store takes effect at once; through another process
sharing the file, within the TTL.
"""

import asyncio
import errno
import logging
import math
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import msgspec

from store.errors import AlreadyExists, NotFound, StoreError, StoreFull, StoreUnavailable
from store.keys import KEY_PREFIX, hash_key, new_key, verify_key
from store.limits import (budget_allows, check_adapter_storage, month_of, new_reservation, now_or,
                          rate_costs, stored_files, take)
from store.models import (AdapterRecord, ApiKeyRecord, RateDecision, Reservation, Tenant, Usage,
                          updated_tenant)

T = TypeVar("T")

logger = logging.getLogger(__name__)

AUTH_CACHE_TTL_S = 2.0
_AUTH_CACHE_MAX_KEYS = 10_000
# The longest a call waits for another process's write lock (a gateway sharing the file, a script,
# an sqlite3 shell left inside a transaction), as long as a call waits for a stuck Redis: past it
# the request gets a 503 to retry rather than hanging.
LOCK_TIMEOUT_S = 2.0
# The least a call waits for the lock, even one whose time went on queueing behind this process's
# own calls: enough to ride out another process's writes, which hold it for microseconds.
_MIN_LOCK_WAIT_MS = 50
# How long a checkpoint's last step waits for another process's readers and writers before it
# settles for copying what it can; this process's writes wait behind it meanwhile.
_CHECKPOINT_LOCK_TIMEOUT_MS = 100
# Inline writes between WAL checkpoints. Each adds a few 4 KiB pages to the WAL; a checkpoint
# holds writes off for a few ms (two fsyncs), so it should come rarely enough to stay out of p99.
_WRITES_PER_CHECKPOINT = 1000
# Inline writes a checkpoint may let by while it waits for the worker or on a slow disk's fsyncs;
# later writes wait for it (on the worker), so the WAL stays bounded however slow the disk.
_WRITES_DURING_CHECKPOINT = _WRITES_PER_CHECKPOINT // 2
# How often writes refused for a full volume ask for a checkpoint that truncates the WAL: on a
# small volume the WAL itself, grown between checkpoints that only writes that succeed ask for,
# may be what filled it.
_FULL_CHECKPOINT_EVERY_S = 5.0
_READ, _WRITE = "BEGIN", "BEGIN IMMEDIATE"

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

    shared_blobs = None  # one machine: its blob folder is the only copy of adapter files

    def __init__(self, path: Path, auth_cache_ttl_s: float = AUTH_CACHE_TTL_S) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        self._conn: sqlite3.Connection | None = None  # the worker thread's
        self._inline_conn: sqlite3.Connection | None = None  # the event loop thread's
        self._inline_thread: int | None = None
        self._inline_writes_since_checkpoint = 0
        self._is_checkpointing = False  # set from asking the worker for a checkpoint to its end
        self._is_holding_writes = False  # set while a checkpoint needs the lock to itself
        self._full_checkpoint_at = -math.inf  # when a write refused for a full volume asked for one
        self._auth_cache_ttl_s = auth_cache_ttl_s
        self._auth_cache: dict[str, tuple[Tenant, float]] = {}  # key hash -> (tenant, expiry)
        self._auth_epoch = 0  # bumped whenever keys may have been revoked

    @classmethod
    async def open(cls, path: Path, auth_cache_ttl_s: float = AUTH_CACHE_TTL_S) -> "SqliteStore":
        """Open (creating if needed) the database file at `path`, for use on this thread's loop.

        StoreError if it cannot be used (its folder cannot be made, it is not a database, this
        process may not write it); StoreUnavailable while another process holds it locked.
        """
        store = cls(path, auth_cache_ttl_s)
        try:
            await store._call(store._connect_worker)
            store._inline_conn = _connect(path, lock_timeout_s=0.0)
        except (OSError, sqlite3.Error) as error:
            await store.close()
            if isinstance(error, sqlite3.OperationalError) and _is_busy(error):
                raise store._locked() from error
            # NOTE: from None: the message holds the cause, and startup logs show only this.
            if isinstance(error, sqlite3.OperationalError) and _is_full(error) \
                    or getattr(error, "errno", None) == errno.ENOSPC:
                # As the running store says (its SQLITE_IOERR too: a WAL's shared memory that
                # cannot grow on a full volume reads "disk I/O error").
                raise StoreError(f"cannot use {path} as the SQLite store ({error}): free disk space "
                                 f"on the volume of {path.parent}") from None
            raise StoreError(f"cannot use {path} as the SQLite store: {error}") from None
        # NOTE: checkpoints run on the worker thread (see _count_inline_write).
        store._inline_conn.execute("PRAGMA wal_autocheckpoint=0")
        store._inline_thread = threading.get_ident()
        return store

    def _connect_worker(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = conn = _connect(self.path, lock_timeout_s=LOCK_TIMEOUT_S)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(_SCHEMA)
        # NOTE: a file this process may not write opens read-only without a word, and commits
        # write transactions that write nothing: only a write (this one, rolled back) fails.
        conn.execute(_WRITE)
        try:
            _write_check(conn)
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")

    async def close(self) -> None:
        if self._inline_conn is not None:
            self._inline_conn.close()
            self._inline_conn = None
        if self._conn is not None:
            await self._call(self._conn.close)
            self._conn = None
        self._executor.shutdown(wait=True)

    async def _call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` in a read transaction (one consistent snapshot), see `_run`."""
        return await self._run(_READ, fn)

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` in a write transaction, holding the database's write lock from the start;
        see `_run`."""
        return await self._run(_WRITE, fn)

    async def _on_worker(self, begin: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` on the worker thread, which waits for the lock if it must, until LOCK_TIMEOUT_S
        from now: calls queued behind one that waits do not each wait that long anew."""
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        return await self._call(lambda: self._worker_transaction(begin, fn, deadline))

    def _worker_transaction(self, begin: str, fn: Callable[[sqlite3.Connection], T],
                            deadline: float) -> T:
        conn = self._conn
        assert conn is not None, "SqliteStore used after close()"
        # NOTE: every call sets its own wait, so a checkpoint's shorter one never outlives it.
        wait_ms = max(_MIN_LOCK_WAIT_MS, round((deadline - time.monotonic()) * 1000))
        conn.execute(f"PRAGMA busy_timeout = {wait_ms}")
        try:
            return _transaction(conn, begin, fn)
        except sqlite3.OperationalError as error:
            if _is_full(error):
                raise self._full(error) from error
            if not _is_busy(error):
                raise
            raise self._locked() from error

    def _locked(self) -> StoreUnavailable:
        return StoreUnavailable(f"the SQLite store {self.path} stayed locked by another process "
                                f"for {LOCK_TIMEOUT_S:g} s")

    def _full(self, error: sqlite3.OperationalError) -> StoreFull:
        if time.monotonic() - self._full_checkpoint_at >= _FULL_CHECKPOINT_EVERY_S:
            self._full_checkpoint_at = time.monotonic()
            self._ask_for_checkpoint("TRUNCATE")  # gives back the WAL's room on the volume
        return StoreFull(f"the SQLite store {self.path} cannot be written ({error}): free disk "
                         f"space on the volume of {self.path.parent}")

    async def _run(self, begin: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` right here if the lock it needs is free, else on the worker thread."""
        conn = self._inline_conn
        # NOTE: writes queue up behind a checkpoint's last step, which they would otherwise starve,
        # and behind a checkpoint too slow to keep up with them.
        is_held_off = begin == _WRITE and (self._is_holding_writes or self._is_checkpoint_behind())
        if conn is not None and threading.get_ident() == self._inline_thread and not is_held_off:
            try:
                result = _transaction(conn, begin, fn)
            except sqlite3.OperationalError as error:
                if _is_full(error):
                    raise self._full(error) from error
                if not _is_busy(error):
                    raise
                # Rolled back, so it can run again: on the worker, which waits for the lock.
            else:
                if begin == _WRITE:
                    self._count_inline_write()
                return result
        return await self._on_worker(begin, fn)

    def _count_inline_write(self) -> None:
        self._inline_writes_since_checkpoint += 1
        if self._inline_writes_since_checkpoint >= _WRITES_PER_CHECKPOINT:
            self._ask_for_checkpoint("RESTART")

    def _ask_for_checkpoint(self, mode: str) -> None:
        """A checkpoint (see _checkpoint) on the worker thread, unless one is under way."""
        if not self._is_checkpointing:
            self._is_checkpointing = True
            self._inline_writes_since_checkpoint = 0
            self._executor.submit(self._checkpoint, mode)

    def _is_checkpoint_behind(self) -> bool:
        return self._is_checkpointing \
            and self._inline_writes_since_checkpoint >= _WRITES_DURING_CHECKPOINT

    def _checkpoint(self, mode: str) -> None:
        """Copy the WAL into the database file, on the worker thread, so that it starts over.

        A PASSIVE checkpoint copies the bulk (and fsyncs) while writes go on. Under steady writes
        it never catches up, though, and the WAL would only grow; so a RESTART (`mode`; TRUNCATE
        also gives its room on the volume back) then copies the few frames written meanwhile
        with this process's writes held off (they wait on the worker thread), which lets the
        next write start the WAL over.
        """
        conn = self._conn
        assert conn is not None, "SqliteStore used after close()"
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            self._is_holding_writes = True
            conn.execute(f"PRAGMA busy_timeout = {_CHECKPOINT_LOCK_TIMEOUT_MS}")
            conn.execute(f"PRAGMA wal_checkpoint({mode})")
        except Exception as error:  # the WAL only grows until the next checkpoint succeeds
            if isinstance(error, sqlite3.OperationalError) and _is_full(error):
                # The volume is full of more than the WAL: the writes' StoreFull says so.
                logger.warning("WAL checkpoint of %s failed: %s", self.path, error)
            else:
                logger.exception("WAL checkpoint of %s failed", self.path)
        finally:
            self._is_holding_writes = False
            self._is_checkpointing = False

    async def ensure_writable(self) -> None:
        # NOTE: a committed write: it takes the write lock (waiting as any write does), and
        # appends to the WAL, which an empty transaction would not: a full disk fails it.
        await self._write(_write_check)

    def _forget_keys(self) -> None:
        """Drop cached authentications, including lookups in flight (keys may be revoked)."""
        self._auth_epoch += 1
        self._auth_cache.clear()

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

        return await self._on_worker(_READ, select)

    async def update_tenant(self, name: str, changes: dict[str, object]) -> Tenant:
        def update(conn: sqlite3.Connection) -> Tenant:
            stored = _tenant_record(conn, name)
            if stored is None:
                raise NotFound(f"tenant {name!r} does not exist")
            updated, record = updated_tenant(stored, changes)
            conn.execute("UPDATE tenants SET record = ? WHERE name = ?", (record, name))
            return updated

        try:
            return await self._write(update)
        finally:
            self._forget_keys()  # cached authentications hold the tenant's old settings

    async def delete_tenant(self, name: str) -> list[AdapterRecord]:
        def delete(conn: sqlite3.Connection) -> list[AdapterRecord]:
            _require_tenant(conn, name)
            rows = conn.execute(
                "SELECT record FROM adapters WHERE tenant = ? ORDER BY name, version", (name,)
            )
            removed = [msgspec.json.decode(r, type=AdapterRecord) for (r,) in rows]
            conn.execute("DELETE FROM tenants WHERE name = ?", (name,))
            for table in ("api_keys", "adapters", "rate_buckets", "usage", "reservations"):
                conn.execute(f"DELETE FROM {table} WHERE tenant = ?", (name,))
            return removed

        try:
            return await self._on_worker(_WRITE, delete)
        finally:
            self._forget_keys()

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
        cached = self._auth_cache.get(key_hash)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]

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

        epoch = self._auth_epoch
        tenant = await self._read(lookup)
        if tenant is not None and epoch == self._auth_epoch and self._auth_cache_ttl_s > 0:
            if len(self._auth_cache) >= _AUTH_CACHE_MAX_KEYS:
                self._auth_cache.clear()
            self._auth_cache[key_hash] = (tenant, time.monotonic() + self._auth_cache_ttl_s)
        return tenant

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

        try:
            return await self._write(revoke)
        finally:
            self._forget_keys()

    async def list_keys(self, tenant: str) -> list[ApiKeyRecord]:
        def select(conn: sqlite3.Connection) -> list[ApiKeyRecord]:
            rows = conn.execute("SELECT record FROM api_keys WHERE tenant = ?", (tenant,))
            records = [msgspec.json.decode(r, type=ApiKeyRecord) for (r,) in rows]
            return sorted(records, key=lambda k: (k.created_at, k.id))

        return await self._on_worker(_READ, select)

    async def get_admin_key_hash(self) -> str | None:
        def select(conn: sqlite3.Connection) -> str | None:
            row = conn.execute(
                "SELECT value FROM settings WHERE name = 'admin_key_hash'"
            ).fetchone()
            return None if row is None else row[0]

        return await self._read(select)

    async def get_store_id(self) -> str:
        def select(conn: sqlite3.Connection) -> str | None:
            row = conn.execute("SELECT value FROM settings WHERE name = 'store_id'").fetchone()
            return None if row is None else row[0]

        def claim(conn: sqlite3.Connection) -> str:
            conn.execute("INSERT OR IGNORE INTO settings VALUES ('store_id', ?)", (uuid.uuid4().hex,))
            return select(conn)

        # NOTE: read first: the write lock is another process's while it writes.
        return await self._read(select) or await self._write(claim)

    async def set_admin_key_hash(self, key_hash: str, *, only_if_unset: bool = False) -> bool:
        verb = "INSERT OR IGNORE" if only_if_unset else "INSERT OR REPLACE"
        return await self._write(
            lambda conn: conn.execute(
                f"{verb} INTO settings VALUES ('admin_key_hash', ?)", (key_hash,)
            ).rowcount == 1
        )

    # Adapter records.

    async def put_adapter_record(self, record: AdapterRecord) -> AdapterRecord:
        def insert(conn: sqlite3.Connection) -> AdapterRecord:
            tenant = _get_tenant(conn, record.tenant)
            if tenant is None:
                raise NotFound(f"tenant {record.tenant!r} does not exist")
            if tenant.max_adapter_bytes is not None:
                check_adapter_storage(tenant, _stored_files(conn, tenant.name), record)
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

        # On the worker: under a storage limit it reads every record of the tenant.
        return await self._on_worker(_WRITE, insert)

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

        return await self._on_worker(_READ, select)

    async def get_adapter_files(self, tenant: str) -> dict[str, int]:
        return await self._on_worker(_READ, lambda conn: _stored_files(conn, tenant))

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
        self, tenant: Tenant, *, requests: int = 1, tokens: int = 0, now: float | None = None,
        overdraw: bool = False,
    ) -> RateDecision:
        costs = rate_costs(tenant, requests, tokens)
        if not costs:
            return RateDecision(True)
        now = now_or(now)

        def consume(conn: sqlite3.Connection) -> RateDecision:
            rows = conn.execute(
                "SELECT kind, level, updated_at FROM rate_buckets WHERE tenant = ?", (tenant.name,)
            )
            levels = {kind: (lvl, ts) for kind, lvl, ts in rows}
            decision, buckets = take(costs, levels, now, overdraw)
            # An upsert updates the row in place; REPLACE would delete it and rewrite its index.
            conn.executemany(
                "INSERT INTO rate_buckets VALUES (?, ?, ?, ?) ON CONFLICT (tenant, kind)"
                " DO UPDATE SET level = excluded.level, updated_at = excluded.updated_at",
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

    async def extend_hold(
        self, reservation: Reservation, *, ttl_s: float = 600.0, now: float | None = None
    ) -> bool:
        now = now_or(now)

        def extend(conn: sqlite3.Connection) -> bool:
            return conn.execute(
                "UPDATE reservations SET expires_at = ? WHERE id = ? AND expires_at > ?",
                (now + ttl_s, reservation.id, now),
            ).rowcount == 1

        return await self._write(extend)

    async def settle(
        self, reservation: Reservation, *, tokens_in: int, tokens_out: int, spend_usd: float
    ) -> bool:
        def settle(conn: sqlite3.Connection) -> bool:
            conn.execute("DELETE FROM reservations WHERE id = ?", (reservation.id,))
            tenant = _get_tenant(conn, reservation.tenant)
            if tenant is None or tenant.created_at != reservation.tenant_created_at:
                return False  # the tenant was deleted meanwhile (and maybe made anew): its usage went too
            conn.execute(
                "INSERT INTO usage VALUES (?, ?, 1, ?, ?, ?) ON CONFLICT (tenant, month) DO UPDATE"
                " SET requests = requests + 1, tokens_in = tokens_in + excluded.tokens_in,"
                " tokens_out = tokens_out + excluded.tokens_out,"
                " spend_usd = spend_usd + excluded.spend_usd",
                (reservation.tenant, reservation.month, tokens_in, tokens_out, spend_usd),
            )
            return True

        return await self._write(settle)

    async def release(self, reservation: Reservation) -> None:
        await self._write(
            lambda conn: conn.execute("DELETE FROM reservations WHERE id = ?", (reservation.id,))
        )

    async def get_usage(
        self, tenant: str, month: str | None = None, *, now: float | None = None
    ) -> Usage:
        now = now_or(now)
        return await self._read(lambda conn: _usage(conn, tenant, month or month_of(now), now))


def _enc(record: msgspec.Struct) -> bytes:
    return msgspec.json.encode(record)


def _connect(path: Path, lock_timeout_s: float) -> sqlite3.Connection:
    # isolation_level=None: transactions are only the explicit BEGINs; check_same_thread=False:
    # each connection is used by one thread, but closed by whichever thread closes the store.
    conn = sqlite3.connect(path, isolation_level=None, timeout=lock_timeout_s,
                           check_same_thread=False)
    try:
        conn.execute("PRAGMA synchronous=NORMAL")
    except BaseException:  # a full volume fails even this: the files must not stay open
        conn.close()
        raise
    return conn


def _is_busy(error: sqlite3.OperationalError) -> bool:
    """Whether `error` is SQLITE_BUSY: another connection holds the lock the call needed."""
    return error.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY


def _is_full(error: sqlite3.OperationalError) -> bool:
    """Whether `error` is SQLITE_FULL (the volume has no room left) or SQLITE_IOERR (it failed a
    write: a disk quota, a failing disk): neither mends by itself."""
    return error.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)


def _write_check(conn: sqlite3.Connection) -> None:
    """Write one row, a new value each time: SQLite skips writing a row that it leaves unchanged."""
    conn.execute("INSERT INTO settings VALUES ('write_check', ?) ON CONFLICT (name)"
                 " DO UPDATE SET value = excluded.value", (repr(time.time()),))


def _transaction(conn: sqlite3.Connection | None, begin: str,
                 fn: Callable[[sqlite3.Connection], T]) -> T:
    assert conn is not None, "SqliteStore used after close()"
    conn.execute(begin)
    try:
        result = fn(conn)
        # NOTE: inside the try: a COMMIT can fail too (the WAL cannot grow on a full disk), and
        # must not leave the transaction open for the connection's next call.
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # some errors (SQLITE_FULL, ...) have rolled back already
            conn.execute("ROLLBACK")
        raise
    return result


def _get_tenant(conn: sqlite3.Connection, name: str) -> Tenant | None:
    record = _tenant_record(conn, name)
    return None if record is None else msgspec.json.decode(record, type=Tenant)


def _tenant_record(conn: sqlite3.Connection, name: str) -> bytes | None:
    """The tenant's record as stored (JSON), or None if there is no such tenant."""
    row = conn.execute("SELECT record FROM tenants WHERE name = ?", (name,)).fetchone()
    return None if row is None else row[0]


def _require_tenant(conn: sqlite3.Connection, name: str) -> None:
    if conn.execute("SELECT 1 FROM tenants WHERE name = ?", (name,)).fetchone() is None:
        raise NotFound(f"tenant {name!r} does not exist")


def _stored_files(conn: sqlite3.Connection, tenant: str) -> dict[str, int]:
    """store.limits.stored_files of every version of every adapter of `tenant`."""
    rows = conn.execute("SELECT record FROM adapters WHERE tenant = ?", (tenant,))
    return stored_files(msgspec.json.decode(r, type=AdapterRecord) for (r,) in rows)


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
