"""The one error the adapters package raises for an adapter it will not serve."""


class AdapterValidationError(ValueError):
    """An adapter folder cannot be served on this base model; the message says why and what to do.

    A ValueError, so the admin API can map it to a 400 reply without importing this package's
    internals.
    """
