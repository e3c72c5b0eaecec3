"""The one error the adapters package raises for an adapter it will not serve."""


class AdapterValidationError(ValueError):
    """An adapter folder cannot be served on this base model; the message says why and what to do.

    A ValueError, so the admin API can map it to a 400 reply without importing this package's
    internals.
    """


def shown(text: str, limit: int = 200) -> str:
    """`text`, a name read from an uploaded adapter's files, for an error message: cut after
    `limit` characters, as a file can hold names of megabytes, which echoed whole would only bloat
    the reply and the log line."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
