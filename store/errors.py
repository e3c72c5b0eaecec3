"""Errors raised by the store. All are ValueErrors so a caller can map them to 4xx replies."""


def quoted(value: object, limit: int = 100) -> str:
    """`value` quoted for an error message, a string cut after `limit` characters: echoing a
    client's long string back in full only bloats the error body and the log line."""
    if not isinstance(value, str) or len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


class StoreError(ValueError):
    """Base class: a store call could not be done as asked; the message says why."""

    field: str | None = None  # the record's field at fault, when there is one


class InvalidName(StoreError):
    """A tenant or adapter name (or a digest) does not follow the naming rule."""


class InvalidSetting(StoreError):
    """A field of a record has a value the store refuses; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class AdapterStorageExceeded(StoreError):
    """An adapter record whose files would take its tenant past its max_adapter_bytes."""

    field = "max_adapter_bytes"

    def __init__(self, tenant: str, stored_bytes: int, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(f"tenant {tenant!r} stores {stored_bytes} bytes of adapter files; "
                         f"{size_bytes} more would take it past its max_adapter_bytes of {limit_bytes}")
        self.tenant = tenant
        self.stored_bytes = stored_bytes
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes


class NotFound(StoreError):
    """The tenant, key or adapter named in the call does not exist."""


class AlreadyExists(StoreError):
    """The tenant being created already exists."""


class StoreUnavailable(Exception):
    """The store cannot do the call now (another process held SQLite's write lock past
    store.sqlite.LOCK_TIMEOUT_S); retry shortly. Not a StoreError: nothing was wrong with the call."""


class StoreFull(StoreUnavailable):
    """The SQLite file's volume has no room for the call's writes (or fails them: a disk I/O
    error, a disk quota): unlike a lock, this lasts until the operator frees disk space there;
    the store takes writes again by itself once there is room."""
