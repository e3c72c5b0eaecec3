"""Tenants, hashed API keys, adapter records, usage and budgets behind one `Store` protocol.

A call to a store whose server cannot be reached (Redis down) raises one of UNAVAILABLE_ERRORS:
the caller should say "retry shortly"; the store reconnects by itself once the server is back.
"""

from pathlib import Path

from store.base import Store
from store.errors import AlreadyExists, InvalidName, NotFound, StoreError
from store.models import AdapterRecord, ApiKeyRecord, RateDecision, Reservation, Tenant, Usage
from store.redis import UNAVAILABLE_ERRORS, RedisStore
from store.sqlite import SqliteStore

DEFAULT_SQLITE_NAME = "switchboard.db"

__all__ = [
    "AdapterRecord",
    "AlreadyExists",
    "ApiKeyRecord",
    "InvalidName",
    "NotFound",
    "RateDecision",
    "RedisStore",
    "Reservation",
    "SqliteStore",
    "Store",
    "StoreError",
    "Tenant",
    "UNAVAILABLE_ERRORS",
    "Usage",
    "open_store",
]


async def open_store(url: str | None, data_dir: Path) -> Store:
    """Open the store named by `url`.

    None or "sqlite://" -> `<data_dir>/switchboard.db`; "sqlite:///abs/file.db" -> that file
    ("sqlite://rel.db" is relative to `data_dir`); "redis://host:port/db" (or "rediss://") -> Redis.
    """
    if url is None or url.startswith("sqlite://"):
        path = (url or "sqlite://").removeprefix("sqlite://") or DEFAULT_SQLITE_NAME
        return await SqliteStore.open(data_dir / path)  # an absolute path replaces data_dir
    if url.startswith(("redis://", "rediss://", "unix://")):
        return await RedisStore.open(url)
    raise StoreError(
        f"unknown store URL {url!r}: use sqlite:///path/to/file.db or redis://host:port/0"
    )
