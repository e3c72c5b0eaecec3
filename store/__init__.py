"""Tenants, hashed API keys, adapter records, usage and budgets behind one `Store` protocol.

A call that the store cannot do now raises one of UNAVAILABLE_ERRORS: Redis cannot be reached
or refuses writes, or another process held the SQLite file's write lock too long. The caller should say "retry
shortly"; the store needs no reopening once Redis is back or the lock is let go. Except for those
of them in FULL_ERRORS: the store has no room left (Redis is at its maxmemory, the SQLite file's
volume is full), and refuses writes until its operator makes room, so the caller should say that
instead.
"""

from pathlib import Path

from store.base import Store, refund_rate
from store.errors import (AdapterStorageExceeded, AlreadyExists, InvalidName, InvalidSetting,
                          NotFound, StoreError, StoreFull, StoreUnavailable)
from store.models import AdapterRecord, ApiKeyRecord, RateDecision, Reservation, Tenant, Usage
from store.redis import (REDIS_FULL_ERRORS, REDIS_UNAVAILABLE_CAUSES, REDIS_UNAVAILABLE_ERRORS,
                         RedisStore, masked_url)
from store.sqlite import LOCK_TIMEOUT_S, SqliteStore

UNAVAILABLE_ERRORS = (*REDIS_UNAVAILABLE_ERRORS, StoreUnavailable)
FULL_ERRORS = (*REDIS_FULL_ERRORS, StoreFull)  # some of UNAVAILABLE_ERRORS
_UNAVAILABLE_CAUSES = (
    *REDIS_UNAVAILABLE_CAUSES,
    (StoreFull, "the SQLite file's disk volume is full or fails writes"),
    (StoreUnavailable, f"another process (a backup, a script, an sqlite3 shell) held the SQLite "
     f"file's write lock for more than {LOCK_TIMEOUT_S:g} s"),
)


def unavailable_cause(error: Exception) -> str:
    """Why the store could not do a call (`error`, one of UNAVAILABLE_ERRORS), in words that name
    no address, path or credential, so that a health check anyone may call can show them."""
    return next((cause for kind, cause in _UNAVAILABLE_CAUSES if isinstance(error, kind)),
                "the store failed the call")

DEFAULT_SQLITE_NAME = "switchboard.db"

__all__ = [
    "AdapterRecord",
    "AdapterStorageExceeded",
    "AlreadyExists",
    "ApiKeyRecord",
    "FULL_ERRORS",
    "InvalidName",
    "InvalidSetting",
    "NotFound",
    "RateDecision",
    "RedisStore",
    "Reservation",
    "SqliteStore",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "Tenant",
    "UNAVAILABLE_ERRORS",
    "unavailable_cause",
    "Usage",
    "open_store",
    "refund_rate",
]


async def open_store(url: str | None, data_dir: Path) -> Store:
    """Open the store named by `url`.

    None or "sqlite://" -> `<data_dir>/switchboard.db`; "sqlite:///abs/file.db" -> that file
    ("sqlite://rel.db" is relative to `data_dir`, "sqlite://~/file.db" to the home folder);
    "redis://host:port/db" (or "rediss://") -> Redis.
    """
    if url is None or url.startswith("sqlite://"):
        path = Path((url or "sqlite://").removeprefix("sqlite://") or DEFAULT_SQLITE_NAME).expanduser()
        return await SqliteStore.open(data_dir / path)  # an absolute path replaces data_dir
    if url.startswith(("redis://", "rediss://", "unix://")):
        return await RedisStore.open(url)
    raise StoreError(
        f"unknown store URL {masked_url(url)!r}: use sqlite:///path/to/file.db or redis://host:port/0"
    )
