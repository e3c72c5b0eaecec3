"""Redis backend, for several gateway processes sharing tenants, keys, limits, budgets and
adapter files.

Records are msgspec JSON strings, adapter files chunked byte strings (store.redis_blobs).
Multi-key writes are WATCH/MULTI transactions (retried when a watched key changes); rate buckets
and budget holds are Lua scripts (store.redis_lua), so concurrent consumers in any number of
processes never exceed a limit.

While Redis cannot be reached, calls fail fast (refused at once, stuck after _TIMEOUT_S; those
waiting for a pooled connection meanwhile, at once too) with one of REDIS_UNAVAILABLE_ERRORS.
Nothing needs reopening when it is back: the connection pool reconnects, and redis-py re-sends a
script that a restarted server no longer has (NOSCRIPT).
"""

import re
import time
import uuid
from contextvars import ContextVar
from urllib.parse import unquote_plus, urlsplit

import msgspec
import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis._parsers import BaseParser
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from store import redis_lua
from store.base import SHARED_STORE_ID_PREFIX
from store.errors import AlreadyExists, NotFound
from store.keys import KEY_PREFIX, hash_key, new_key, verify_key
from store.limits import (SPEND_TOLERANCE_USD, WINDOW_S, check_adapter_storage, month_of,
                          months_in_flight, new_reservation, now_or, rate_costs, stored_files)
from store.models import (AdapterRecord, ApiKeyRecord, RateDecision, Reservation, Tenant, Usage,
                          updated_tenant)
from store.redis_blobs import RedisBlobs



class PersistenceError(redis_errors.ResponseError):
    """MISCONF: Redis refuses writes (and PING) because its last snapshot to disk failed, a full
    or lost disk, until a save succeeds again. redis-py knows no class for it."""


# NOTE: registered in redis-py's own table, which every parser reads (a parser subclass would
# have to be passed to each connection, and redis-py's newer connection features refuse one). A
# subclass of ResponseError, so code catching that still catches it.
BaseParser.EXCEPTION_CLASSES.setdefault("MISCONF", PersistenceError)


# Redis is down, unreachable, stuck, or still loading its data after a restart (BusyLoadingError
# is a ConnectionError), or it refuses writes for now: out of its maxmemory with noeviction, a
# replica after a failover, its disk failing its snapshots, a transaction it discarded for any of
# them: the call did not happen or its outcome is unknown; retry later.
REDIS_UNAVAILABLE_ERRORS = (redis_errors.ConnectionError, redis_errors.TimeoutError,
                            redis_errors.OutOfMemoryError, redis_errors.ReadOnlyError,
                            redis_errors.ExecAbortError, redis_errors.MasterDownError,
                            PersistenceError)
# Of those, Redis out of its maxmemory with noeviction ("OOM command not allowed when used memory >
# 'maxmemory'", from a command, a script or a transaction alike): unlike the others it lasts until
# someone gives Redis more memory or deletes some of its data, so retrying soon does not help.
REDIS_FULL_ERRORS = (redis_errors.OutOfMemoryError,)
_TIMEOUT_S = 2.0  # to connect, and for each reply: every command here is short (none blocks)
# What each of those means, most specific first (for an operator: gateway /health).
REDIS_UNAVAILABLE_CAUSES: tuple[tuple[type[Exception], str], ...] = (
    (redis_errors.AuthenticationError, "Redis refuses the gateway's credentials (the user and "
     "password in the store's redis:// URL)"),
    (redis_errors.BusyLoadingError, "Redis is loading its data after a restart"),
    (redis_errors.ConnectionError, "Redis cannot be reached (down, restarting, or refusing "
     "connections)"),
    (redis_errors.TimeoutError, f"Redis did not answer within {_TIMEOUT_S:g} s (overloaded, or "
     "the network to it is slow)"),
    (redis_errors.OutOfMemoryError, "Redis is out of its maxmemory"),
    (redis_errors.ReadOnlyError, "Redis refuses writes: the store's URL names a read-only "
     "replica (after a failover, point it at the new primary)"),
    (redis_errors.MasterDownError, "Redis refuses writes: the replica the store's URL names lost "
     "its primary"),
    (PersistenceError, "Redis refuses writes because its last snapshot to disk failed (MISCONF): "
     "see Redis's log"),
    (redis_errors.ExecAbortError, "Redis discarded a transaction it refused a write of"),
)
# Per client; a call past them waits for one to come free. Redis answers one command at a time, so
# more connections add no throughput; and a burst that opens many at once on a busy host sees some
# of them time out connecting (after _TIMEOUT_S), each a 503: 128 did so on a loaded 2-core host.
MAX_CONNECTIONS = 32
# How long a settled call's marker is kept: longer than its settle is tried again for (about a
# minute, gateway.admission.SETTLE_RETRY_WAITS_S). Some 100 bytes of Redis memory per call.
SETTLED_KEPT_S = 600
# How long a call waits for a free pooled connection: a wait is load (a burst of calls on a busy
# gateway holds them all), not Redis down, so it is not bounded by the Redis timeout; a Redis
# that is down fails each call on its connection within that timeout, and those waiting for one
# at once (_FailFastPool).
POOL_WAIT_S = 60.0


def masked_url(url: str) -> str:
    """`url` as it may be shown: all between "://" and its last "@" (a password, after the
    user's name and ":" if any) as ***, and so the value of a `password` query argument, which
    redis-py takes too. Read from the text as typed, not as parsed: a password holding "/", "?"
    or "#" ends the parsed host early, and the rest of it parses as the path."""
    scheme, separator, rest = url.partition("://")
    credentials, at, address = rest.rpartition("@")
    if separator and at:
        user, colon, _ = credentials.partition(":")
        url = f"{scheme}://{user + ':' if colon else ''}***@{address}"
    head, question, query = url.partition("?")
    if not question:
        return url
    # NOTE: names are compared decoded, as redis-py reads them ("pass%77ord" is "password").
    arguments = [f"{name}=***" if unquote_plus(name) == "password" else f"{name}{equals}{value}"
                 for name, equals, value in (a.partition("=") for a in query.split("&"))]
    return f"{head}?{'&'.join(arguments)}"


def check_redis_url(url: str) -> str:
    """`url` if redis-py can connect by it (redis://, rediss:// with an optional number db, or
    unix:// with a socket path); ValueError saying what is wrong, never echoing a password."""
    try:
        parts = urlsplit(url)
    except ValueError as error:  # NOTE: its message does not hold the URL, nor its password
        raise ValueError(f"cannot use the Redis URL: {error}") from None
    shown = masked_url(url)
    problem = None
    if "@" in url.partition("://")[2].removeprefix(parts.netloc):
        # An "@" past the host as parsed: a password holding "/", "?" or "#", which end the host
        # (openssl rand -base64 makes such passwords). redis-py would connect elsewhere, with
        # no password or part of it, and its errors quote the parts they parsed: its own.
        problem = ("its password holds a character a URL reserves (/, ? or #): percent-encode "
                   "it (/ as %2F, ? as %3F, # as %23)")
    elif parts.scheme not in ("redis", "rediss", "unix"):
        problem = "it is not a Redis URL (redis://host:port/0, rediss://..., unix:///path)"
    elif parts.scheme == "unix" and not parts.path:
        problem = "unix:// needs the socket's path, as unix:///run/redis.sock"
    elif parts.scheme != "unix" and not re.fullmatch(r"/?\d*", parts.path):
        problem = "the database must be a number, as redis://host:6379/0"
    else:
        try:
            # NOTE: a connection is only built, not opened: redis-py passes a query argument it
            # does not know on to the connection (a TypeError, as it first connects).
            aioredis.ConnectionPool.from_url(url).make_connection()
        except ValueError as error:
            problem = str(error)
        except TypeError as error:
            unknown = re.search(r"argument '(\w+)'", str(error))
            problem = (f"redis-py knows no query argument {unknown[1]!r} (a typo?)" if unknown
                       else str(error))
    if problem is not None:
        raise ValueError(f"cannot use the Redis URL {shown!r}: {problem}")
    return url


# When the call this task makes began to wait for a pooled connection (time.monotonic()).
_waiting_since: ContextVar[float] = ContextVar("_waiting_since", default=float("inf"))


class _StoppedAnswering(redis_errors.ConnectionError):
    """A call that waited for a connection while Redis stopped answering others."""


class _FailFastPool(aioredis.BlockingConnectionPool):
    """A pool whose calls waiting for a connection fail at once when Redis stops answering
    meanwhile: each waiter would get a connection in turn, only to wait out the timeout on it too.
    Behind a burst of 200 calls on a stopped Redis, the last 503 came after 14 s (a /health
    probe's after 13), a timeout for each 32 calls, where the README says 2 s.

    Redis stopped answering when a connection could not be made, or one was held the whole
    timeout and came back disconnected (redis-py disconnects one a call failed on; one a call
    was cancelled on too, which a healthy Redis answers long before the timeout)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._timeout_s = self.connection_kwargs.get("socket_timeout") or 0.0
        self._failed_at = -float("inf")  # time.monotonic() when Redis last stopped answering
        self._handed_out_at: dict[int, float] = {}  # id(connection) -> when

    async def get_connection(self, *args, **kwargs):
        token = _waiting_since.set(time.monotonic())
        try:
            connection = await super().get_connection(*args, **kwargs)
        except _StoppedAnswering:
            raise
        except REDIS_UNAVAILABLE_ERRORS:  # it could not connect
            self._failed_at = time.monotonic()
            raise
        finally:
            _waiting_since.reset(token)
        self._handed_out_at[id(connection)] = time.monotonic()
        return connection

    async def ensure_connection(self, connection) -> None:
        # NOTE: between the wait for a connection and connecting it (which may wait too).
        if self._failed_at >= _waiting_since.get():
            raise _StoppedAnswering(
                "Redis failed another call (it refused a connection, or left one unanswered "
                f"for {self._timeout_s:g} s) while this one waited for a connection")
        await super().ensure_connection(connection)

    async def release(self, connection) -> None:
        handed_out_at = self._handed_out_at.pop(id(connection), None)
        if (handed_out_at is not None and not connection.is_connected
                and time.monotonic() - handed_out_at >= self._timeout_s):
            self._failed_at = time.monotonic()
        await super().release(connection)


def connect(url: str, timeout_s: float, *, decode_responses: bool = False,
            retry: Retry | None = None) -> aioredis.Redis:
    """A client of the Redis at `url` (`timeout_s` to connect and for each reply) whose calls wait
    (at most POOL_WAIT_S) for a free pooled connection: redis-py's default pool fails a call past
    its 100 connections at once ("Too many connections"), and a wait of `timeout_s` failed calls
    of a burst of 600 on a busy gateway ("No connection available"), which both took for Redis
    down: a 503 for a call, and for one answered already its usage not billed."""
    options = {"retry": retry} if retry is not None else {}
    pool = _FailFastPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=POOL_WAIT_S, decode_responses=decode_responses,
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **options)
    return aioredis.Redis.from_pool(pool)


class RedisKeys:
    """Redis key names, all under one prefix so deployments can share a server."""

    def __init__(self, prefix: str) -> None:
        self.p = prefix
        self.tenants = prefix + "tenants"  # set of tenant names
        self.admin_key_hash = prefix + "admin_key_hash"
        self.store_id = prefix + "store_id"

    def tenant(self, name: str) -> str:
        return f"{self.p}tenant:{name}"

    def api_key(self, key_id: str) -> str:
        return f"{self.p}apikey:{key_id}"

    def api_key_hash(self, key_hash: str) -> str:
        return f"{self.p}apikeyhash:{key_hash}"  # -> key id, for live keys only

    def api_keys(self, tenant: str) -> str:
        return f"{self.p}apikeys:{tenant}"  # set of key ids

    def adapter(self, tenant: str, name: str) -> str:
        return f"{self.p}adapter:{tenant}:{name}"  # hash: version -> record

    def adapters(self, tenant: str) -> str:
        return f"{self.p}adapters:{tenant}"  # set of adapter names

    def digest(self, digest: str) -> str:
        return f"{self.p}digest:{digest}"  # set of "tenant/name/version" refs

    def rate(self, tenant: str) -> str:
        return f"{self.p}rate:{tenant}"

    def usage(self, tenant: str, month: str) -> str:
        return f"{self.p}usage:{tenant}:{month}"

    def holds(self, tenant: str, month: str) -> str:
        return f"{self.p}holds:{tenant}:{month}"

    def settled(self, reservation_id: str) -> str:
        return f"{self.p}settled:{reservation_id}"  # for SETTLED_KEPT_S (see RedisStore.settle)

    def monthly_patterns(self, tenant: str) -> list[str]:
        """SCAN patterns of every month's usage and holds of `tenant`."""
        prefix = re.sub(r"([*?\[\]\\])", r"\\\1", self.p)  # the prefix as a glob, literally
        return [f"{prefix}usage:{tenant}:*", f"{prefix}holds:{tenant}:*"]

    def blob(self, digest: str) -> str:
        return f"{self.p}blob:{digest}"  # an adapter's files: their manifest (store.redis_blobs)

    def blob_chunk(self, digest: str, index: int) -> str:
        return f"{self.p}blob:{digest}:{index}"

    def blob_staged(self, token: str, index: int) -> str:
        return f"{self.p}blob-staged:{token}:{index}"  # a chunk of a write not committed yet


class ReadTogether:
    """Reads of several keys at one instant, as a transaction would give them, that still answer
    while Redis is out of its maxmemory (redis_lua.READ_TOGETHER)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._script = client.register_script(redis_lua.READ_TOGETHER)

    async def __call__(self, *reads: tuple[str, str]) -> list:
        """The reply to each (command, key) of `reads`, in order: a dict for HGETALL, a list for
        HVALS."""
        return (await self.with_clock(*reads))[0]

    async def with_clock(self, *reads: tuple[str, str]) -> tuple[list, float]:
        """The replies, as the call gives them, and Redis's clock when they were read (seconds)."""
        *replies, (seconds, microseconds) = await self._script(
            keys=[key for _, key in reads], args=[command for command, _ in reads])
        return ([dict(zip(reply[::2], reply[1::2])) if command == "HGETALL" else reply
                 for (command, _), reply in zip(reads, replies)],
                int(seconds) + int(microseconds) / 1e6)


class RedisStore:
    """The Store protocol over Redis; build it with `await RedisStore.open(url)`."""

    def __init__(self, client: aioredis.Redis, blob_client: aioredis.Redis,
                 prefix: str = "sb:") -> None:
        self._redis = client
        self._keys = RedisKeys(prefix)
        self._rate_script = client.register_script(redis_lua.RATE)
        self._reserve_script = client.register_script(redis_lua.RESERVE)
        self._extend_hold_script = client.register_script(redis_lua.EXTEND_HOLD)
        self._read_together = ReadTogether(client)
        # NOTE: its own client, with decode_responses=False: adapter files are bytes.
        self.shared_blobs = RedisBlobs(blob_client, self._keys)

    @classmethod
    async def open(cls, url: str, prefix: str = "sb:") -> "RedisStore":
        """Connect to the Redis at `url` (redis://host:port/db) and check that it answers; a
        ConnectionError saying so if it does not."""
        # NOTE: a call whose connection drops is retried once, at once, on a new connection: after
        # a Redis restart every pooled connection is dead, and this reconnects instead of failing
        # the call. Timeouts are not retried: Redis is stuck, and a retry only doubles the wait.
        retry = Retry(NoBackoff(), 1, supported_errors=(redis_errors.ConnectionError,))
        client, blob_client = (connect(url, _TIMEOUT_S, decode_responses=decode, retry=retry)
                               for decode in (True, False))
        try:
            await client.ping()
        except REDIS_UNAVAILABLE_ERRORS as error:
            await client.aclose()
            await blob_client.aclose()
            # NOTE: from None: the message holds the cause, and startup logs show only this.
            unreachable = isinstance(error, (redis_errors.ConnectionError, redis_errors.TimeoutError))
            fix = "start Redis, or correct the store URL" if unreachable else "mend what Redis says"
            raise redis_errors.ConnectionError(
                f"cannot {'reach' if unreachable else 'use'} the Redis store at {_address(client)} "
                f"({fix}): {error}") from None
        return cls(client, blob_client, prefix)

    async def close(self) -> None:
        await self._redis.aclose()
        await self.shared_blobs.close()

    async def ensure_writable(self) -> None:
        # NOTE: a write: a Redis out of memory, or a replica, answers PING but refuses writes.
        await self._redis.set(self._keys.p + "writable", "1", ex=60)

    # Tenants.

    async def create_tenant(self, tenant: Tenant) -> Tenant:
        key = self._keys.tenant(tenant.name)

        async def insert(pipe: Pipeline) -> Tenant:
            if await pipe.exists(key):
                raise AlreadyExists(f"tenant {tenant.name!r} already exists")
            pipe.multi()
            pipe.set(key, _enc(tenant))
            pipe.sadd(self._keys.tenants, tenant.name)
            return tenant

        return await self._redis.transaction(insert, key, value_from_callable=True)

    async def get_tenant(self, name: str) -> Tenant | None:
        raw = await self._redis.get(self._keys.tenant(name))
        return None if raw is None else msgspec.json.decode(raw, type=Tenant)

    async def list_tenants(self) -> list[Tenant]:
        names = sorted(await self._redis.smembers(self._keys.tenants))
        if not names:
            return []
        raws = await self._redis.mget([self._keys.tenant(n) for n in names])
        return [msgspec.json.decode(r, type=Tenant) for r in raws if r is not None]

    async def update_tenant(self, name: str, changes: dict[str, object]) -> Tenant:
        key = self._keys.tenant(name)

        async def update(pipe: Pipeline) -> Tenant:
            raw = await pipe.get(key)
            if raw is None:
                raise NotFound(f"tenant {name!r} does not exist")
            updated, record = updated_tenant(raw, changes)
            pipe.multi()
            pipe.set(key, record)
            return updated

        return await self._redis.transaction(update, key, value_from_callable=True)

    async def delete_tenant(self, name: str) -> list[AdapterRecord]:
        k = self._keys
        # Its usage goes too: a tenant made anew under the name starts from nothing (and a call of
        # this one still in flight settles into nothing: see settle).
        monthly = [key for pattern in k.monthly_patterns(name)
                   async for key in self._redis.scan_iter(match=pattern, count=1000)]
        # NOTE: a call still in flight may create its month's usage or holds after the scan (its
        # first of the month): watched, so that such a write retries this delete, which then
        # deletes them too. A settle after the delete finds no tenant and writes nothing.
        in_flight = [key for month in months_in_flight(now_or(None))
                     for key in (k.usage(name, month), k.holds(name, month))]

        async def delete(pipe: Pipeline) -> list[AdapterRecord]:
            await pipe.watch(*in_flight)
            if not await pipe.exists(k.tenant(name)):
                raise NotFound(f"tenant {name!r} does not exist")
            key_keys = [k.api_key(i) for i in await pipe.smembers(k.api_keys(name))]
            adapter_keys = [k.adapter(name, n) for n in await pipe.smembers(k.adapters(name))]
            # NOTE: watched before being read, so a concurrent write to them retries this delete.
            if key_keys or adapter_keys:
                await pipe.watch(*key_keys, *adapter_keys)
            key_records = [
                msgspec.json.decode(r, type=ApiKeyRecord) for r in await _mget(pipe, key_keys)
            ]
            removed = [a for key in adapter_keys for a in _decode_versions(await pipe.hvals(key))]
            pipe.multi()
            pipe.delete(k.tenant(name), k.api_keys(name), k.adapters(name), k.rate(name))
            pipe.srem(k.tenants, name)
            for key in key_keys + adapter_keys + [k.api_key_hash(r.key_hash) for r in key_records]:
                pipe.delete(key)
            pipe.delete(*dict.fromkeys(monthly + in_flight))
            for a in removed:
                pipe.srem(k.digest(a.digest), _ref(a))
            return sorted(removed, key=lambda a: (a.name, a.version))

        watches = (k.tenant(name), k.api_keys(name), k.adapters(name))
        return await self._redis.transaction(delete, *watches, value_from_callable=True)

    # API keys.

    async def create_key(self, tenant: str, now: float | None = None) -> tuple[ApiKeyRecord, str]:
        record, plaintext = new_key(tenant, now)
        k = self._keys

        async def insert(pipe: Pipeline) -> None:
            if not await pipe.exists(k.tenant(tenant)):
                raise NotFound(f"tenant {tenant!r} does not exist")
            pipe.multi()
            pipe.set(k.api_key(record.id), _enc(record))
            pipe.set(k.api_key_hash(record.key_hash), record.id)
            pipe.sadd(k.api_keys(tenant), record.id)

        await self._redis.transaction(insert, k.tenant(tenant))
        return record, plaintext

    async def authenticate(self, plaintext: str) -> Tenant | None:
        if not plaintext.startswith(KEY_PREFIX):
            return None
        key_id = await self._redis.get(self._keys.api_key_hash(hash_key(plaintext)))
        raw = None if key_id is None else await self._redis.get(self._keys.api_key(key_id))
        if raw is None:
            return None
        record = msgspec.json.decode(raw, type=ApiKeyRecord)
        if record.revoked or not verify_key(plaintext, record.key_hash):
            return None
        return await self.get_tenant(record.tenant)

    async def revoke_key(self, key_id: str) -> ApiKeyRecord:
        key = self._keys.api_key(key_id)

        async def revoke(pipe: Pipeline) -> ApiKeyRecord:
            raw = await pipe.get(key)
            if raw is None:
                raise NotFound(f"API key {key_id!r} does not exist")
            record = msgspec.structs.replace(
                msgspec.json.decode(raw, type=ApiKeyRecord), revoked=True
            )
            pipe.multi()
            pipe.set(key, _enc(record))
            pipe.delete(self._keys.api_key_hash(record.key_hash))
            return record

        return await self._redis.transaction(revoke, key, value_from_callable=True)

    async def list_keys(self, tenant: str) -> list[ApiKeyRecord]:
        ids = await self._redis.smembers(self._keys.api_keys(tenant))
        raws = await _mget(self._redis, [self._keys.api_key(i) for i in ids])
        records = [msgspec.json.decode(r, type=ApiKeyRecord) for r in raws]
        return sorted(records, key=lambda r: (r.created_at, r.id))

    async def get_admin_key_hash(self) -> str | None:
        return await self._redis.get(self._keys.admin_key_hash)

    async def get_store_id(self) -> str:
        # NOTE: read first: a write is refused while Redis is full, and this is asked at startup.
        store_id = await self._redis.get(self._keys.store_id)
        if store_id is None:
            await self._redis.set(self._keys.store_id, f"{SHARED_STORE_ID_PREFIX}{uuid.uuid4().hex}", nx=True)
            store_id = await self._redis.get(self._keys.store_id)
        return store_id

    async def set_admin_key_hash(self, key_hash: str, *, only_if_unset: bool = False) -> bool:
        return bool(await self._redis.set(self._keys.admin_key_hash, key_hash, nx=only_if_unset))

    # Adapter records.

    async def put_adapter_record(self, record: AdapterRecord) -> AdapterRecord:
        k = self._keys
        key = k.adapter(record.tenant, record.name)

        async def insert(pipe: Pipeline) -> AdapterRecord:
            raw = await pipe.get(k.tenant(record.tenant))
            if raw is None:
                raise NotFound(f"tenant {record.tenant!r} does not exist")
            tenant = msgspec.json.decode(raw, type=Tenant)
            if tenant.max_adapter_bytes is not None:
                check_adapter_storage(tenant, await self._watched_files(pipe, tenant.name), record)
            latest = max((int(v) for v in await pipe.hkeys(key)), default=0)
            stored = msgspec.structs.replace(record, version=latest + 1)
            pipe.multi()
            pipe.hset(key, str(stored.version), _enc(stored))
            pipe.sadd(k.adapters(record.tenant), record.name)
            pipe.sadd(k.digest(record.digest), _ref(stored))
            return stored

        return await self._redis.transaction(
            insert, k.tenant(record.tenant), key, value_from_callable=True
        )

    async def _watched_files(self, pipe: Pipeline, tenant: str) -> dict[str, int]:
        """store.limits.stored_files of every version of every adapter of `tenant`, each key
        watched before it is read: an adapter written or deleted meanwhile retries the caller's
        transaction, which then counts it."""
        k = self._keys
        await pipe.watch(k.adapters(tenant))
        keys = [k.adapter(tenant, name) for name in await pipe.smembers(k.adapters(tenant))]
        if keys:
            await pipe.watch(*keys)
        return stored_files([a for key in keys for a in _decode_versions(await pipe.hvals(key))])

    async def get_adapter(
        self, tenant: str, name: str, version: int | None = None
    ) -> AdapterRecord | None:
        key = self._keys.adapter(tenant, name)
        if version is not None:
            raw = await self._redis.hget(key, str(version))
            return None if raw is None else msgspec.json.decode(raw, type=AdapterRecord)
        versions = _decode_versions(await self._redis.hvals(key))
        return max(versions, key=lambda a: a.version, default=None)

    async def list_adapters(self, tenant: str) -> list[AdapterRecord]:
        latest = [max(versions, key=lambda a: a.version, default=None)
                  for versions in await self._all_versions(tenant)]
        return [a for a in latest if a is not None]

    async def get_adapter_files(self, tenant: str) -> dict[str, int]:
        return stored_files([a for versions in await self._all_versions(tenant) for a in versions])

    async def _all_versions(self, tenant: str) -> list[list[AdapterRecord]]:
        """Every version of each of the tenant's adapters, the adapters sorted by name."""
        names = sorted(await self._redis.smembers(self._keys.adapters(tenant)))
        results = await self._read_together(*(("HVALS", self._keys.adapter(tenant, name))
                                               for name in names))
        return [_decode_versions(raws) for raws in results]

    async def delete_adapter(self, tenant: str, name: str) -> list[AdapterRecord]:
        k = self._keys
        key = k.adapter(tenant, name)

        async def delete(pipe: Pipeline) -> list[AdapterRecord]:
            removed = _decode_versions(await pipe.hvals(key))
            if not removed:
                raise NotFound(f"tenant {tenant!r} has no adapter {name!r}")
            pipe.multi()
            pipe.delete(key)
            pipe.srem(k.adapters(tenant), name)
            for a in removed:
                pipe.srem(k.digest(a.digest), _ref(a))
            return sorted(removed, key=lambda a: a.version)

        return await self._redis.transaction(delete, key, value_from_callable=True)

    async def is_digest_referenced(self, digest: str) -> bool:
        # NOTE: Redis deletes a set when its last member goes, so existence means referenced.
        return await self._redis.exists(self._keys.digest(digest)) > 0

    # Rate limits, budgets and usage.

    async def check_and_consume_rate(
        self, tenant: Tenant, *, requests: int = 1, tokens: int = 0, now: float | None = None,
        overdraw: bool = False,
    ) -> RateDecision:
        costs = rate_costs(tenant, requests, tokens)
        if not costs:
            return RateDecision(True)
        args = [_clock(now), repr(WINDOW_S), int(overdraw)]
        for kind, (limit, cost) in costs.items():
            args += [kind, limit, cost]
        allowed, retry_after, limited_by = await self._rate_script(
            keys=[self._keys.rate(tenant.name)], args=args
        )
        return RateDecision(bool(allowed), float(retry_after), limited_by or None)

    async def reserve_tokens(
        self,
        tenant: Tenant,
        tokens: int,
        *,
        spend_usd: float = 0.0,
        now: float | None = None,
        ttl_s: float = 600.0,
    ) -> Reservation | None:
        # NOTE: the hold lapses ttl_s after Redis's clock (see redis_lua), not r.expires_at.
        r = new_reservation(tenant, tokens, spend_usd, now_or(now), ttl_s)
        budgets = (tenant.monthly_token_budget, tenant.monthly_spend_budget_usd)
        args = [_clock(now), *("" if b is None else repr(b) for b in budgets)]
        args += [tokens, repr(float(spend_usd)), r.id, repr(float(ttl_s)), int(ttl_s) + 1,
                 repr(SPEND_TOLERANCE_USD)]
        keys = [self._keys.usage(r.tenant, r.month), self._keys.holds(r.tenant, r.month)]
        return r if await self._reserve_script(keys=keys, args=args) else None

    async def extend_hold(
        self, reservation: Reservation, *, ttl_s: float = 600.0, now: float | None = None
    ) -> bool:
        args = [reservation.id, _clock(now), repr(float(ttl_s)), int(ttl_s) + 1]
        keys = [self._keys.holds(reservation.tenant, reservation.month)]
        return bool(await self._extend_hold_script(keys=keys, args=args))

    async def settle(
        self, reservation: Reservation, *, tokens_in: int, tokens_out: int, spend_usd: float
    ) -> bool:
        # NOTE: a try whose reply was lost (Redis stopped answering, or restarted, after its
        # EXEC) may have billed the call: the marker it leaves makes trying again bill it once,
        # and says whether it billed the tenant ("1") or nothing ("0").
        k = self._keys
        usage, settled = k.usage(reservation.tenant, reservation.month), k.settled(reservation.id)

        async def settle(pipe: Pipeline) -> bool:
            raw = await pipe.get(k.tenant(reservation.tenant))
            marker = await pipe.get(settled)
            if marker is not None:
                return marker == "1"
            current = raw is not None and \
                msgspec.json.decode(raw, type=Tenant).created_at == reservation.tenant_created_at
            pipe.multi()
            pipe.set(settled, "1" if current else "0", ex=SETTLED_KEPT_S)
            pipe.hdel(k.holds(reservation.tenant, reservation.month), reservation.id)
            if current:  # else the tenant was deleted meanwhile (and maybe made anew): bill nothing
                pipe.hincrby(usage, "requests", 1)
                pipe.hincrby(usage, "tokens_in", tokens_in)
                pipe.hincrby(usage, "tokens_out", tokens_out)
                pipe.hincrbyfloat(usage, "spend_usd", spend_usd)
            return current

        return await self._redis.transaction(settle, k.tenant(reservation.tenant), settled,
                                             value_from_callable=True)

    async def release(self, reservation: Reservation) -> None:
        await self._redis.hdel(self._keys.holds(reservation.tenant, reservation.month),
                               reservation.id)

    async def get_usage(
        self, tenant: str, month: str | None = None, *, now: float | None = None
    ) -> Usage:
        month = month or month_of(now_or(now))
        (counters, holds), clock = await self._read_together.with_clock(
            ("HGETALL", self._keys.usage(tenant, month)), ("HVALS", self._keys.holds(tenant, month)))
        now = clock if now is None else now  # holds lapse by Redis's clock (see redis_lua)
        live = [(int(t), float(s)) for t, s, exp in (h.split() for h in holds) if float(exp) > now]
        return Usage(
            tenant=tenant,
            month=month,
            requests=int(counters.get("requests", 0)),
            tokens_in=int(counters.get("tokens_in", 0)),
            tokens_out=int(counters.get("tokens_out", 0)),
            spend_usd=float(counters.get("spend_usd", 0.0)),
            reserved_tokens=sum(t for t, _ in live),
            reserved_spend_usd=sum((s for _, s in live), 0.0),
        )


def _address(client: aioredis.Redis) -> str:
    """Where `client` connects, without the password its URL may hold."""
    kwargs = client.connection_pool.connection_kwargs
    # redis-py keeps only what the URL spells out ("redis://localhost" has no port or db) and
    # connects to its defaults for the rest.
    return kwargs.get("path") or (f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/"
                                  f"{kwargs.get('db', 0)}")


def _clock(now: float | None) -> str:
    """`now` as the scripts take it: '' for Redis's own clock, the one every gateway reads."""
    return "" if now is None else repr(now)


def _enc(record: msgspec.Struct) -> bytes:
    return msgspec.json.encode(record)


def _ref(adapter: AdapterRecord) -> str:
    # Names cannot contain "/" (store.models.validate_name), so the ref is unambiguous.
    return f"{adapter.tenant}/{adapter.name}/{adapter.version}"


def _decode_versions(raws: list[str]) -> list[AdapterRecord]:
    return [msgspec.json.decode(r, type=AdapterRecord) for r in raws]


async def _mget(client: aioredis.Redis | Pipeline, keys: list[str]) -> list[str]:
    """The values of the keys that exist (MGET fails on an empty key list)."""
    return [] if not keys else [r for r in await client.mget(keys) if r is not None]
